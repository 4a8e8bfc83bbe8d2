//! Processes owned by a test: each in its own process group, output in a log file, killed with
//! its whole group (SIGKILL) and reaped when dropped, also during a panic.

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;
use std::fs::{File, OpenOptions};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running process started by the harness.
pub struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
    exited: Option<std::process::ExitStatus>,
}

impl Proc {
    /// Starts `cmd` in a new process group, stdout and stderr appended to `log`.
    pub fn spawn(name: &str, mut cmd: Command, log: &Path) -> Proc {
        let out = open_log(log);
        let err = out.try_clone().expect("log file handle clones");
        cmd.stdin(Stdio::null()).stdout(out).stderr(err).process_group(0);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({:?}): {e}", cmd.get_program()));
        Proc {
            name: name.to_string(),
            child,
            log: log.to_path_buf(),
            exited: None,
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The process group (the leader's pid).
    pub fn pgid(&self) -> Pid {
        Pid::from_raw(self.child.id() as i32)
    }

    pub fn log(&self) -> &Path {
        &self.log
    }

    /// Whether the process has not exited (a stopped process is alive).
    pub fn alive(&mut self) -> bool {
        if self.exited.is_some() {
            return false;
        }
        match self.child.try_wait() {
            Ok(Some(status)) => {
                self.exited = Some(status);
                false
            }
            _ => true,
        }
    }

    /// The exit status, if it has exited.
    pub fn exit_status(&mut self) -> Option<std::process::ExitStatus> {
        self.alive();
        self.exited
    }

    /// Sends `sig` to the process only (not its group).
    pub fn signal(&self, sig: Signal) {
        let _ = kill(self.pgid(), sig);
    }

    /// `kill -9` of the process alone: children it started (tart run/exec) survive, as with an
    /// agent started under `nohup`. Waits until it is reaped.
    pub fn kill9_alone(&mut self) {
        self.signal(Signal::SIGKILL);
        self.reap(Duration::from_secs(10));
    }

    /// `kill -9` of the whole process group, as launchd does when a job without
    /// `AbandonProcessGroup` dies. Waits until the leader is reaped.
    pub fn kill9_group(&mut self) {
        let _ = killpg(self.pgid(), Signal::SIGKILL);
        self.reap(Duration::from_secs(10));
    }

    /// SIGTERM, then SIGKILL of the group if it has not exited within `patience`.
    pub fn terminate(&mut self, patience: Duration) {
        self.signal(Signal::SIGCONT);
        self.signal(Signal::SIGTERM);
        let start = Instant::now();
        while start.elapsed() < patience {
            if !self.alive() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill9_group();
    }

    fn reap(&mut self, limit: Duration) {
        let start = Instant::now();
        while self.alive() {
            assert!(
                start.elapsed() < limit,
                "{} (pid {}) did not exit within {limit:?} of SIGKILL",
                self.name,
                self.pid()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The last `n` lines of its log, for failure messages.
    pub fn log_tail(&self, n: usize) -> String {
        tail(&self.log, n)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // The group outlives its leader when children survive, so always signal the group.
        let _ = killpg(self.pgid(), Signal::SIGKILL);
        if self.exited.is_none() {
            let _ = self.child.wait();
        }
    }
}

fn open_log(path: &Path) -> File {
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap_or_else(|e| panic!("cannot open log {}: {e}", path.display()))
}

/// The last `n` lines of a text file ("" if unreadable).
pub fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Pids of live processes whose environment contains `KEY=value` exactly (how the harness finds
/// tart-double processes of one TART_HOME, whatever process group they ended up in).
pub fn pids_with_env(key: &str, value: &str) -> Vec<i32> {
    let needle = format!("{key}={value}");
    let mut pids = vec![];
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return pids;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if pid == std::process::id() as i32 {
            continue;
        }
        let Ok(environ) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        if environ.split(|b| *b == 0).any(|kv| kv == needle.as_bytes()) && !is_zombie(pid) {
            pids.push(pid);
        }
    }
    pids
}

/// Whether `pid` exists and is neither stopped, traced nor a zombie (`/proc/<pid>/stat` state).
pub fn is_running(pid: i32) -> bool {
    proc_state(pid).is_some_and(|s| !matches!(s, 'T' | 't' | 'Z' | 'X'))
}

/// Whether `pid`, sent SIGSTOP, can run no more of its own code: gone, stopped, a zombie, or
/// waiting in the kernel with the SIGSTOP still pending. The last is a `vfork` parent whose child
/// was stopped before its `exec`: it stays in `D` until the child execs or exits, and stops the
/// moment it leaves that wait, so waiting for its `T` would wait for ever.
pub fn is_asleep(pid: i32) -> bool {
    match proc_state(pid) {
        None | Some('T' | 't' | 'Z' | 'X') => true,
        Some('D') => stop_pending(pid),
        Some(_) => false,
    }
}

/// Whether SIGSTOP is pending for `pid` (process-wide or for its main thread), from the
/// `ShdPnd`/`SigPnd` masks of `/proc/<pid>/status`.
fn stop_pending(pid: i32) -> bool {
    let bit = 1u64 << (Signal::SIGSTOP as u32 - 1);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status.lines().any(|line| {
        let mask = line.strip_prefix("ShdPnd:").or_else(|| line.strip_prefix("SigPnd:"));
        mask.and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
            .is_some_and(|m| m & bit != 0)
    })
}

fn proc_state(pid: i32) -> Option<char> {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).ok().and_then(|s| {
        s.rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
    })
}

fn is_zombie(pid: i32) -> bool {
    proc_state(pid).is_none_or(|s| s == 'Z')
}

/// SIGKILLs every process whose environment has `KEY=value` (by pid).
pub fn kill_pids_with_env(key: &str, value: &str) {
    for pid in pids_with_env(key, value) {
        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Waits up to 10 s for `pid`'s state to be `want`.
    fn await_state(pid: i32, want: char) {
        let started = Instant::now();
        while proc_state(pid) != Some(want) {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "pid {pid} never reached state {want}: {:?}",
                proc_state(pid)
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The child of `parent` (from `/proc/<pid>/stat`'s ppid field), waited for up to 10 s.
    fn child_of(parent: i32) -> i32 {
        let started = Instant::now();
        loop {
            for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
                let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                    continue;
                };
                let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
                let ppid = stat
                    .rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().nth(1).and_then(|p| p.parse().ok()));
                if ppid == Some(parent) {
                    return pid;
                }
            }
            assert!(started.elapsed() < Duration::from_secs(10), "{parent} has no child");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// What made `Stack::sleep_host` wait for ever (mac-sleep in CI): a process that `vfork`ed a
    /// child which was stopped before its exec sits in `D` with SIGSTOP pending, never `T`.
    #[test]
    fn a_vfork_parent_whose_child_is_stopped_counts_as_asleep() {
        // SAFETY: the forked child of this multi-threaded test makes only system calls (clone,
        // getpid, kill, _exit). Its clone has vfork's wait (CLONE_VFORK) but not its shared memory
        // (no CLONE_VM), so it returns twice like fork, each side on its own copy of the stack.
        let parent = unsafe {
            match libc::fork() {
                0 => {
                    let flags = libc::CLONE_VFORK as libc::c_long | libc::SIGCHLD as libc::c_long;
                    if libc::syscall(libc::SYS_clone, flags, 0, 0, 0, 0) == 0 {
                        libc::kill(libc::getpid(), libc::SIGSTOP);
                        libc::_exit(0);
                    }
                    libc::_exit(0);
                }
                pid => pid,
            }
        };
        assert!(parent > 0, "fork failed");
        let stopped_child = child_of(parent);
        await_state(stopped_child, 'T');
        await_state(parent, 'D');
        assert!(!is_asleep(parent), "D without SIGSTOP pending is not asleep");
        let _ = kill(Pid::from_raw(parent), Signal::SIGSTOP);
        assert!(is_running(parent), "the state alone says it runs");
        assert!(is_asleep(parent), "SIGSTOP pending in D: asleep");
        let _ = kill(Pid::from_raw(stopped_child), Signal::SIGKILL);
        let _ = kill(Pid::from_raw(parent), Signal::SIGKILL);
        let _ = nix::sys::wait::waitpid(Pid::from_raw(parent), None);
    }
}
