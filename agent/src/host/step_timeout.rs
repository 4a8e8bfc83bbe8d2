//! `steps[].timeoutSeconds`: stopping a step's detached guest job ([`super::guest_job`]) once it
//! has run longer than its limit.
//!
//! The limit counts from the step's start as the journal has it ([`crate::machine::Action::RunStep`]'s
//! `since`), so a step followed again by a restarted agent keeps its original deadline.
//!
//! The job is stopped in the guest by [`stop_argv`]'s script: it freezes (SIGSTOP) every
//! descendant of the job's wrapper shell until the set stops growing (a frozen process cannot
//! fork), then SIGKILLs each of them and, for one leading its own process group (the step itself,
//! which the wrapper starts under job control on macOS), that whole group. The wrapper is left
//! alone: it sees its step die and writes the exit status (137) and the output size as for any
//! other end, so the follower reads the step's complete output and its end. Processes are found by
//! parentage (`pgrep -P`), which macOS and Linux (tart-double's guests, whose `sh` has no job
//! control) both have.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use tartan_tart::{ExecOptions, Tart, TartError};

use super::guest_job::Job;

/// The stop script: `$1` is the job folder. It prints one line, read by [`parse_stop`]. Like the
/// job scripts it writes nothing to stderr.
const STOP_SCRIPT: &str = r#"exec 2>/dev/null
d=$1
if [ -f "$d/exit" ]; then echo "tartan-job exited $(cat "$d/exit")"; exit 0; fi
pid=
if [ -f "$d/pid" ]; then pid=$(cat "$d/pid"); fi
case $pid in ''|*[!0-9]*) echo "tartan-job nopid"; exit 0 ;; esac
tree() { for c in $(pgrep -P "$1"); do echo "$c"; tree "$c"; done; }
all=
i=0
while [ $i -lt 100 ]; do
  now=$(tree "$pid")
  [ "$now" = "$all" ] && break
  all=$now
  for c in $all; do kill -STOP "$c"; done
  i=$((i + 1))
done
n=0
for c in $all; do
  if [ "$(ps -o pgid= -p "$c" | tr -d ' ')" = "$c" ]; then kill -KILL -"$c"; fi
  if kill -KILL "$c"; then n=$((n + 1)); fi
done
echo "tartan-job killed $n"
exit 0
"#;

/// The argv of the call that stops the job in guest folder `dir`.
pub fn stop_argv(dir: &str) -> Vec<String> {
    vec![
        "sh".to_string(),
        "-c".to_string(),
        STOP_SCRIPT.to_string(),
        "tartan-job".to_string(),
        dir.to_string(),
    ]
}

/// What the stop call found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Stopped {
    /// This many processes of the step were killed.
    Killed(u32),
    /// The job had already exited with this status: it ended on its own, at its limit.
    Exited(i32),
    /// The job folder holds no pid (never launched, or damaged): nothing to kill.
    NoPid,
}

/// Reads the stop call's output: exactly one of its lines.
pub fn parse_stop(out: &str) -> Result<Stopped, String> {
    let line = out.strip_suffix('\n').unwrap_or(out);
    let number = |n: &str| n.parse().map_err(|_| format!("not a number in {out:?}"));
    match line.split(' ').collect::<Vec<_>>()[..] {
        ["tartan-job", "killed", n] => Ok(Stopped::Killed(number(n)?)),
        ["tartan-job", "exited", c] => Ok(Stopped::Exited(number(c)? as i32)),
        ["tartan-job", "nopid"] => Ok(Stopped::NoPid),
        _ => Err(format!(
            "expected `tartan-job killed N|exited C|nopid`, got {:?}",
            out.chars().take(200).collect::<String>()
        )),
    }
}

/// When a step started at `since` with a limit of `timeout_seconds` must be stopped.
pub fn step_deadline(since: Timestamp, timeout_seconds: u32) -> Timestamp {
    since
        .saturating_add(SignedDuration::from_secs(i64::from(timeout_seconds)))
        .unwrap_or(Timestamp::MAX)
}

/// Stops `job` in the guest, retrying a failed call until `give_up_after` has passed (each
/// `tart exec` limited to `exec_timeout`). The reply goes through `<host_log>.stop`, removed after.
pub async fn stop(
    tart: &Tart,
    job: &Job,
    host_log: &Path,
    exec_timeout: Duration,
    give_up_after: Duration,
) -> Result<Stopped, String> {
    let scratch = with_suffix(host_log, ".stop");
    let started = Instant::now();
    let argv = stop_argv(&job.dir);
    let result = loop {
        let _ = std::fs::remove_file(&scratch);
        let options = ExecOptions {
            log_path: scratch.clone(),
            log_cap: 4096,
            tail_bytes: 4096,
            timeout: exec_timeout,
            stop_at_cap: false,
        };
        let failure = match tart.exec(&job.vm, &argv, &options).await {
            Ok(out) if out.exit_code == 0 => break parse_stop(&out.tail),
            Ok(out) => format!("tart exec exited {}: {}", out.exit_code, out.tail.trim()),
            Err(e @ (TartError::VmNotRunning { .. } | TartError::VmDoesNotExist { .. })) => break Err(e.to_string()),
            Err(e) => e.to_string(),
        };
        if started.elapsed() >= give_up_after {
            break Err(format!(
                "the guest did not answer for {give_up_after:?} (last: {failure})"
            ));
        }
        tracing::warn!(vm = %job.vm, step = %job.step, %failure, "stopping the timed-out step failed; retrying");
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    let _ = std::fs::remove_file(&scratch);
    result
}

/// The last `max` bytes of the host step log (lossy UTF-8), for a step whose end could not be
/// read from the guest.
pub fn host_log_tail(path: &Path, max: u64) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut file) = std::fs::File::open(path) else {
        return String::new();
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(max)));
    let mut bytes = Vec::new();
    let _ = file.take(max).read_to_end(&mut bytes);
    String::from_utf8_lossy(&bytes).into_owned()
}

fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_replies_are_exactly_the_three_lines() {
        assert_eq!(parse_stop("tartan-job killed 3\n"), Ok(Stopped::Killed(3)));
        assert_eq!(parse_stop("tartan-job exited 0\n"), Ok(Stopped::Exited(0)));
        assert_eq!(parse_stop("tartan-job nopid\n"), Ok(Stopped::NoPid));
        for bad in [
            "",
            "tartan-job killed\n",
            "tartan-job killed x\n",
            "tartan-job killed -1\n",
            "tartan-job exited 1 2\n",
            "sh: pgrep: not found\ntartan-job killed 0\n",
            "tartan-job stopped 1\n",
        ] {
            assert!(parse_stop(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_job_folder_is_a_parameter_never_script_text() {
        let argv = stop_argv(".tartan/mb-x/02-$(touch pwned)");
        assert_eq!(argv[..2], ["sh", "-c"]);
        assert_eq!(argv[2], STOP_SCRIPT);
        assert_eq!(argv[4], ".tartan/mb-x/02-$(touch pwned)");
        assert!(STOP_SCRIPT.starts_with("exec 2>/dev/null\n"));
    }

    #[test]
    fn the_deadline_counts_from_the_steps_start() {
        let since: Timestamp = "2026-10-05T02:00:00Z".parse().unwrap();
        assert_eq!(step_deadline(since, 90).to_string(), "2026-10-05T02:01:30Z");
        assert_eq!(step_deadline(Timestamp::MAX, u32::MAX), Timestamp::MAX);
    }

    /// The script run for real against a job-like process tree: a wrapper shell waiting for a
    /// step that forked a grandchild; everything below the wrapper dies, the wrapper reports 137.
    #[test]
    fn the_stop_script_kills_the_steps_whole_tree_and_spares_the_wrapper() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_str().unwrap().to_string();
        let wrapper = format!(
            "echo $$ >'{d}/pid'; sh -c 'sleep 300 & echo $! >\"$0/grandchild\"; wait' '{d}' & wait $!; echo $? >'{d}/exit.tmp'; mv '{d}/exit.tmp' '{d}/exit'"
        );
        let mut child = std::process::Command::new("sh")
            .arg("-c")
            .arg(&wrapper)
            .spawn()
            .unwrap();
        let grandchild = wait_for(|| std::fs::read_to_string(dir.path().join("grandchild")).ok());
        let out = std::process::Command::new("sh")
            .args(&stop_argv(&d)[1..])
            .output()
            .unwrap();
        let reply = parse_stop(std::str::from_utf8(&out.stdout).unwrap()).unwrap();
        assert!(matches!(reply, Stopped::Killed(n) if n >= 2), "{reply:?}");
        assert!(child.wait().unwrap().success(), "the wrapper itself was killed");
        let exit = std::fs::read_to_string(dir.path().join("exit")).unwrap();
        assert_eq!(exit.trim(), "137");
        let gc: i32 = grandchild.trim().parse().unwrap();
        // Gone, or a zombie waiting for whoever reaps orphans here.
        wait_for(|| {
            let stat = std::fs::read_to_string(format!("/proc/{gc}/stat")).unwrap_or_default();
            (stat.is_empty() || stat.contains(") Z ")).then_some(())
        });
        // A second stop finds the exit status.
        let out = std::process::Command::new("sh")
            .args(&stop_argv(&d)[1..])
            .output()
            .unwrap();
        assert_eq!(
            parse_stop(std::str::from_utf8(&out.stdout).unwrap()),
            Ok(Stopped::Exited(137))
        );
    }

    fn wait_for<T>(mut f: impl FnMut() -> Option<T>) -> T {
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(v) = f() {
                return v;
            }
            assert!(Instant::now() < until, "condition not met within 20 s");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
