//! The state-directory lock against a real second process: refused while the holder runs, still
//! refused while it is stopped (SIGSTOP), free once it is dead.

use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use tartan_agent::lock::{LOCK_FILE, LockError, StateLock};

const CHILD_ENV: &str = "TARTAN_LOCK_CHILD_STATE";

#[test]
#[ignore = "child process of a_stopped_holder_keeps_the_lock_until_it_dies; holds the lock until stdin closes"]
fn lock_holder_child() {
    let state = std::env::var(CHILD_ENV).expect("run by a_stopped_holder_keeps_the_lock_until_it_dies");
    let _lock = StateLock::acquire(Path::new(&state)).unwrap();
    println!("\nLOCKED");
    // Hold the lock until the parent closes our stdin (or kills us).
    let mut sink = Vec::new();
    std::io::stdin().read_to_end(&mut sink).unwrap();
}

struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let pid = Pid::from_raw(self.0.id() as i32);
        let _ = kill(pid, Signal::SIGCONT);
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn assert_held_by(state: &Path, pid: u32) {
    match StateLock::acquire(state) {
        Err(LockError::Held { path, holder_pid }) => {
            assert_eq!(path, state.join(LOCK_FILE));
            assert_eq!(holder_pid, Some(pid));
        }
        other => panic!("expected the lock to be held by pid {pid}, got {other:?}"),
    }
}

#[test]
fn a_stopped_holder_keeps_the_lock_until_it_dies() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let mut child = Reaped(
        Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "lock_holder_child",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, &state)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let pid = child.0.id();
    let mut stdout = BufReader::new(child.0.stdout.take().unwrap());
    loop {
        let mut line = String::new();
        assert_ne!(
            stdout.read_line(&mut line).unwrap(),
            0,
            "child ended without taking the lock"
        );
        if line.trim() == "LOCKED" {
            break;
        }
    }

    assert_held_by(&state, pid);
    let message = StateLock::acquire(&state).unwrap_err().to_string();
    assert!(
        message.starts_with(&format!(
            "another tartan-agent (pid {pid}) holds {}",
            state.join(LOCK_FILE).display()
        )),
        "{message}"
    );

    let nix_pid = Pid::from_raw(pid as i32);
    kill(nix_pid, Signal::SIGSTOP).unwrap();
    assert_eq!(
        waitpid(nix_pid, Some(WaitPidFlag::WUNTRACED)).unwrap(),
        WaitStatus::Stopped(nix_pid, Signal::SIGSTOP)
    );
    assert_held_by(&state, pid);

    kill(nix_pid, Signal::SIGCONT).unwrap();
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    let lock = StateLock::acquire(&state).expect("a dead holder's lock is free");
    assert_eq!(
        std::fs::read_to_string(lock.path()).unwrap(),
        format!("{}\n", std::process::id())
    );
}
