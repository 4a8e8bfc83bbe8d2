//! An interrupted chaos run cleans up what it started. Every process the harness starts sits in a
//! process group of its own (so faults can kill an agent with its children), so a SIGTERM or
//! SIGINT to the runner reaches none of them, and a runner killed by a signal runs no `Drop`.
//! The runner therefore marks itself with [`RUN_MARKER`] in its environment before it starts
//! anything: every process of the run inherits it (emulator, controller, agents, watchdogs and
//! the tart-double processes the agents start, whatever group they end up in), and
//! [`kill_marked`] finds them by it.

use crate::process::{kill_pids_with_env, pids_with_env};
use std::time::{Duration, Instant};

/// The environment variable every process of one chaos run carries (`<runner pid>-<start ns>`).
pub const RUN_MARKER: &str = "TARTAN_CHAOS_RUN";

/// This run's marker value: unique to this runner (its pid and start time), so a run never
/// touches another run's processes, nor its own parents.
pub fn marker_value() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!("{}-{nanos}", std::process::id())
}

/// SIGKILLs every live process carrying `RUN_MARKER=marker` (never this process) until none is
/// left, for at most `limit` (a process being spawned while the sweep runs is caught by the next
/// pass). Returns the pids still there at the end (empty on success).
pub fn kill_marked(marker: &str, limit: Duration) -> Vec<i32> {
    let start = Instant::now();
    loop {
        kill_pids_with_env(RUN_MARKER, marker);
        std::thread::sleep(Duration::from_millis(50));
        let left = pids_with_env(RUN_MARKER, marker);
        if left.is_empty() || start.elapsed() >= limit {
            return left;
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::process::{kill_pids_with_env, pids_with_env};
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    use std::io::BufRead as _;
    use std::path::PathBuf;
    use std::process::{Command, Stdio};
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    /// The folder holding the chaos runner and the binaries it starts, built unless
    /// `TARTAN_E2E_NO_BUILD=1` (scripts/e2e builds them first).
    fn bin_dir() -> PathBuf {
        if std::env::var("TARTAN_E2E_NO_BUILD").as_deref() == Ok("1") {
            return crate::bins::bin("tartan-agent")
                .parent()
                .expect("a binary is in a folder")
                .to_path_buf();
        }
        for (_, name) in crate::bins::BINARIES {
            crate::bins::bin(name);
        }
        tartan_testkit::support::workspace_bin("tartan-e2e", "chaos")
            .parent()
            .expect("a binary is in a folder")
            .to_path_buf()
    }

    /// `timeout 60 scripts/chaos ...` used to leave the emulator, the watchdogs and the agents
    /// running: the runner was killed by the SIGTERM, and every process it started was in a
    /// process group of its own. Each process of the run is found here by a variable the test
    /// puts in the runner's environment (inherited by all it starts, old runner or new).
    #[test]
    fn a_runner_stopped_by_sigterm_leaves_no_process_it_started() {
        stopped_by_sigterm_leaves_nothing(&[]);
    }

    /// The same while the run's own code keeps a thread busy for two minutes (seed 70019 at 100
    /// hosts: the runner did not see the SIGTERM within the 10 s `timeout` gave it, was SIGKILLed,
    /// and left 200 processes up): the signal is seen within the 30 s all the same.
    #[test]
    fn a_runner_stopped_by_sigterm_while_its_run_keeps_a_thread_busy_leaves_no_process() {
        stopped_by_sigterm_leaves_nothing(&[("TARTAN_CHAOS_TEST_BUSY_SECS", "120")]);
    }

    fn stopped_by_sigterm_leaves_nothing(env: &[(&str, &str)]) {
        let dir = bin_dir();
        let tag = format!("{}", uuid::Uuid::new_v4());
        let mut runner = Command::new(dir.join("chaos"))
            .args(["--seed", "29", "--builds", "4", "--hosts", "2", "--minutes", "5"])
            .envs(env.iter().copied())
            .env("TARTAN_CHAOS_TEST_TAG", &tag)
            .env("TARTAN_E2E_NO_BUILD", "1")
            .env("TARTAN_E2E_BIN_DIR", &dir)
            .env("TARTAN_E2E_CLUSTER", "emulator")
            .env_remove("KUBECONFIG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the chaos runner starts");
        let stdout = runner.stdout.take().expect("piped stdout");
        let (lines, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
                if lines.send(line).is_err() {
                    break;
                }
            }
        });
        let started = Instant::now();
        let limit = Duration::from_secs(120);
        let mut output = vec![];
        let up = loop {
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(line) => {
                    let up = line.contains("stack up");
                    output.push(line);
                    if up {
                        break true;
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break false,
                Err(mpsc::RecvTimeoutError::Timeout) if started.elapsed() >= limit => break false,
                Err(mpsc::RecvTimeoutError::Timeout) => {}
            }
        };
        if !up {
            let _ = runner.kill();
            kill_pids_with_env("TARTAN_CHAOS_TEST_TAG", &tag);
            panic!(
                "the runner did not report its stack up within {limit:?}: {}",
                output.join("\n")
            );
        }
        let before = pids_with_env("TARTAN_CHAOS_TEST_TAG", &tag);
        assert!(
            before.len() > 5,
            "emulator, controller, 2 agents and 2 watchdogs should be running: {before:?}"
        );

        kill(Pid::from_raw(runner.id() as i32), Signal::SIGTERM).expect("SIGTERM to the runner");
        let stopped = Instant::now();
        let status = loop {
            if let Some(status) = runner.try_wait().expect("waiting for the runner") {
                break status;
            }
            if stopped.elapsed() >= Duration::from_secs(30) {
                let _ = runner.kill();
                kill_pids_with_env("TARTAN_CHAOS_TEST_TAG", &tag);
                panic!("the runner did not exit within 30 s of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        // SIGKILLed processes are gone at once; a little slack for their parents' reaping.
        let gone = Instant::now();
        let mut left = pids_with_env("TARTAN_CHAOS_TEST_TAG", &tag);
        while !left.is_empty() && gone.elapsed() < Duration::from_secs(3) {
            std::thread::sleep(Duration::from_millis(50));
            left = pids_with_env("TARTAN_CHAOS_TEST_TAG", &tag);
        }
        let described: Vec<String> = left
            .iter()
            .map(|pid| {
                let argv = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                format!("{pid} {}", String::from_utf8_lossy(&argv).replace('\0', " "))
            })
            .collect();
        kill_pids_with_env("TARTAN_CHAOS_TEST_TAG", &tag);
        assert!(
            described.is_empty(),
            "the runner ({status}) left processes it started:\n{}",
            described.join("\n")
        );
        assert_eq!(status.code(), Some(143), "a runner stopped by SIGTERM exits 128 + 15");
    }
}
