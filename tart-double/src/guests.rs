//! The double's guest processes: every command `exec` starts carries the environment variable [`ENV_GUEST`]
//! naming its VM folder and the `run` it was started in, and its descendants inherit it. In real tart the
//! guest lives inside the `tart run` process, so nothing started in it outlives the VM; here the processes
//! run on the host, so `run` (on a graceful end, and at start for a run that was killed), `stop` and
//! `delete` SIGKILL every process carrying the VM's mark ([`sweep`]).
//!
//! Processes are found by their environment as the kernel recorded it at exec (`/proc/<pid>/environ` on
//! Linux, read through `sysinfo`): a descendant that was exec'd with a cleared environment (`env -i`)
//! escapes the sweep, which no guest process of real tart can.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use sysinfo::{ProcessRefreshKind, ProcessStatus, ProcessesToUpdate, System, UpdateKind};

use tartan_tart::process_alive;

/// Env var set on every command `exec` starts: `<run pid> <VM folder>` (the folder canonicalised; the pid
/// of the `run` holding the VM lock when the command started, 0 if unknown).
pub const ENV_GUEST: &str = "TART_DOUBLE_GUEST";

/// How long [`sweep`] waits for SIGKILLed guest processes to disappear.
const SWEEP_WAIT: Duration = Duration::from_secs(10);

/// The VM folder as guest marks name it: canonical, so `TART_HOME` spelled differently (relative, through
/// a symlink) by `exec` and by `stop` still names the same VM. A folder already deleted is named through
/// its parent (`vms/`, which stays).
fn vm_key(dir: &Path) -> PathBuf {
    if let Ok(key) = dir.canonicalize() {
        return key;
    }
    match (dir.parent().map(Path::canonicalize), dir.file_name()) {
        (Some(Ok(parent)), Some(name)) => parent.join(name),
        _ => dir.to_path_buf(),
    }
}

/// The value of [`ENV_GUEST`] for a command started in the run `run` of the VM in `dir`.
pub(crate) fn mark(run: Option<Pid>, dir: &Path) -> OsString {
    let mut value = OsString::from(format!("{} ", run.map_or(0, Pid::as_raw)));
    value.push(vm_key(dir));
    value
}

/// Parses a mark: the run pid (`None` if 0 or not a pid) and the VM folder.
fn parse_mark(value: &OsStr) -> Option<(Option<Pid>, PathBuf)> {
    let bytes = value.as_bytes();
    let space = bytes.iter().position(|b| *b == b' ')?;
    let pid: i32 = std::str::from_utf8(&bytes[..space]).ok()?.parse().ok()?;
    let dir = &bytes[space + 1..];
    if dir.is_empty() {
        return None;
    }
    let run = (pid > 0).then(|| Pid::from_raw(pid));
    Some((run, PathBuf::from(OsString::from_vec(dir.to_vec()))))
}

/// The mark in an environment (`KEY=VALUE` entries), if any.
fn mark_in(environ: &[OsString]) -> Option<(Option<Pid>, PathBuf)> {
    let prefix = format!("{ENV_GUEST}=");
    environ.iter().find_map(|kv| {
        let value = kv.as_bytes().strip_prefix(prefix.as_bytes())?;
        parse_mark(OsStr::from_bytes(value))
    })
}

/// Whether a process with `mark` is to be killed when sweeping `key`, sparing the guests of run `spare`.
fn doomed(mark: &(Option<Pid>, PathBuf), key: &Path, spare: Option<Pid>) -> bool {
    mark.1 == key && (spare.is_none() || mark.0 != spare)
}

/// Live processes (not zombies, not this process) carrying a guest mark of the VM in `dir`, except those of
/// run `spare`. Sorted by pid.
fn guest_pids(dir: &Path, spare: Option<Pid>) -> Result<Vec<Pid>, String> {
    let key = vm_key(dir);
    let mut sys = System::new().map_err(|e| format!("cannot list processes: {e}"))?;
    let refresh = ProcessRefreshKind::nothing().with_environ(UpdateKind::Always);
    sys.refresh_processes_specifics(ProcessesToUpdate::All, true, refresh);
    let me = std::process::id();
    let mut pids: Vec<Pid> = sys
        .processes()
        .iter()
        .filter(|(pid, p)| {
            pid.as_u32() != me
                && p.thread_kind().is_none()
                && p.status() != ProcessStatus::Zombie
                && mark_in(p.environ()).is_some_and(|m| doomed(&m, &key, spare))
        })
        .map(|(pid, _)| Pid::from_raw(pid.as_u32() as i32))
        .collect();
    pids.sort();
    Ok(pids)
}

/// SIGKILLs every guest process of the VM in `dir` (`<home>/vms/<name>`, which may be gone) except those of
/// run `spare`, and waits (bounded) until they are gone, as a VM's guest is when the VM stops. Returns how
/// many were killed; an error says which survived. The double's `run`, `stop` and `delete` call it; a test
/// may too, to prove that nothing of a VM is left or to clean up after itself.
pub fn sweep(dir: &Path, spare: Option<Pid>) -> Result<usize, String> {
    let deadline = Instant::now() + SWEEP_WAIT;
    let mut killed: Vec<Pid> = Vec::new();
    // Scan again after killing: a guest may have forked between the scan and its death.
    loop {
        let found = guest_pids(dir, spare)?;
        let fresh: Vec<Pid> = found.iter().copied().filter(|p| !killed.contains(p)).collect();
        for pid in &fresh {
            match kill(*pid, Signal::SIGKILL) {
                Ok(()) | Err(Errno::ESRCH) => killed.push(*pid),
                Err(e) => {
                    return Err(format!("cannot SIGKILL guest process {pid} of {}: {e}", dir.display()));
                }
            }
        }
        let alive: Vec<Pid> = killed.iter().copied().filter(|p| process_alive(*p)).collect();
        if fresh.is_empty() && alive.is_empty() {
            return Ok(killed.len());
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "guest processes {alive:?} of {} survived SIGKILL for {SWEEP_WAIT:?}",
                dir.display()
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_round_trip_and_junk_is_no_mark() {
        let dir = Path::new("/no/such/home/vms/mb x");
        let value = mark(Some(Pid::from_raw(42)), dir);
        assert_eq!(value, OsString::from("42 /no/such/home/vms/mb x"));
        assert_eq!(parse_mark(&value), Some((Some(Pid::from_raw(42)), dir.to_path_buf())));
        assert_eq!(parse_mark(&mark(None, dir)), Some((None, dir.to_path_buf())));
        assert_eq!(parse_mark(OsStr::new("42")), None);
        assert_eq!(parse_mark(OsStr::new("x /a")), None);
        assert_eq!(parse_mark(OsStr::new("42 ")), None);
        let env = |v: &[&str]| v.iter().map(OsString::from).collect::<Vec<_>>();
        assert_eq!(
            mark_in(&env(&["HOME=/h", "TART_DOUBLE_GUEST=7 /a/vms/b"])),
            Some((Some(Pid::from_raw(7)), PathBuf::from("/a/vms/b")))
        );
        assert_eq!(mark_in(&env(&["XTART_DOUBLE_GUEST=7 /a", "HOME=/h"])), None);
    }

    #[test]
    fn a_deleted_folder_is_named_through_its_parent() {
        let tmp = tempfile::tempdir().unwrap();
        let link = tmp.path().join("link");
        std::fs::create_dir(tmp.path().join("vms")).unwrap();
        std::os::unix::fs::symlink(tmp.path(), &link).unwrap();
        let real = tmp.path().canonicalize().unwrap().join("vms/mb-x");
        assert_eq!(vm_key(&link.join("vms/mb-x")), real);
        std::fs::create_dir(&real).unwrap();
        assert_eq!(vm_key(&link.join("vms/mb-x")), real);
    }

    #[test]
    fn a_sweep_takes_its_vm_only_and_spares_the_given_run() {
        let a = Path::new("/h/vms/a");
        let m = |pid: i32, dir: &str| ((pid > 0).then(|| Pid::from_raw(pid)), PathBuf::from(dir));
        assert!(doomed(&m(7, "/h/vms/a"), a, None));
        assert!(!doomed(&m(7, "/h/vms/ab"), a, None));
        assert!(!doomed(&m(7, "/h/vms/a"), a, Some(Pid::from_raw(7))));
        assert!(doomed(&m(6, "/h/vms/a"), a, Some(Pid::from_raw(7))));
        assert!(doomed(&m(0, "/h/vms/a"), a, Some(Pid::from_raw(7))));
    }
}
