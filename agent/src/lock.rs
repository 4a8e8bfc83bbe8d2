//! The state-directory lock: one agent per state directory, for the agent's whole life.
//!
//! The lock is an exclusive `flock` (std [`File::try_lock`]) on the regular file `<state>/.lock`,
//! opened read+write. It is released when the [`StateLock`] is dropped or the process dies, however
//! it dies; a stopped (SIGSTOPped) agent keeps it. std opens files with `O_CLOEXEC`, so children
//! such as `tart` do not inherit it. After locking, the holder writes its PID into the file so that
//! a second agent can name it in its refusal.

use std::fs::{File, OpenOptions, TryLockError};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The name of the lock file inside the state directory.
pub const LOCK_FILE: &str = ".lock";

/// How long [`StateLock::acquire`] waits while the lock is held under this process's own PID.
/// A child this process forks (a `tart` command, from any thread) holds a copy of every open
/// file, the lock's included, from its fork until its exec closes it (`O_CLOEXEC`): a lock this
/// process just released can look held by itself for that moment.
pub const OWN_PID_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error(
        "another tartan-agent ({}) holds {}; refusing to start a second agent on the same state directory (stop that one, or use another --state-dir)",
        holder_pid.map_or_else(|| "pid unknown".to_string(), |p| format!("pid {p}")),
        path.display()
    )]
    Held { path: PathBuf, holder_pid: Option<u32> },
    #[error("{action} {}: {error}; the agent cannot run without its state-directory lock", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        error: io::Error,
    },
}

/// Proof that this process holds the state directory. Keep it alive for the process lifetime.
#[derive(Debug)]
pub struct StateLock {
    file: File,
    state_dir: PathBuf,
    path: PathBuf,
}

impl StateLock {
    /// Creates `state_dir` if needed and takes its lock without waiting. Fails with
    /// [`LockError::Held`] (naming the holder's PID when it has written it) if another process
    /// holds it.
    pub fn acquire(state_dir: &Path) -> Result<StateLock, LockError> {
        Self::acquire_waiting(state_dir, OWN_PID_WAIT)
    }

    /// [`StateLock::acquire`], waiting at most `own_pid_wait` (polling) while the holder named in
    /// the file is this process ([`OWN_PID_WAIT`] says why); a lock held under another PID is
    /// refused at once.
    pub fn acquire_waiting(state_dir: &Path, own_pid_wait: std::time::Duration) -> Result<StateLock, LockError> {
        std::fs::create_dir_all(state_dir).map_err(|error| LockError::Io {
            action: "creating the state directory",
            path: state_dir.to_path_buf(),
            error,
        })?;
        let path = state_dir.join(LOCK_FILE);
        let io_err = |action: &'static str| {
            let path = path.clone();
            move |error| LockError::Io { action, path, error }
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io_err("opening the lock file"))?;
        let give_up = std::time::Instant::now() + own_pid_wait;
        loop {
            match file.try_lock() {
                Ok(()) => break,
                Err(TryLockError::WouldBlock) => {
                    let holder_pid = read_pid(&file);
                    if holder_pid != Some(std::process::id()) || std::time::Instant::now() >= give_up {
                        return Err(LockError::Held { holder_pid, path });
                    }
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                Err(TryLockError::Error(error)) => return Err(io_err("locking")(error)),
            }
        }
        // Locked: record who holds it. Truncate first so a shorter PID leaves no stale digits.
        file.set_len(0).map_err(io_err("truncating the lock file"))?;
        file.write_all_at(format!("{}\n", std::process::id()).as_bytes(), 0)
            .map_err(io_err("writing our PID into the lock file"))?;
        file.sync_all().map_err(io_err("syncing the lock file"))?;
        Ok(StateLock {
            file,
            state_dir: state_dir.to_path_buf(),
            path,
        })
    }

    /// The state directory this lock holds.
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    /// The lock file (`<state>/.lock`).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The open lock file (for tests and diagnostics; the lock lives as long as this handle).
    pub fn file(&self) -> &File {
        &self.file
    }
}

/// The PID the holder wrote, if it has written one yet.
fn read_pid(file: &File) -> Option<u32> {
    let mut buf = [0u8; 32];
    let n = file.read_at(&mut buf, 0).ok()?;
    std::str::from_utf8(&buf[..n]).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_the_same_directory_is_refused_naming_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let first = StateLock::acquire(&state).unwrap();
        assert_eq!(
            std::fs::read_to_string(first.path()).unwrap(),
            format!("{}\n", std::process::id())
        );

        let err = StateLock::acquire_waiting(&state, std::time::Duration::ZERO).unwrap_err();
        match &err {
            LockError::Held { path, holder_pid } => {
                assert_eq!(path, &state.join(LOCK_FILE));
                assert_eq!(*holder_pid, Some(std::process::id()));
            }
            other => panic!("expected Held, got {other:?}"),
        }
        let message = err.to_string();
        assert!(
            message.starts_with(&format!(
                "another tartan-agent (pid {}) holds {}",
                std::process::id(),
                state.join(LOCK_FILE).display()
            )),
            "{message}"
        );

        drop(first);
        let again = StateLock::acquire(&state).unwrap();
        assert_eq!(again.state_dir(), state);
    }

    /// Seen in CI-like runs: a test reopened its own state directory while a child another test
    /// forked still held the lock's open file between its fork and its exec.
    #[test]
    fn a_lock_released_while_a_forked_child_still_holds_it_is_taken_once_the_child_is_gone() {
        let dir = tempfile::tempdir().unwrap();
        let first = StateLock::acquire(dir.path()).unwrap();
        // SAFETY: the child only sleeps and exits (no allocation, no lock of the parent's).
        let child = match unsafe { nix::unistd::fork() }.unwrap() {
            nix::unistd::ForkResult::Child => {
                nix::unistd::sleep(1);
                unsafe { libc::_exit(0) }
            }
            nix::unistd::ForkResult::Parent { child } => child,
        };
        drop(first);
        let again = StateLock::acquire(dir.path());
        nix::sys::wait::waitpid(child, None).unwrap();
        assert!(again.is_ok(), "{again:?}");
    }

    #[test]
    fn a_stale_longer_pid_is_overwritten_whole() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(LOCK_FILE), "99999999999\n").unwrap();
        let lock = StateLock::acquire(dir.path()).unwrap();
        assert_eq!(
            std::fs::read_to_string(lock.path()).unwrap(),
            format!("{}\n", std::process::id())
        );
    }
}
