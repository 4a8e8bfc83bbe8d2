//! Live step logs: while an attempt runs, the new bytes of its host step logs
//! (`<state>/logs/<vm>/<step>.log`, written by the guest-job follower) go to the build's artifact
//! destination every [`ShipSettings::interval`], as numbered parts under `<dest>/<vm>/logs/`, and
//! each whole log once more when the attempt ends (layout: [`tartan_api::logs`]).
//!
//! Shipping never fails or holds up the build: it runs on a task of its own, each request is
//! bounded by [`ShipSettings::put_timeout`], a failed part is tried again at the next interval
//! (the bytes stay in the host log), and the end ([`LogShipper::finish`]) is bounded by
//! [`ShipSettings::finish_limit`], after which whatever is left stays only on the host.
//!
//! A shipper started for an attempt that an earlier agent process already shipped for (a resumed
//! or retired attempt after a restart) first lists what is there, and goes on with the next part
//! number from the byte count the parts hold: the host log holds the same bytes (the follower
//! re-fetches what it lost from the guest), so nothing repeats.
//!
//! Secret masking happens where the host logs are written; the shipper copies those files only.

use super::artifacts::{Destination, UploadPolicy, put_bytes, s3_store, upload};
use crate::config::ArtifactsConfig;
use futures::TryStreamExt;
use object_store::ObjectStore;
use object_store::path::Path as ObjectPath;
use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tartan_api::destination::join_key;
use tartan_api::logs::{LogObject, is_step_log_name, logs_prefix, parse_object_name, part_name, whole_name};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// How the step logs are shipped. Defaults suit a real Mac.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShipSettings {
    /// How often new output is shipped (`[logs] ship_interval`, 5 s).
    pub interval: Duration,
    /// Limit of one request (a part, a listing, a whole log); a request past it counts as
    /// failed and is tried again at the next interval.
    pub put_timeout: Duration,
    /// How long the end of an attempt waits for the last parts and the whole logs. It runs
    /// alongside the VM's stop and deletion, so a healthy store adds nothing to the retirement,
    /// and a broken one at most this.
    pub finish_limit: Duration,
    /// Most bytes in one part.
    pub part_max: u64,
}

impl Default for ShipSettings {
    fn default() -> Self {
        ShipSettings {
            interval: Duration::from_secs(5),
            put_timeout: Duration::from_secs(10),
            finish_limit: Duration::from_secs(15),
            part_max: 8 << 20,
        }
    }
}

/// What has been shipped of one step log.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Shipped {
    /// Bytes of the host log the parts hold.
    pub bytes: u64,
    /// The number the next part gets.
    pub next_part: u32,
}

/// What an earlier shipper of the attempt left, from the names and sizes of the objects in the
/// logs folder (others are skipped).
pub fn shipped_from_listing(objects: &[(String, u64)]) -> BTreeMap<String, Shipped> {
    let mut out: BTreeMap<String, Shipped> = BTreeMap::new();
    for (name, size) in objects {
        if let Some(LogObject::Part { step, n }) = parse_object_name(name) {
            let s = out.entry(step).or_insert(Shipped { bytes: 0, next_part: 1 });
            s.bytes = s.bytes.saturating_add(*size);
            s.next_part = s.next_part.max(n.saturating_add(1));
        }
    }
    out
}

/// One part to write: bytes `from..from + len` of step `step`'s host log as part `n`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartPlan {
    pub step: String,
    pub n: u32,
    pub from: u64,
    pub len: u64,
}

/// The parts that ship what the host logs (`(step, length)`) hold beyond `shipped`, at most
/// `part_max` bytes each, in step order and then part order.
pub fn plan_parts(logs: &[(String, u64)], shipped: &BTreeMap<String, Shipped>, part_max: u64) -> Vec<PartPlan> {
    let part_max = part_max.max(1);
    let mut plan = Vec::new();
    for (step, len) in logs {
        let mut s = shipped.get(step).copied().unwrap_or(Shipped { bytes: 0, next_part: 1 });
        while s.bytes < *len {
            let n = (*len - s.bytes).min(part_max);
            plan.push(PartPlan {
                step: step.clone(),
                n: s.next_part,
                from: s.bytes,
                len: n,
            });
            s.bytes += n;
            s.next_part = s.next_part.saturating_add(1);
        }
    }
    plan
}

/// The step logs in host folder `dir` and their lengths: regular files `<step>.log` with a step
/// name [`is_step_log_name`] accepts (not the follower's `.follow`/`.poll` sidecars), by name.
pub fn host_logs(dir: &Path) -> Result<Vec<(String, u64)>, String> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("reading {}: {e}", dir.display())),
    };
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let Some(name) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        let Some(step) = name.strip_suffix(".log").filter(|s| is_step_log_name(s)) else {
            continue;
        };
        match entry.metadata() {
            Ok(m) if m.is_file() => out.push((step.to_string(), m.len())),
            _ => continue,
        }
    }
    out.sort();
    Ok(out)
}

/// Bytes `from..from + len` of `file`.
fn read_range(file: &Path, from: u64, len: u64) -> Result<Vec<u8>, String> {
    let mut f = std::fs::File::open(file).map_err(|e| format!("opening {}: {e}", file.display()))?;
    f.seek(SeekFrom::Start(from))
        .map_err(|e| format!("seeking {}: {e}", file.display()))?;
    let mut buf = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
    f.take(len)
        .read_to_end(&mut buf)
        .map_err(|e| format!("reading {}: {e}", file.display()))?;
    if (buf.len() as u64) < len {
        return Err(format!(
            "{} holds {} bytes from {from}, not the {len} measured",
            file.display(),
            buf.len()
        ));
    }
    Ok(buf)
}

/// The shipper of one attempt; made by [`LogShipper::start`], ended by [`LogShipper::finish`].
/// Dropped without finishing (the agent stopping), its task is aborted; the next agent's shipper
/// goes on from what the destination holds.
pub struct LogShipper {
    location: String,
    finish: watch::Sender<bool>,
    task: Option<JoinHandle<String>>,
}

/// The worker side: where it reads and writes, and what it has shipped.
struct Worker {
    vm: String,
    host_dir: PathBuf,
    dest: Destination,
    location: String,
    s3: Option<Arc<dyn ObjectStore>>,
    settings: ShipSettings,
    artifacts: ArtifactsConfig,
    /// `None` until the destination's listing was read.
    shipped: Option<BTreeMap<String, Shipped>>,
    failures: u32,
    last_warning: Option<Instant>,
}

/// How often repeated shipping failures are logged (the first one always is).
const WARN_EVERY: Duration = Duration::from_secs(60);

impl LogShipper {
    /// Starts shipping the step logs of attempt `vm` (host folder `host_dir`) to `dest`. Returns
    /// at once; the first pass runs at once on the shipper's task.
    pub fn start(
        vm: &str,
        host_dir: PathBuf,
        dest: Destination,
        settings: ShipSettings,
        artifacts: &ArtifactsConfig,
    ) -> LogShipper {
        let location = dest.url_of(&logs_prefix(vm));
        let (finish, mut finishing) = watch::channel(false);
        let s3 = match &dest {
            Destination::S3 { bucket, .. } => match s3_store(bucket, artifacts) {
                Ok(store) => Some(store),
                Err(error) => {
                    // Each request says so again; the build goes on without live logs.
                    tracing::warn!(%vm, %location, %error, "no S3 client for shipping the step logs; every shipping try will fail");
                    None
                }
            },
            Destination::File { .. } => None,
        };
        let mut worker = Worker {
            vm: vm.to_string(),
            host_dir,
            dest,
            location: location.clone(),
            s3,
            settings,
            artifacts: artifacts.clone(),
            shipped: None,
            failures: 0,
            last_warning: None,
        };
        tracing::info!(%vm, %location, interval = ?worker.settings.interval, "shipping step logs");
        let task = tokio::spawn(async move {
            let mut ticks = tokio::time::interval(worker.settings.interval);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    biased;
                    // Asked to finish, or the shipper is gone (then the task is aborted too).
                    () = async { let _ = finishing.wait_for(|f| *f).await; } => break,
                    _ = ticks.tick() => {
                        let outcome = worker.pass().await;
                        worker.note(outcome);
                    }
                }
            }
            worker.finish().await
        });
        LogShipper {
            location,
            finish,
            task: Some(task),
        }
    }

    /// `<dest>/<vm>/logs/`: where the logs go (`status.logs`).
    pub fn location(&self) -> &str {
        &self.location
    }

    /// Asks the shipper to ship what is left and the whole logs, then end; returns at once.
    pub fn begin_finish(&self) {
        let _ = self.finish.send(true);
    }

    /// Waits for the end [`begin_finish`](Self::begin_finish) asked for (asking it if not yet),
    /// for at most what is left of `limit` since `since` (the caller may have done other work
    /// meanwhile); past it the task is aborted and what is missing stays in the host folder.
    /// Never fails: the outcome is logged.
    pub async fn finish(mut self, since: Instant, limit: Duration) {
        self.begin_finish();
        let Some(mut task) = self.task.take() else { return };
        let left = limit.saturating_sub(since.elapsed());
        match tokio::time::timeout(left, &mut task).await {
            Ok(Ok(summary)) => tracing::info!(location = %self.location, %summary, "step logs finished"),
            Ok(Err(error)) => {
                tracing::warn!(location = %self.location, %error, "the step log shipper failed; the logs stay in the host folder")
            }
            Err(_) => {
                task.abort();
                tracing::warn!(location = %self.location, ?limit, "step logs not finished within the limit; what is missing stays in the host folder and the build goes on")
            }
        }
    }
}

impl Drop for LogShipper {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

impl Worker {
    /// Runs `what` within the request limit.
    async fn bounded<T, E: std::fmt::Display>(
        &self,
        what: &str,
        f: impl Future<Output = Result<T, E>>,
    ) -> Result<T, String> {
        match tokio::time::timeout(self.settings.put_timeout, f).await {
            Ok(r) => r.map_err(|e| e.to_string()),
            Err(_) => Err(format!("{what}: no answer within {:?}", self.settings.put_timeout)),
        }
    }

    /// Names and sizes of what the destination's logs folder holds.
    async fn list(&self) -> Result<Vec<(String, u64)>, String> {
        let prefix = logs_prefix(&self.vm);
        match &self.dest {
            Destination::File { dir } => {
                // Walked as the writes are (no link followed): a planted link can neither hide
                // parts nor make the shipper count another folder's.
                let folder = dir.join(&prefix);
                let read = tokio::task::spawn_blocking(move || super::nofollow::list_files(&folder));
                read.await.map_err(|e| format!("listing task failed: {e}"))?
            }
            Destination::S3 { bucket, prefix: p } => {
                let store = self
                    .s3
                    .as_ref()
                    .ok_or_else(|| format!("no S3 client for bucket {bucket}"))?;
                let key = join_key(p, prefix.trim_end_matches('/'));
                let location = ObjectPath::parse(&key).map_err(|e| format!("object key {key:?} is not valid: {e}"))?;
                let metas: Vec<_> = store
                    .list(Some(&location))
                    .try_collect()
                    .await
                    .map_err(|e| format!("listing s3://{bucket}/{key}/: {e}"))?;
                Ok(metas
                    .into_iter()
                    .filter_map(|m| Some((m.location.filename()?.to_string(), m.size)))
                    .collect())
            }
        }
    }

    /// Ships every new byte of the host logs. Stops at the first failure (the store is likely
    /// down; the next pass tries again from there).
    async fn pass(&mut self) -> Result<usize, String> {
        if self.shipped.is_none() {
            let listing = self.bounded(&format!("listing {}", self.location), self.list()).await?;
            self.shipped = Some(shipped_from_listing(&listing));
        }
        let dir = self.host_dir.clone();
        let logs = tokio::task::spawn_blocking(move || host_logs(&dir))
            .await
            .map_err(|e| format!("scanning task failed: {e}"))??;
        let plan = plan_parts(&logs, self.shipped.as_ref().expect("set above"), self.settings.part_max);
        let count = plan.len();
        for part in plan {
            let file = self.host_dir.join(whole_name(&part.step));
            let (from, len) = (part.from, part.len);
            let bytes = tokio::task::spawn_blocking(move || read_range(&file, from, len))
                .await
                .map_err(|e| format!("reading task failed: {e}"))??;
            let key = format!("{}{}", logs_prefix(&self.vm), part_name(&part.step, part.n));
            let url = self.dest.url_of(&key);
            self.bounded(
                &format!("writing {url}"),
                put_bytes(&self.dest, self.s3.as_ref(), &key, bytes),
            )
            .await?;
            let s = self
                .shipped
                .as_mut()
                .expect("set above")
                .entry(part.step.clone())
                .or_insert(Shipped { bytes: 0, next_part: 1 });
            s.bytes = part.from + part.len;
            s.next_part = part.n.saturating_add(1);
        }
        Ok(count)
    }

    /// Logs a pass's failure (the first at once, then at most every [`WARN_EVERY`]) or the
    /// recovery after failures.
    fn note(&mut self, outcome: Result<usize, String>) {
        match outcome {
            Ok(_) if self.failures > 0 => {
                tracing::info!(vm = %self.vm, location = %self.location, failures = self.failures, "shipping step logs works again");
                self.failures = 0;
                self.last_warning = None;
            }
            Ok(_) => {}
            Err(error) => {
                self.failures += 1;
                if self.last_warning.is_none_or(|t| t.elapsed() >= WARN_EVERY) {
                    self.last_warning = Some(Instant::now());
                    tracing::warn!(vm = %self.vm, location = %self.location, %error, failures = self.failures, retry_in = ?self.settings.interval,
                        "shipping step logs failed; the build goes on, the output stays in the host log and is shipped at the next try");
                }
            }
        }
    }

    /// The last parts, then every log whole. Returns a summary for the log line.
    async fn finish(mut self) -> String {
        if let Err(error) = self.pass().await {
            self.note(Err(error.clone()));
            return format!("the last parts were not shipped ({error}); the whole logs were not written");
        }
        let dir = self.host_dir.clone();
        let logs = match tokio::task::spawn_blocking(move || host_logs(&dir)).await {
            Ok(Ok(l)) => l,
            Ok(Err(e)) => return format!("the whole logs were not written: {e}"),
            Err(e) => return format!("the whole logs were not written: scanning task failed: {e}"),
        };
        let once = UploadPolicy {
            attempts: 1,
            attempt_timeout: self.settings.put_timeout,
            ..UploadPolicy::default()
        };
        let mut written = Vec::new();
        for (step, _) in &logs {
            let key = format!("{}{}", logs_prefix(&self.vm), whole_name(step));
            let file = self.host_dir.join(whole_name(step));
            if let Err(e) = upload(&self.dest, &key, &file, &once, &self.artifacts).await {
                tracing::warn!(vm = %self.vm, error = %e, "a whole step log was not written; its parts hold it");
                return format!("parts complete; whole logs written: {written:?}; then: {e}");
            }
            written.push(step.clone());
        }
        format!("parts complete; whole logs written: {written:?}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logs(v: &[(&str, u64)]) -> Vec<(String, u64)> {
        v.iter().map(|(s, n)| (s.to_string(), *n)).collect()
    }

    #[test]
    fn parts_cover_the_new_bytes_once_in_order_and_within_the_size_limit() {
        let none = BTreeMap::new();
        let plan = plan_parts(&logs(&[("_checkout", 0), ("build", 25)]), &none, 10);
        let got: Vec<_> = plan.iter().map(|p| (p.step.as_str(), p.n, p.from, p.len)).collect();
        assert_eq!(got, [("build", 1, 0, 10), ("build", 2, 10, 10), ("build", 3, 20, 5)]);
        // After those, only what the log gained since.
        let shipped = BTreeMap::from([(
            "build".to_string(),
            Shipped {
                bytes: 25,
                next_part: 4,
            },
        )]);
        let plan = plan_parts(&logs(&[("build", 31), ("test", 3)]), &shipped, 10);
        let got: Vec<_> = plan.iter().map(|p| (p.step.as_str(), p.n, p.from, p.len)).collect();
        assert_eq!(got, [("build", 4, 25, 6), ("test", 1, 0, 3)]);
        // Nothing new, or a host log shorter than what was shipped (cut back at a restart, to
        // be re-fetched): nothing to do.
        assert!(plan_parts(&logs(&[("build", 25)]), &shipped, 10).is_empty());
        assert!(plan_parts(&logs(&[("build", 20)]), &shipped, 10).is_empty());
    }

    #[test]
    fn an_earlier_shippers_parts_are_continued_not_repeated() {
        let listing = logs(&[
            ("build.log.part000001", 10),
            ("build.log.part000002", 7),
            ("build.log", 17),
            ("test.log.part000003", 4),
            (".build.log.part000003.77.part", 99),
            ("notes.txt", 5),
        ]);
        let shipped = shipped_from_listing(&listing);
        assert_eq!(
            shipped,
            BTreeMap::from([
                (
                    "build".to_string(),
                    Shipped {
                        bytes: 17,
                        next_part: 3
                    }
                ),
                ("test".to_string(), Shipped { bytes: 4, next_part: 4 }),
            ])
        );
        let plan = plan_parts(&logs(&[("build", 20)]), &shipped, 100);
        assert_eq!(
            plan,
            [PartPlan {
                step: "build".into(),
                n: 3,
                from: 17,
                len: 3
            }]
        );
    }

    #[test]
    fn only_step_logs_are_picked_from_the_host_folder() {
        let dir = tempfile::tempdir().unwrap();
        for (name, bytes) in [
            ("build.log", &b"hello"[..]),
            ("_checkout.log", b""),
            ("build.log.follow", b"tartan-follow x 0 0\n"),
            ("build.log.poll", b"x"),
            ("odd name.log", b"x"),
        ] {
            std::fs::write(dir.path().join(name), bytes).unwrap();
        }
        std::fs::create_dir(dir.path().join("dir.log")).unwrap();
        assert_eq!(host_logs(dir.path()).unwrap(), logs(&[("_checkout", 0), ("build", 5)]));
        assert_eq!(host_logs(&dir.path().join("absent")).unwrap(), vec![]);
        assert_eq!(read_range(&dir.path().join("build.log"), 1, 3).unwrap(), b"ell");
        let e = read_range(&dir.path().join("build.log"), 3, 9).unwrap_err();
        assert!(e.contains("holds 2 bytes from 3, not the 9 measured"), "{e}");
    }
}
