//! The collect phase: the test report read from the guest and counted, the artifacts read from
//! the guest and published to their destination. Guest files come out through
//! [`READ_GUEST_FILE`], bounded in size and time.

use std::path::Path;
use std::time::Duration;
use tartan_tart::{ExecOptions, OutputConsumer};

use super::{AttemptExecutor, Performed};
use crate::host::artifacts::{
    Destination, DestinationPolicy, DestinationRefused, allowed_destination, artifact_key, upload,
};
use crate::host::guest_copy::{MemoryCopy, ScreenedCopy};
use crate::host::junit::count_report;
use crate::machine::Event;

impl AttemptExecutor {
    pub(super) async fn collect_results(&mut self) -> Performed {
        let Some(report) = self.attempt.spec.test_report.clone() else {
            return Performed::Done;
        };
        // In memory (at most the report cap), never on the host disk: the report is the build's
        // own text, and a failure message quoting the environment is common.
        let copy = MemoryCopy::default();
        let read = match self.ensure_mask().await {
            Ok(()) => {
                self.read_guest_file(&report, self.cfg.report_cap, Box::new(copy.clone()))
                    .await
            }
            Err(e) => Err(format!("the Secrets to mask in it could not be read again ({e})")),
        };
        let counted = match read {
            Err(e) => Err(format!("test report {report} could not be read from the guest: {e}")),
            // Counted off the runtime's threads, as a stream: never built into a tree.
            Ok(_) => {
                let (bytes, what, mask) = (copy.take(), report.clone(), self.masker());
                let counted = tokio::task::spawn_blocking(move || {
                    count_report(&what, bytes.as_slice()).map_err(|e| e.masked(&mask).to_string())
                });
                counted
                    .await
                    .unwrap_or_else(|e| Err(format!("counting test report {report} failed: {e}")))
            }
        };
        match counted {
            Ok(c) => {
                tracing::info!(vm = %self.attempt.vm, total = c.total, failed = c.failed(), skipped = c.skipped, "test report counted");
                self.counts = Some(c);
                if c.failed() > 0 {
                    Performed::Event(Event::TestsFailed {
                        failed: c.failed(),
                        total: c.total,
                    })
                } else {
                    Performed::Done
                }
            }
            Err(e) => {
                tracing::warn!(vm = %self.attempt.vm, error = %e, "test report unusable; the attempt fails");
                self.report_error = Some(e.clone());
                Performed::Event(Event::TestReportUnusable { error: e })
            }
        }
    }

    pub(super) async fn upload_artifacts(&mut self) -> Performed {
        let counts = self.counts.unwrap_or_default();
        let passed = Event::TestsPassed {
            passed: counts.passed(),
            total: counts.total,
        };
        let Some(artifacts) = self.attempt.spec.artifacts.clone() else {
            return Performed::Event(passed);
        };
        let failed = |error: String| Performed::Event(Event::ArtifactUploadFailed { error });
        // Checked again: the folders may have changed since the admission, and the upload must
        // write to the folder as resolved now.
        let dest = match self.artifact_destination() {
            Some(Ok(d)) => d,
            Some(Err(e)) => return failed(e.to_string()),
            None => return Performed::Event(passed),
        };
        if let Err(e) = self.ensure_mask().await {
            return failed(format!(
                "no artifact is published: the Secrets to mask could not be read again ({e})"
            ));
        }
        let vm = self.attempt.vm.clone();
        let mut urls = Vec::new();
        for (i, path) in artifacts.paths.iter().enumerate() {
            let key = match artifact_key(&vm, path) {
                Ok(k) => k,
                Err(e) => return failed(e.to_string()),
            };
            let host = self.tmp_dir().join(format!("artifact-{i}"));
            let size = match self.read_artifact(path, &host).await {
                Ok(n) => n,
                Err(e) => {
                    let _ = std::fs::remove_file(&host);
                    return failed(e);
                }
            };
            crate::crash_point!("artifacts.upload.before");
            let result = upload(&dest, &key, &host, &self.cfg.upload, &self.cfg.artifacts).await;
            crate::crash_point!("artifacts.upload.after");
            let _ = std::fs::remove_file(&host);
            match result {
                Ok(url) => {
                    tracing::info!(%vm, %path, %url, size, "artifact published");
                    urls.push(url);
                }
                Err(e) => return failed(e.to_string()),
            }
        }
        self.artifact_url = match urls.as_slice() {
            [one] => Some(one.clone()),
            _ => Some(dest.url_of(&format!("{vm}/"))),
        };
        Performed::Event(passed)
    }

    /// Copies guest artifact `path` to host file `to` for its upload, screened for Secret values
    /// on its way ([`ScreenedCopy`]): a value is never written, and stops the read (masking
    /// would corrupt the file: it is refused, not published). Returns the size.
    async fn read_artifact(&self, path: &str, to: &Path) -> Result<u64, String> {
        let copy = ScreenedCopy::create(to, self.masker().screen())?;
        let read = self
            .read_guest_file(path, self.cfg.artifact_cap, Box::new(copy.clone()))
            .await;
        let found = copy.found();
        match (read, found) {
            (_, Some(at)) => Err(format!(
                "artifact {path} holds the value of a Secret of spec.env (at byte {at}); it is not published"
            )),
            (Err(e), None) => Err(format!("artifact {path} could not be read from the guest: {e}")),
            (Ok(size), None) => copy
                .finish()
                .map(|()| size)
                .map_err(|e| format!("artifact {path} could not be copied to {}: {e}", to.display())),
        }
    }

    /// Reads guest file `path` (at most `cap` bytes) into `consumer` through `tart exec`
    /// ([`READ_GUEST_FILE`]): only a regular file within the cap is read; anything else (a
    /// folder, a FIFO, a device such as `/dev/zero`, a file over the cap, sparse or not) is
    /// refused in the guest with a message naming it. The guest is not trusted with the limits:
    /// the exec is killed at the cap ([`ExecOptions::stop_at_cap`]), after [`guest_read_limit`],
    /// and when the consumer refuses what came. Returns the size.
    async fn read_guest_file(&self, path: &str, cap: u64, consumer: Box<dyn OutputConsumer>) -> Result<u64, String> {
        let limit = guest_read_limit(cap, self.cfg.guest_read_floor);
        let options = ExecOptions {
            log_path: Default::default(),
            log_cap: cap,
            tail_bytes: 2048,
            timeout: limit.min(self.exec_timeout()),
            stop_at_cap: true,
        };
        let argv: Vec<String> = ["sh", "-c", READ_GUEST_FILE, "sh", path, &cap.to_string()]
            .iter()
            .map(|s| s.to_string())
            .collect();
        // What the guest printed (its complaints) is quoted only masked.
        let mask = self.masker();
        let vm = &self.attempt.vm;
        let read = self
            .tart
            .exec_into(vm, &argv, consumer, &options)
            .await
            .map_err(|e| match e {
                tartan_tart::TartError::ExecTimeout { .. } => {
                    format!("{path} did not come out of the guest within {limit:?}; the read was killed")
                }
                e => mask.mask_text(&e.to_string()),
            })?;
        if let Some(why) = read.refused {
            return Err(why);
        }
        let out = read.outcome;
        if out.truncated {
            return Err(format!(
                "{path} is larger than the {cap}-byte limit; the read was stopped there"
            ));
        }
        if out.exit_code != 0 {
            return Err(guest_read_failed(path, out.exit_code, &out.tail, &mask));
        }
        Ok(out.output_bytes)
    }

    /// Where the artifacts go, if the spec publishes any and the agent config allows it there.
    pub(super) fn artifact_destination(&self) -> Option<Result<Destination, DestinationRefused>> {
        let named = &self.attempt.spec.artifacts.as_ref()?.destination;
        let home = self.tart.home().ok();
        let policy = DestinationPolicy::new(&self.cfg.artifacts, &self.cfg.state_dir, home.as_deref());
        Some(allowed_destination(named, &policy))
    }
}

/// The guest side of `AttemptExecutor::read_guest_file` (`sh -c` with the path as `$1` and the
/// cap as `$2`, never part of the script text): refuses what is not a regular file and a file
/// over the cap before reading a byte, saying which and why after `tartan: `. `wc -c` takes a
/// regular file's size from its metadata, so a huge sparse file is not read to be measured.
pub const READ_GUEST_FILE: &str = r#"f=$1; cap=$2
if [ ! -e "$f" ] && [ ! -L "$f" ]; then echo "tartan: $f does not exist" >&2; exit 66; fi
if [ ! -f "$f" ]; then echo "tartan: $f is not a regular file (a folder, FIFO, device, socket or dangling link); only regular files are read" >&2; exit 65; fi
size=$(wc -c < "$f") || exit 65
size=$((size + 0))
if [ "$size" -gt "$cap" ]; then echo "tartan: $f is $size bytes, more than the $cap-byte limit" >&2; exit 65; fi
exec cat < "$f"
"#;

/// Why reading guest file `path` failed, from the read's exit code and the end of its output
/// (`tail`: the file's bytes, then the guest's complaint), with `mask`'s Secret values masked.
/// The script's own refusal is the whole message. Otherwise only the output's last line is
/// quoted (the complaint, e.g. `cat`'s), and only when the tail holds the line whole: the rest is
/// the file's content, and a tail cut inside a value would show that value's end, which no
/// masking can recognise.
pub fn guest_read_failed(path: &str, exit_code: i32, tail: &str, mask: &crate::host::env::Masker) -> String {
    // Masked before any trimming: a value that starts or ends with whitespace is whole only here.
    let masked = mask.mask_text(tail);
    let tail = masked.trim();
    if let Some(why) = tail.strip_prefix("tartan: ") {
        return why.to_string();
    }
    match tail.rsplit_once('\n') {
        Some((_, last)) => format!("reading {path} in the guest exited {exit_code}: {}", last.trim()),
        None => format!("reading {path} in the guest exited {exit_code}"),
    }
}

/// Bytes per second a guest file is expected to come out at, at least.
pub const GUEST_READ_RATE: u64 = 16 << 20;

/// How long reading a guest file of at most `cap` bytes may take: `floor`, plus a second per
/// [`GUEST_READ_RATE`] bytes of the cap.
pub fn guest_read_limit(cap: u64, floor: Duration) -> Duration {
    floor.saturating_add(Duration::from_secs(cap.div_ceil(GUEST_READ_RATE)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by an adversary: a failed guest read quoted up to 2 KiB of the file unmasked.
    #[test]
    fn a_failed_guest_read_quotes_the_guest_masked() {
        let mask = crate::host::env::Masker::new([&b"s3cr3t-token"[..]]);
        assert_eq!(
            guest_read_failed("out/junit.xml", 1, "<x>s3cr3t-token</x>\ncat: read error\n", &mask),
            "reading out/junit.xml in the guest exited 1: cat: read error"
        );
        assert_eq!(
            guest_read_failed("out/junit.xml", 1, "<x>s3cr3t-token</x>\n<y>s3cr3t-token</y>\n", &mask),
            "reading out/junit.xml in the guest exited 1: <y>***</y>"
        );
        assert_eq!(
            guest_read_failed("out/junit.xml", 1, "-token</x> a line cut at its start", &mask),
            "reading out/junit.xml in the guest exited 1"
        );
        assert_eq!(
            guest_read_failed("out/a", 66, "tartan: out/a does not exist\n", &mask),
            "out/a does not exist"
        );
    }

    /// Adversary finding: the tail a failed guest read quotes is its output's last 2 KiB, cut
    /// wherever that falls, and masked alone: a value the cut falls inside shows its end in clear
    /// (the step log's failure tail is read from a value's length earlier for this, `mask_window`).
    #[test]
    fn a_failed_guest_read_whose_tail_starts_inside_a_value_shows_none_of_it() {
        let value = "S3CRET-deploy-token-0123456789";
        let mask = crate::host::env::Masker::new([value.as_bytes()]);
        // The file's bytes then the guest's complaint; tart's exec keeps the last 2048 bytes,
        // which here start 10 bytes into the value.
        let (after, complaint) = ("</x>\n", "\ncat: read error\n");
        let pad = "y".repeat(2048 - (value.len() - 10) - after.len() - complaint.len());
        let output = format!("<testsuite><x>{value}{after}{pad}{complaint}");
        let tail = &output[output.len() - 2048..];
        assert!(tail.starts_with(&value[10..]), "{tail:?}");
        let said = guest_read_failed("out/junit.xml", 1, tail, &mask);
        assert!(
            !said.contains(&value[10..]),
            "the end of a Secret value reaches the error: {said:?}"
        );
    }

    /// Adversary finding: the tail is text made with `from_utf8_lossy`, then masked: a value that
    /// is not valid UTF-8 (a binary Secret: a keystore, a provisioning profile) no longer matches
    /// once its invalid bytes became U+FFFD, so its valid runs are quoted in clear.
    #[test]
    fn a_failed_guest_read_masks_a_value_that_is_not_utf8() {
        let value = b"\xff\xfe-keystore-password-part";
        let mask = crate::host::env::Masker::new([&value[..]]);
        let output = [&b"<x>"[..], value, b"</x>\ncat: read error\n"].concat();
        // As tart's exec hands the tail over.
        let tail = String::from_utf8_lossy(&output).into_owned();
        let said = guest_read_failed("out/junit.xml", 1, &tail, &mask);
        assert!(
            !said.contains("-keystore-password-part"),
            "part of a Secret value reaches the error: {said:?}"
        );
    }

    #[test]
    fn a_guest_read_gets_the_floor_plus_a_second_per_rate_of_its_cap() {
        let floor = Duration::from_secs(60);
        for (cap, want) in [
            (0, 60),
            (1, 61),
            (32 << 20, 62),
            (GUEST_READ_RATE, 61),
            (GUEST_READ_RATE + 1, 62),
            (16 << 30, 60 + 1024),
            (u64::MAX, 60 + u64::MAX.div_ceil(GUEST_READ_RATE)),
        ] {
            assert_eq!(guest_read_limit(cap, floor), Duration::from_secs(want), "{cap}");
        }
    }
}
