//! Where tart keeps its VMs, and which processes belong to a VM.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use sysinfo::{ProcessRefreshKind, ProcessStatus, ProcessesToUpdate, System, UpdateKind};

use crate::error::TartError;
use crate::lock::{LockProbe, probe_write_lock};

/// Program basenames treated as tart clients by default.
pub const DEFAULT_PROGRAM_NAMES: &[&str] = &["tart", "tart-double"];

/// How long [`kill_vm_processes`] waits for SIGKILLed processes to disappear.
pub const KILL_WAIT: Duration = Duration::from_secs(10);

/// tart's home folder: `$TART_HOME` if set and non-empty, else `$HOME/.tart`.
pub fn tart_home() -> Result<PathBuf, TartError> {
    home_from(std::env::var_os("TART_HOME"), std::env::var_os("HOME"))
}

fn home_from(tart_home: Option<std::ffi::OsString>, home: Option<std::ffi::OsString>) -> Result<PathBuf, TartError> {
    match (tart_home, home) {
        (Some(t), _) if !t.is_empty() => Ok(PathBuf::from(t)),
        (_, Some(h)) if !h.is_empty() => Ok(PathBuf::from(h).join(".tart")),
        _ => Err(TartError::NoHome),
    }
}

/// `<home>/vms/<name>`.
pub fn vm_dir(home: &Path, name: &str) -> PathBuf {
    home.join("vms").join(name)
}

/// `<home>/vms/<name>/config.json`, the file carrying the VM lock.
pub fn vm_config_path(home: &Path, name: &str) -> PathBuf {
    vm_dir(home, name).join("config.json")
}

/// The pid of the `tart run` process of `name`: whoever holds the write lock on its `config.json`, found with
/// `F_GETLK` (exactly as `tart stop` and `tart list` do). The lock is only queried, never taken.
///
/// `Ok(None)` when the VM is not running or does not exist. Note that a `tart delete` or `tart push` in progress
/// also holds that lock briefly.
pub fn run_pid(home: &Path, name: &str) -> Result<Option<Pid>, TartError> {
    let path = vm_config_path(home, name);
    match probe_write_lock(&path) {
        Ok(LockProbe::Free) => Ok(None),
        Ok(LockProbe::HeldBy(pid)) => Ok(Some(pid)),
        Ok(LockProbe::HeldByUnknown) => Err(TartError::LockHolderUnknown { path }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TartError::Io {
            action: "could not query the VM lock (F_GETLK) on",
            path,
            source,
        }),
    }
}

/// Which processes count as tart clients of a VM.
#[derive(Debug, Clone)]
pub struct ClientFilter {
    /// Basenames of `argv[0]` that identify tart (default `tart`, `tart-double`).
    pub program_names: Vec<String>,
    /// When set, a process whose environment is readable must resolve to this tart home (its `TART_HOME`, or
    /// `$HOME/.tart`) to match. Processes whose environment cannot be read match on argv alone.
    pub home: Option<PathBuf>,
}

impl ClientFilter {
    /// Matches `program` (a path or a basename) and the default names, in any home.
    pub fn new(program: impl AsRef<Path>) -> Self {
        let mut names: Vec<String> = DEFAULT_PROGRAM_NAMES.iter().map(|s| s.to_string()).collect();
        if let Some(base) = program.as_ref().file_name().and_then(OsStr::to_str)
            && !names.iter().any(|n| n == base)
        {
            names.push(base.to_string());
        }
        ClientFilter {
            program_names: names,
            home: None,
        }
    }

    /// Restricts matches to processes working on `home`.
    pub fn in_home(mut self, home: impl Into<PathBuf>) -> Self {
        self.home = Some(home.into());
        self
    }
}

/// Processes running a tart client for `name`: `argv[0]`'s basename is one of the filter's program names and a
/// later argument equals the VM name (`tart exec mb-x …`, `tart run mb-x`, `tart stop mb-x`, …). The calling
/// process is never included. Sorted by pid.
pub fn client_pids(name: &str, filter: &ClientFilter) -> Vec<Pid> {
    let Ok(mut sys) = System::new() else {
        return Vec::new();
    };
    let refresh = ProcessRefreshKind::nothing()
        .with_cmd(UpdateKind::Always)
        .with_environ(UpdateKind::Always);
    sys.refresh_processes_specifics(ProcessesToUpdate::All, true, refresh);
    let me = std::process::id();
    let mut pids: Vec<Pid> = sys
        .processes()
        .iter()
        .filter(|(pid, p)| {
            pid.as_u32() != me
                && p.status() != ProcessStatus::Zombie
                && argv_names_vm(p.cmd(), name, &filter.program_names)
                && filter
                    .home
                    .as_deref()
                    .is_none_or(|home| environ_home_matches(p.environ(), home))
        })
        .map(|(pid, _)| Pid::from_raw(pid.as_u32() as i32))
        .collect();
    pids.sort();
    pids
}

fn argv_names_vm(cmd: &[std::ffi::OsString], name: &str, programs: &[String]) -> bool {
    let Some((argv0, rest)) = cmd.split_first() else {
        return false;
    };
    let base = Path::new(argv0).file_name().and_then(OsStr::to_str).unwrap_or_default();
    programs.iter().any(|p| p == base) && vm_of_tart_argv(rest).is_some_and(|vm| vm == name)
}

/// The VM a `tart` command line (without argv0) acts on: the first argument after the
/// subcommand that is not a flag, or for `clone` the second (the VM it makes; the first is only
/// read). An argument elsewhere that equals a VM name (`tart exec devbox grep mb-x log`, the
/// guest's argv of another VM) names no VM: killing that process would hit another user's work.
/// Flags are taken as written `--flag=value` (as this driver writes them), so a foreign client
/// writing `--flag value` before the name is not matched: it is left alone.
fn vm_of_tart_argv(rest: &[std::ffi::OsString]) -> Option<&OsStr> {
    let (command, args) = rest.split_first()?;
    let mut positionals = args.iter().filter(|a| !a.to_string_lossy().starts_with('-'));
    if command == "clone" {
        positionals.next()?;
    }
    positionals.next().map(|a| a.as_os_str())
}

fn environ_home_matches(environ: &[std::ffi::OsString], home: &Path) -> bool {
    if environ.is_empty() {
        return true; // unreadable: decide on argv alone
    }
    let var = |key: &str| {
        environ.iter().find_map(|kv| {
            let kv = kv.to_str()?;
            kv.strip_prefix(key)?.strip_prefix('=').map(std::ffi::OsString::from)
        })
    };
    match home_from(var("TART_HOME"), var("HOME")) {
        Ok(h) => same_path(&h, home),
        Err(_) => false,
    }
}

fn same_path(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

/// What [`kill_vm_processes`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KillReport {
    /// Processes that were sent SIGKILL and are now gone: the `tart run` lock holder first, then clients.
    pub killed: Vec<Pid>,
}

impl KillReport {
    /// How many processes were killed.
    pub fn count(&self) -> usize {
        self.killed.len()
    }
}

/// SIGKILLs every tart process of VM `name` — the `tart run` holding the VM lock in `home` and every client
/// process matching `filter` — then waits (bounded by [`KILL_WAIT`]) until they are gone and the VM lock is
/// free. Used by recovery at agent start and by the watchdog. A process that vanished on its own before the
/// signal is not counted.
pub async fn kill_vm_processes(home: &Path, name: &str, filter: &ClientFilter) -> Result<KillReport, TartError> {
    let mut targets: Vec<Pid> = Vec::new();
    match run_pid(home, name) {
        Ok(Some(pid)) => targets.push(pid),
        Ok(None) => {}
        // `tart run NAME` is also found by its argv below, so go on with what can be found.
        Err(e) => tracing::warn!(vm = name, error = %e, "cannot find the VM lock holder; killing tart clients only"),
    }
    let (name_owned, filter_owned) = (name.to_string(), filter.clone());
    let clients = tokio::task::spawn_blocking(move || client_pids(&name_owned, &filter_owned))
        .await
        .unwrap_or_default();
    for pid in clients {
        if !targets.contains(&pid) {
            targets.push(pid);
        }
    }
    let mut signalled = Vec::new();
    for pid in targets {
        match kill(pid, Signal::SIGKILL) {
            Ok(()) => signalled.push(pid),
            Err(Errno::ESRCH) => {}
            Err(e) => {
                return Err(TartError::Io {
                    action: "could not SIGKILL tart process of",
                    path: vm_dir(home, name),
                    source: std::io::Error::other(format!("pid {pid}: {e}")),
                });
            }
        }
    }
    let deadline = Instant::now() + KILL_WAIT;
    loop {
        let alive: Vec<Pid> = signalled.iter().copied().filter(|p| process_alive(*p)).collect();
        let lock_free = !matches!(run_pid(home, name), Ok(Some(p)) if signalled.contains(&p));
        if alive.is_empty() && lock_free {
            return Ok(KillReport { killed: signalled });
        }
        if Instant::now() >= deadline {
            return Err(TartError::ProcessesSurvived {
                vm: name.to_string(),
                pids: alive.iter().map(|p| p.as_raw()).collect(),
                after: KILL_WAIT,
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// True while `pid` exists and is not a zombie (a zombie has exited; it only waits for its parent to reap it).
pub fn process_alive(pid: Pid) -> bool {
    if let Err(Errno::ESRCH) = kill(pid, None) {
        return false;
    }
    let Ok(mut sys) = System::new() else {
        return true;
    };
    let spid = sysinfo::Pid::from_u32(pid.as_raw() as u32);
    sys.refresh_processes_specifics(ProcessesToUpdate::Some(&[spid]), true, ProcessRefreshKind::nothing());
    match sys.process(spid) {
        None => false,
        Some(p) => p.status() != ProcessStatus::Zombie,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn home_prefers_tart_home_then_dot_tart() {
        assert_eq!(
            home_from(Some("/t".into()), Some("/h".into())).unwrap(),
            PathBuf::from("/t")
        );
        assert_eq!(
            home_from(Some("".into()), Some("/h".into())).unwrap(),
            PathBuf::from("/h/.tart")
        );
        assert_eq!(home_from(None, Some("/h".into())).unwrap(), PathBuf::from("/h/.tart"));
        assert!(matches!(home_from(None, None), Err(TartError::NoHome)));
    }

    #[test]
    fn argv_match_needs_program_basename_and_exact_vm_argument() {
        let progs = vec!["tart".to_string(), "tart-double".to_string()];
        let argv = |v: &[&str]| v.iter().map(std::ffi::OsString::from).collect::<Vec<_>>();
        assert!(argv_names_vm(
            &argv(&["/opt/homebrew/bin/tart", "exec", "mb-x", "true"]),
            "mb-x",
            &progs
        ));
        assert!(argv_names_vm(
            &argv(&["tart-double", "run", "--no-graphics", "mb-x"]),
            "mb-x",
            &progs
        ));
        assert!(!argv_names_vm(&argv(&["tart", "run", "mb-x2"]), "mb-x", &progs));
        assert!(!argv_names_vm(&argv(&["sleep", "mb-x"]), "mb-x", &progs));
        // Where the VM's name stands, not anywhere (adversary round 9: another VM's exec
        // mentioning it, a clone made from it).
        for (line, names) in [
            (&["tart", "exec", "-i", "mb-x", "sh"][..], true),
            (&["tart", "exec", "devbox", "grep", "mb-x", "/var/log/build.log"], false),
            (&["tart", "clone", "ghcr.io/img:1", "mb-x"], true),
            (&["tart", "clone", "mb-x", "keep-for-debugging"], false),
            (
                &["tart", "run", "--no-graphics", "--dir=cache:/srv/cache:ro", "mb-x"],
                true,
            ),
            (&["tart", "ip", "mb-x", "--wait", "60"], true),
            (&["tart", "stop", "other", "--timeout", "30", "mb-x"], false),
            (&["tart", "delete", "mb-x"], true),
            (&["tart"], false),
        ] {
            assert_eq!(argv_names_vm(&argv(line), "mb-x", &progs), names, "{line:?}");
        }
        assert!(!argv_names_vm(&argv(&["mb-x"]), "mb-x", &progs));
        assert!(!argv_names_vm(&[], "mb-x", &progs));
    }

    #[test]
    fn environ_home_match() {
        let env = |v: &[&str]| v.iter().map(std::ffi::OsString::from).collect::<Vec<_>>();
        assert!(environ_home_matches(
            &env(&["TART_HOME=/a/b", "HOME=/h"]),
            Path::new("/a/b")
        ));
        assert!(!environ_home_matches(&env(&["TART_HOME=/a/c"]), Path::new("/a/b")));
        assert!(environ_home_matches(&env(&["HOME=/h"]), Path::new("/h/.tart")));
        assert!(environ_home_matches(&[], Path::new("/anything")));
    }
}
