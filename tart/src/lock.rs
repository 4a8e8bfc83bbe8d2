//! The two lock primitives tart uses, as small safe wrappers.
//!
//! * The **VM lock** is a POSIX record lock (`fcntl(F_SETLK, F_WRLCK)`) on `vms/<name>/config.json`, held by
//!   `tart run` for the VM's whole life. Anyone else must only *query* it with `F_GETLK` ([`probe_write_lock`]):
//!   taking it would make tart believe the VM is running, and closing any descriptor of that file in a process
//!   that holds it silently drops the lock.
//! * The **global** and **temp-dir** locks are BSD `flock(2)` locks, which std exposes as `File::lock`.

use std::fs::File;
use std::io;
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::{FcntlArg, fcntl};
use nix::unistd::Pid;

/// What `F_GETLK` said about a would-be write lock on a whole file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockProbe {
    /// Nobody holds a conflicting lock.
    Free,
    /// A process holds a conflicting POSIX lock.
    HeldBy(Pid),
    /// A conflicting lock exists but the kernel reported no usable pid (an open-file-description lock, or a
    /// holder in another pid namespace).
    HeldByUnknown,
}

impl LockProbe {
    /// True unless the file is unlocked.
    pub fn is_held(self) -> bool {
        !matches!(self, LockProbe::Free)
    }
}

fn whole_file(l_type: libc::c_short) -> libc::flock {
    // SAFETY: `libc::flock` is a plain C struct of integers (with platform-specific padding on some targets);
    // all-zero is a valid value for every field.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = l_type;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = 0;
    fl.l_len = 0; // up to EOF and beyond: the whole file
    fl
}

/// Asks the kernel who would block a write lock on `file`, without taking any lock (`F_GETLK`).
///
/// Works on a read-only descriptor. Never call this from a process that itself holds the lock: POSIX does not
/// report a process's own locks.
pub fn probe_write_lock_fd(file: &File) -> Result<LockProbe, Errno> {
    let mut fl = whole_file(libc::F_WRLCK as libc::c_short);
    fcntl(file, FcntlArg::F_GETLK(&mut fl))?;
    if fl.l_type == libc::F_UNLCK as libc::c_short {
        return Ok(LockProbe::Free);
    }
    if fl.l_pid > 0 {
        Ok(LockProbe::HeldBy(Pid::from_raw(fl.l_pid)))
    } else {
        Ok(LockProbe::HeldByUnknown)
    }
}

/// Opens `path` read-only and probes it with [`probe_write_lock_fd`]. The descriptor is closed before returning,
/// which is harmless because this process holds no lock on the file.
pub fn probe_write_lock(path: &Path) -> io::Result<LockProbe> {
    let file = File::open(path)?;
    probe_write_lock_fd(&file).map_err(io::Error::from)
}

/// Tries to take the VM lock (`F_SETLK`, `F_WRLCK`, whole file) on a descriptor opened for writing.
/// Returns `Ok(false)` when another process holds a conflicting lock. The lock lives until the process closes
/// *any* descriptor of the file, or exits.
pub fn try_write_lock(file: &File) -> Result<bool, Errno> {
    let fl = whole_file(libc::F_WRLCK as libc::c_short);
    match fcntl(file, FcntlArg::F_SETLK(&fl)) {
        Ok(_) => Ok(true),
        Err(Errno::EAGAIN) | Err(Errno::EACCES) => Ok(false),
        Err(e) => Err(e),
    }
}
