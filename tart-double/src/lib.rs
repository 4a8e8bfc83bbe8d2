//! `tart-double`: a stand-in for the `tart` CLI on machines without Virtualization.framework, following the
//! contract in docs/tart-contract.md: home layout, garbage collection, locks, exit codes, messages and JSON.
//! Instead of a VM, `run` is a process holding the VM lock; `exec` runs argv on the host in the VM's folder.
//!
//! **Guest processes die with the VM.** In tart the guest lives inside the `tart run` process: a job the guest
//! left running (`nohup … &`, `setsid`) after its `exec` ended still dies when the VM stops. Here `exec`
//! marks each command with [`ENV_GUEST`] (inherited by its descendants), and `run` when it ends gracefully
//! (SIGINT, SIGUSR2), `stop`, and `delete` SIGKILL every process carrying the VM's mark ([`guests`]). A `run`
//! killed at once (SIGKILL, SIGTERM, the `run_dies_after_secs` fault) cannot do that: its guest processes
//! linger until the next `stop`, `delete` or `run` of that VM, which sweeps them first. They are invisible to
//! `list`/`get`, where running still means the VM lock is held. The `exec`'d command itself additionally dies
//! with its `exec` client (Linux: `PR_SET_PDEATHSIG`), as the guest agent kills its direct child when the
//! client goes away; its descendants do not.
//!
//! **The temporary-directory window (as in tart, checked against cirruslabs/tart `Commands/Clone.swift`,
//! `VMDirectory.temporary()`, `FileLock.swift`, `Config.gc()` and `VMStorageOCI.pull`).** `clone` (and the
//! pull inside it) creates `tmp/<uuid>` (`tmp/<md5>` for a pull) first and takes its `flock` only afterwards.
//! Every command other than `clone`/`pull` starts by deleting each `tmp/*` entry it can `flock`, so one that
//! runs in between deletes the fresh directory. tart then fails the clone: `FileLock` opens the vanished
//! path (`open` gives -1) and `flock` fails, `failed to lock <tmp>: …`, or, when the deletion came after
//! the lock, copying into the deleted directory fails. Nothing is left in `vms/`. The double keeps that
//! order on purpose, says `failed to lock <tmp>: …` too, and can widen the window
//! (`clone_tmp_unlocked_secs`); a caller should treat that failure as transient and clone again.

pub mod faults;
pub mod guests;
pub mod run_flags;

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

use clap::{CommandFactory, Parser, Subcommand, ValueEnum};
use nix::sys::signal::{SigSet, Signal, kill};
use nix::unistd::Pid;
use serde::Serialize;

pub use faults::{FAULTS_FILE, Fault, Faults};
pub use guests::ENV_GUEST;
use tartan_tart::discovery::{tart_home, vm_dir};
use tartan_tart::lock::{LockProbe, probe_write_lock, try_write_lock};
use tartan_tart::types::{VmInfo, VmListEntry, VmState};

/// Env var: seconds between `run` starting and the guest agent answering (default 0; a fault overrides it).
pub const ENV_BOOT_DELAY: &str = "TART_DOUBLE_BOOT_DELAY_SECS";
/// Env var: how long `exec` tries to reach a guest agent that is not up before failing (default 1 s; real ≈10 s).
pub const ENV_CONNECT_TIMEOUT: &str = "TART_DOUBLE_CONNECT_TIMEOUT_SECS";
/// Env var: apparent size in GB of the sparse `disk.img` of synthetic images (default 50).
pub const ENV_DISK_SIZE_GB: &str = "TART_DOUBLE_DISK_SIZE_GB";

const LONG_ABOUT: &str = "\
A test double of the tart CLI (cirruslabs/tart 2.32) for machines without Virtualization.framework. It follows
tart's CLI contract: exit codes, stderr messages, locks, JSON fields.

HOME: TART_HOME, default ~/.tart, with vms/, cache/OCIs/, cache/IPSWs/ and tmp/ (auto-created). Every command
except clone first deletes each tmp/* entry it can flock (garbage collection).

WHAT A VM IS HERE: vms/<name>/{config.json, disk.img (sparse), nvram.bin}. `run NAME` is a blocking process
holding fcntl(F_SETLK, F_WRLCK) on config.json (the VM lock; F_GETLK reports its pid) and writing
control.sock (its mtime marks the boot). SIGINT prints `Stopping VM...` and exits 0; SIGUSR2 exits 0 (guest
shutdown); SIGTERM/SIGKILL kill it at once. `exec NAME CMD [ARG...]` runs CMD on the host with the VM folder as
working directory (no shell, stdout/stderr separate unless -t, -i passes stdin, exit code propagated, 255 if killed by a signal; on Linux
the command dies with the exec client, its descendants do not).

GUEST PROCESSES: every command exec starts carries TART_DOUBLE_GUEST=\"<run pid> <VM folder>\" (inherited by
its descendants). A graceful end of `run` (SIGINT, SIGUSR2), `stop` and `delete` SIGKILL every process carrying
the VM's mark, as a real VM's guest dies with it. A `run` killed at once leaves them until the next `stop`,
`delete` or `run` of that VM; `list` and `get` ignore them (running = the VM lock is held).

RUN FLAGS: `--dir [name:]path[:ro,tag=T]` is parsed as tart parses it (the last `:` part is options when one of
them is `ro` or `tag=`; several shares of one tag must all be named, else a usage error; a missing folder fails
the run, exit 1); `--net-softnet-allow|-block|-expose` imply `--net-softnet`; `--net-bridged`, `--net-softnet`
and `--net-host` are mutually exclusive (usage error); a malformed CIDR fails the run like a Softnet death (exit
1). Each accepted run appends {vm, dir: [{name, path, read_only, tag}], net_softnet, net_softnet_allow,
net_softnet_block} as one JSON line to $TART_HOME/double-runs.jsonl (kept after the VM is deleted).

Clone sources containing `/` are registry images: the first clone synthesises one into
cache/OCIs/<host>/<repo>/<tag> (a symlink to sha256:<digest>/).

EXIT CODES: 2 = the specified VM \"x\" does not exist / VM \"x\" is not running / VM \"x\" is already running!
(bare messages); 1 = other failures (e.g. `VM \"x\" is running` from delete, `Error: ...` messages,
`tart-double run` of a missing VM); 64 = usage errors (`Error: ...` plus usage).

ENVIRONMENT:
  TART_HOME                          home folder (default ~/.tart)
  TART_DOUBLE_BOOT_DELAY_SECS        seconds after `run` starts before the guest agent answers (default 0)
  TART_DOUBLE_CONNECT_TIMEOUT_SECS   how long exec waits for the guest agent before failing with
                                     `Failed to connect to the VM using its control socket: ...` (default 1)
  TART_DOUBLE_DISK_SIZE_GB           apparent size of synthetic images' sparse disk.img (default 50)

FAULT INJECTION: $TART_HOME/double-faults.json, read on every invocation (edit it while things run):
  {\"global\": {<fault>...}, \"vms\": {\"mb-x\": {<fault>...}}}     (a VM's entry overrides global field by field)
  delete_fails: bool          delete of the VM exits 1 (`Error: ...`) and leaves it in place
  clone_delay_secs: number    clone onto the VM sleeps this long holding the global lock
  clone_tmp_unlocked_secs: number  clone onto the VM sleeps this long between creating tmp/<uuid> and
                              locking it (tart's window: a concurrent command's GC deletes it)
  exec_hangs: bool            exec in the VM hangs without running anything, until the fault is lifted
  run_dies_after_secs: number run of the VM SIGKILLs itself this long after taking the VM lock
  boot_delay_secs: number     overrides TART_DOUBLE_BOOT_DELAY_SECS
  delete_delay_secs: number   delete of the VM first sleeps this long, holding no lock (so it can be killed
                              mid-way), then proceeds normally; a change reaches the next delete

SHELL EXAMPLE:
  export TART_HOME=$(mktemp -d)
  tart-double clone ghcr.io/cirruslabs/macos-sequoia-base:latest mb-x
  tart-double set mb-x --cpu 4 --memory 8192 --random-mac
  tart-double run --no-graphics mb-x &
  tart-double exec mb-x uname -a
  tart-double list --format json
  tart-double stop mb-x && tart-double delete mb-x
  echo '{\"vms\": {\"mb-x\": {\"delete_fails\": true}}}' > \"$TART_HOME/double-faults.json\"";

#[derive(Parser, Debug)]
#[command(name = "tart-double", version, about = "A tart CLI test double (see --help)", long_about = LONG_ABOUT)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Clone a VM (a local name, or a registry image that is synthesised into the OCI cache if absent).
    Clone {
        source: String,
        new_name: String,
        #[arg(long)]
        insecure: bool,
        #[arg(long, default_value_t = 4)]
        concurrency: u32,
        #[arg(long, default_value_t = 100)]
        prune_limit: u64,
    },
    /// Modify a VM's configuration (no running check).
    Set {
        name: String,
        #[arg(long)]
        cpu: Option<u32>,
        /// Memory in MB.
        #[arg(long)]
        memory: Option<u64>,
        /// WxH
        #[arg(long)]
        display: Option<String>,
        #[arg(long)]
        random_mac: bool,
        #[arg(long)]
        random_serial: bool,
        /// Disk size in GB (grow only).
        #[arg(long)]
        disk_size: Option<u64>,
    },
    /// Run a VM: hold its lock until SIGINT (exit 0), SIGUSR2 (exit 0) or death.
    Run {
        name: String,
        #[arg(long)]
        no_graphics: bool,
        #[arg(long)]
        dir: Vec<String>,
        #[arg(long)]
        disk: Vec<String>,
        #[arg(long)]
        net_bridged: Vec<String>,
        #[arg(long)]
        net_softnet: bool,
        #[arg(long)]
        net_host: bool,
        #[arg(long)]
        suspendable: bool,
        #[arg(long)]
        nested: bool,
        #[arg(long)]
        no_audio: bool,
        #[arg(long)]
        no_clipboard: bool,
        #[arg(long)]
        net_softnet_allow: Option<String>,
        #[arg(long)]
        net_softnet_block: Option<String>,
        #[arg(long)]
        net_softnet_expose: Option<String>,
    },
    /// Execute CMD in the VM (here: on the host, in the VM folder). Flags must precede NAME.
    Exec {
        #[arg(short = 'i')]
        interactive: bool,
        #[arg(short = 't')]
        tty: bool,
        name: String,
        /// The command and its arguments, captured verbatim (do not pass `--`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<OsString>,
    },
    /// Print the VM's IP address.
    Ip {
        name: String,
        /// Seconds to wait for an address (1 s polls).
        #[arg(long, default_value_t = 0)]
        wait: u64,
        #[arg(long, default_value = "dhcp")]
        resolver: String,
    },
    /// Stop a VM: SIGINT its `run`, SIGKILL after the timeout.
    Stop {
        name: String,
        #[arg(short = 't', long, default_value_t = 30)]
        timeout: u64,
    },
    /// Delete VMs (stops at the first error).
    Delete {
        #[arg(required = true)]
        names: Vec<String>,
    },
    /// List VMs.
    List {
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
        #[arg(long, value_enum)]
        source: Option<Source>,
        /// Names only.
        #[arg(short = 'q', long)]
        quiet: bool,
    },
    /// Get a VM's configuration.
    Get {
        name: String,
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Format {
    Text,
    Json,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Source {
    Local,
    Oci,
}

/// How a command failed: tart's exit code and the form of its message.
#[derive(Debug)]
enum Fail {
    /// A `RuntimeError`: the bare message. Exit 2 for does-not-exist / not running / already running, else 1.
    Bare(i32, String),
    /// Any other error: `Error: <message>`, exit 1.
    Error(String),
    /// A usage or validation error: `Error: <message>` plus usage, exit 64.
    Usage(String),
}

type Outcome = Result<i32, Fail>;

fn does_not_exist(name: &str) -> Fail {
    Fail::Bare(2, format!("the specified VM \"{name}\" does not exist"))
}

fn not_running(name: &str) -> Fail {
    Fail::Bare(2, format!("VM \"{name}\" is not running"))
}

fn io_fail(what: impl std::fmt::Display, path: &Path, e: impl std::fmt::Display) -> Fail {
    Fail::Error(format!("{what} {}: {e}", path.display()))
}

/// Runs the double with the process's arguments; returns the exit code.
pub fn main() -> i32 {
    let args: Vec<OsString> = std::env::args_os().collect();
    let (clap_args, exec_tail) = split_exec_argv(args);
    let cli = match Cli::try_parse_from(&clap_args) {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                let _ = e.print();
                return 0;
            }
            let rendered = e.render().to_string();
            eprint!(
                "{}",
                rendered
                    .strip_prefix("error: ")
                    .map(|r| format!("Error: {r}"))
                    .unwrap_or(rendered)
            );
            return 64;
        }
    };
    let result = dispatch(cli, exec_tail);
    match result {
        Ok(code) => code,
        Err(Fail::Bare(code, msg)) => {
            eprintln!("{msg}");
            code
        }
        Err(Fail::Error(msg)) => {
            eprintln!("Error: {msg}");
            1
        }
        Err(Fail::Usage(msg)) => {
            eprintln!("Error: {msg}");
            let mut cmd = Cli::command();
            eprintln!("{}", cmd.render_usage());
            64
        }
    }
}

/// tart captures everything after `exec [flags] NAME` verbatim (including `--`), so split it off before clap.
fn split_exec_argv(args: Vec<OsString>) -> (Vec<OsString>, Option<Vec<OsString>>) {
    if args.get(1).map(|a| a == "exec") != Some(true) {
        return (args, None);
    }
    let name_at = args
        .iter()
        .enumerate()
        .skip(2)
        .find(|(_, a)| !a.to_string_lossy().starts_with('-'))
        .map(|(i, _)| i);
    match name_at {
        Some(i) => {
            let mut head = args;
            let tail = head.split_off(i + 1);
            (head, Some(tail))
        }
        None => (args, None),
    }
}

fn dispatch(cli: Cli, exec_tail: Option<Vec<OsString>>) -> Outcome {
    let home = prepare_home()?;
    if !matches!(cli.command, Cmd::Clone { .. }) {
        gc(&home);
    }
    match cli.command {
        Cmd::Clone {
            source,
            new_name,
            concurrency,
            ..
        } => {
            if new_name.contains('/') {
                return Err(Fail::Usage("<new-name> should be a local name".into()));
            }
            if concurrency < 1 {
                return Err(Fail::Usage("network concurrency cannot be less than 1".into()));
            }
            cmd_clone(&home, &source, &new_name)
        }
        Cmd::Set {
            name,
            cpu,
            memory,
            display,
            random_mac,
            random_serial,
            disk_size,
        } => cmd_set(&home, &name, cpu, memory, display, random_mac, random_serial, disk_size),
        Cmd::Run {
            name,
            dir,
            net_bridged,
            net_softnet,
            net_host,
            net_softnet_allow,
            net_softnet_block,
            net_softnet_expose,
            ..
        } => {
            let net = run_flags::NetFlags {
                bridged: &net_bridged,
                softnet: net_softnet,
                softnet_allow: net_softnet_allow.as_deref(),
                softnet_block: net_softnet_block.as_deref(),
                softnet_expose: net_softnet_expose.as_deref(),
                host: net_host,
            };
            let record = match run_flags::check(&name, &dir, &net) {
                Ok(r) => r,
                Err(run_flags::Refused::Usage(m)) => return Err(Fail::Usage(m)),
                Err(run_flags::Refused::Start(m)) => return Err(Fail::Error(m)),
            };
            run_flags::record(&home, &record)
                .map_err(|e| io_fail("cannot append to", &run_flags::runs_file(&home), e))?;
            cmd_run(&home, &name)
        }
        Cmd::Exec {
            interactive,
            tty,
            name,
            command,
        } => {
            let command = exec_tail.unwrap_or(command);
            if command.is_empty() {
                return Err(Fail::Usage("Missing expected argument '<command> ...'".into()));
            }
            cmd_exec(&home, &name, interactive, tty, &command)
        }
        Cmd::Ip { name, wait, .. } => cmd_ip(&home, &name, wait),
        Cmd::Stop { name, timeout } => cmd_stop(&home, &name, timeout),
        Cmd::Delete { names } => {
            for name in names {
                cmd_delete(&home, &name)?;
            }
            Ok(0)
        }
        Cmd::List { format, source, quiet } => cmd_list(&home, format, source, quiet),
        Cmd::Get { name, format } => cmd_get(&home, &name, format),
    }
}

fn prepare_home() -> Result<PathBuf, Fail> {
    let home = tart_home().map_err(|e| Fail::Error(format!("TART_HOME is invalid: {e}")))?;
    for sub in ["vms", "cache/OCIs", "cache/IPSWs", "tmp"] {
        fs::create_dir_all(home.join(sub)).map_err(|e| {
            Fail::Error(format!(
                "TART_HOME is invalid: cannot create {}: {e}",
                home.join(sub).display()
            ))
        })?;
    }
    Ok(home)
}

/// Deletes every `tmp/*` entry nobody holds a `flock` on.
fn gc(home: &Path) {
    let result = (|| -> io::Result<()> {
        for entry in fs::read_dir(home.join("tmp"))? {
            let path = entry?.path();
            let file = File::open(&path)?;
            if file.try_lock().is_ok() {
                if path.is_dir() {
                    fs::remove_dir_all(&path)?
                } else {
                    fs::remove_file(&path)?
                }
            }
        }
        Ok(())
    })();
    if let Err(e) = result {
        eprintln!("Failed to perform garbage collection: {e}");
    }
}

fn faults_for(home: &Path, vm: &str) -> Result<Fault, Fail> {
    Faults::load(home).map(|f| f.for_vm(vm)).map_err(Fail::Error)
}

fn env_secs(var: &str, default: f64) -> f64 {
    std::env::var(var)
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|v| v.is_finite() && *v >= 0.0)
        .unwrap_or(default)
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s.clamp(0.0, 1e9))
}

/// Blocking `flock(LOCK_EX)` on the home directory: tart's global lock.
fn lock_home(home: &Path) -> Result<File, Fail> {
    let file = File::open(home).map_err(|e| io_fail("cannot open", home, e))?;
    file.lock().map_err(|e| io_fail("cannot lock", home, e))?;
    Ok(file)
}

fn config_path(home: &Path, name: &str) -> PathBuf {
    vm_dir(home, name).join("config.json")
}

fn vm_lock(home: &Path, name: &str) -> Result<LockProbe, Fail> {
    let path = config_path(home, name);
    probe_write_lock(&path).map_err(|e| io_fail("cannot query the VM lock on", &path, e))
}

/// Opens the config.json in VM folder `dir` and takes the VM lock on it: the open descriptor, which
/// holds the lock while it (and every other descriptor of that file in this process) stays open, or
/// `None` when another process holds the lock (the VM is running).
fn take_vm_lock(dir: &Path) -> Result<Option<File>, Fail> {
    let path = dir.join("config.json");
    let config = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .map_err(|e| io_fail("cannot open", &path, e))?;
    let locked = try_write_lock(&config).map_err(|e| io_fail("failed to lock", &path, e))?;
    Ok(locked.then_some(config))
}

fn require_vm(home: &Path, name: &str) -> Result<PathBuf, Fail> {
    let dir = vm_dir(home, name);
    if name.is_empty() || name.contains('/') || !dir.join("config.json").is_file() {
        return Err(does_not_exist(name));
    }
    Ok(dir)
}

fn read_config(path: &Path) -> Result<serde_json::Map<String, serde_json::Value>, Fail> {
    let bytes = fs::read(path).map_err(|e| io_fail("cannot read", path, e))?;
    match serde_json::from_slice(&bytes) {
        Ok(serde_json::Value::Object(map)) => Ok(map),
        Ok(_) => Err(Fail::Error(format!("{} is not a JSON object", path.display()))),
        Err(e) => Err(io_fail("cannot parse", path, e)),
    }
}

/// Rewrites config.json in place (same inode, so a running VM keeps its lock).
fn write_config(path: &Path, config: &serde_json::Map<String, serde_json::Value>) -> Result<(), Fail> {
    let bytes = serde_json::to_vec(config).map_err(|e| io_fail("cannot encode", path, e))?;
    let mut file = OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(path)
        .map_err(|e| io_fail("cannot open", path, e))?;
    file.write_all(&bytes).map_err(|e| io_fail("cannot write", path, e))
}

fn random_mac() -> String {
    let b = *uuid::Uuid::new_v4().as_bytes();
    // Locally administered, unicast.
    format!(
        "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
        (b[0] | 0x02) & 0xfe,
        b[1],
        b[2],
        b[3],
        b[4],
        b[5]
    )
}

fn fnv(text: &str) -> u64 {
    text.bytes()
        .fold(0xcbf29ce484222325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100000001b3))
}

// ---------------------------------------------------------------------------------------------------- clone

/// A registry reference `host/repo[:tag|@digest]`.
struct Remote {
    host: String,
    repo: String,
    reference: String,
}

fn parse_remote(src: &str) -> Result<Remote, Fail> {
    let (host, rest) = src
        .split_once('/')
        .ok_or_else(|| Fail::Error(format!("invalid remote name {src:?}")))?;
    let (repo, reference) = if let Some((repo, digest)) = rest.split_once('@') {
        (repo.to_string(), digest.to_string())
    } else {
        let last_slash = rest.rfind('/').map_or(0, |i| i + 1);
        match rest[last_slash..].rfind(':') {
            Some(i) => (
                rest[..last_slash + i].to_string(),
                rest[last_slash + i + 1..].to_string(),
            ),
            None => (rest.to_string(), "latest".to_string()),
        }
    };
    if host.is_empty() || repo.is_empty() || reference.is_empty() || repo.split('/').any(|p| p.is_empty() || p == "..")
    {
        return Err(Fail::Error(format!("invalid remote name {src:?}")));
    }
    Ok(Remote {
        host: host.into(),
        repo,
        reference,
    })
}

fn cmd_clone(home: &Path, source: &str, new_name: &str) -> Outcome {
    let source_dir = if source.contains('/') {
        pull_synthetic(home, source)?
    } else {
        require_vm(home, source)?
    };
    for file in ["config.json", "disk.img", "nvram.bin"] {
        if !source_dir.join(file).is_file() {
            return Err(Fail::Error(format!(
                "the VM {source:?} is incomplete: {} is missing",
                file
            )));
        }
    }
    let fault = faults_for(home, new_name)?;

    let tmp = home.join("tmp").join(uuid::Uuid::new_v4().to_string());
    fs::create_dir(&tmp).map_err(|e| io_fail("cannot create", &tmp, e))?;
    // Created, not yet locked: tart's window (module documentation), widened on request.
    if let Some(delay) = fault.clone_tmp_unlocked_secs {
        std::thread::sleep(secs(delay));
    }
    let tmp_lock = File::open(&tmp).map_err(|e| io_fail("failed to lock", &tmp, e))?;
    tmp_lock.lock().map_err(|e| io_fail("failed to lock", &tmp, e))?;

    let global = lock_home(home)?;
    for file in ["config.json", "nvram.bin", "state.vzvmsave"] {
        let from = source_dir.join(file);
        if from.exists() {
            fs::copy(&from, tmp.join(file)).map_err(|e| io_fail("cannot copy", &from, e))?;
        }
    }
    sparse_copy(&source_dir.join("disk.img"), &tmp.join("disk.img"))?;
    if let Some(delay) = fault.clone_delay_secs {
        std::thread::sleep(secs(delay));
    }
    // Regenerate the MAC only if another local VM already uses it.
    let new_config = tmp.join("config.json");
    let mut config = read_config(&new_config)?;
    let mac = config
        .get("macAddress")
        .and_then(|m| m.as_str())
        .unwrap_or_default()
        .to_string();
    if local_vm_names(home)?.iter().filter(|n| *n != new_name).any(|n| {
        read_config(&config_path(home, n))
            .ok()
            .and_then(|c| c.get("macAddress").cloned())
            == Some(mac.clone().into())
    }) {
        config.insert("macAddress".into(), random_mac().into());
        write_config(&new_config, &config)?;
    }
    let target = vm_dir(home, new_name);
    if target.exists() {
        fs::remove_dir_all(&target).map_err(|e| io_fail("cannot replace", &target, e))?;
    }
    fs::rename(&tmp, &target).map_err(|e| io_fail("cannot move the clone into", &target, e))?;
    drop(global);
    drop(tmp_lock);
    Ok(0)
}

/// Copies `from` to `to` keeping holes (SEEK_DATA/SEEK_HOLE), so a 50 GB sparse disk costs nothing.
fn sparse_copy(from: &Path, to: &Path) -> Result<(), Fail> {
    use nix::unistd::{Whence, lseek};
    use std::io::{Read, Seek, SeekFrom};
    let mut src = File::open(from).map_err(|e| io_fail("cannot open", from, e))?;
    let len = src.metadata().map_err(|e| io_fail("cannot stat", from, e))?.len();
    let mut dst = File::create(to).map_err(|e| io_fail("cannot create", to, e))?;
    let mut offset: i64 = 0;
    let mut buf = vec![0u8; 1 << 20];
    while (offset as u64) < len {
        let data = match lseek(&src, offset, Whence::SeekData) {
            Ok(d) => d,
            Err(nix::errno::Errno::ENXIO) => break, // only a hole remains
            Err(e) => return Err(io_fail("cannot seek in", from, e)),
        };
        let hole = lseek(&src, data, Whence::SeekHole).map_err(|e| io_fail("cannot seek in", from, e))?;
        src.seek(SeekFrom::Start(data as u64))
            .map_err(|e| io_fail("cannot seek in", from, e))?;
        dst.seek(SeekFrom::Start(data as u64))
            .map_err(|e| io_fail("cannot seek in", to, e))?;
        let mut remaining = (hole - data) as u64;
        while remaining > 0 {
            let want = remaining.min(buf.len() as u64) as usize;
            let n = src
                .read(&mut buf[..want])
                .map_err(|e| io_fail("cannot read", from, e))?;
            if n == 0 {
                break;
            }
            dst.write_all(&buf[..n]).map_err(|e| io_fail("cannot write", to, e))?;
            remaining -= n as u64;
        }
        offset = hole;
    }
    dst.set_len(len).map_err(|e| io_fail("cannot size", to, e))
}

/// Makes sure a synthetic image for `source` is in the OCI cache; returns its folder.
fn pull_synthetic(home: &Path, source: &str) -> Result<PathBuf, Fail> {
    let remote = parse_remote(source)?;
    let host_dir = home.join("cache/OCIs").join(&remote.host);
    let repo_dir = host_dir.join(&remote.repo);
    let entry = repo_dir.join(&remote.reference);
    if entry.join("config.json").is_file() {
        return Ok(entry);
    }
    fs::create_dir_all(&repo_dir).map_err(|e| io_fail("cannot create", &repo_dir, e))?;
    let host_lock = File::open(&host_dir).map_err(|e| io_fail("cannot open", &host_dir, e))?;
    if host_lock.try_lock().is_err() {
        println!("waiting for lock...");
        host_lock.lock().map_err(|e| io_fail("cannot lock", &host_dir, e))?;
    }
    if entry.join("config.json").is_file() {
        return Ok(entry);
    }
    println!("pulling {source}...");
    let tmp = home
        .join("tmp")
        .join(format!("{:016x}{:016x}", fnv(source), fnv(&format!("{source}#"))));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| io_fail("cannot clear", &tmp, e))?;
    }
    fs::create_dir(&tmp).map_err(|e| io_fail("cannot create", &tmp, e))?;
    let tmp_lock = File::open(&tmp).map_err(|e| io_fail("failed to lock", &tmp, e))?;
    tmp_lock.lock().map_err(|e| io_fail("failed to lock", &tmp, e))?;
    let h = fnv(source);
    let config = serde_json::json!({
        "version": 1,
        "os": "darwin",
        "arch": "arm64",
        "cpuCountMin": 4,
        "cpuCount": 4,
        "memorySizeMin": 4u64 << 30,
        "memorySize": 8u64 << 30,
        "macAddress": format!("7e:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}", h as u8, (h >> 8) as u8, (h >> 16) as u8, (h >> 24) as u8, (h >> 32) as u8),
        "display": {"width": 1024, "height": 768, "unit": "point"},
        "diskFormat": "raw",
        "ecid": "YnBsaXN0MDDRAQJURUNJRBMAAAAAAAAAAAgLEAAAAAAAAAEBAAAAAAAAAAMAAAAAAAAAAAAAAAAAAAAZ",
        "hardwareModel": "YnBsaXN0MDDTAQIDBAUGXxAZRGF0YVJlcHJlc2VudGF0aW9uVmVyc2lvbl8QD1BsYXRmb3JtVmVyc2lvblhNaW5pbXVtT1NWZXJzaW9uEAEQAg==",
    });
    let write = |file: &str, bytes: &[u8]| {
        fs::write(tmp.join(file), bytes).map_err(|e| io_fail("cannot write", &tmp.join(file), e))
    };
    write("config.json", &serde_json::to_vec(&config).unwrap_or_default())?;
    write("nvram.bin", &[0u8; 4096])?;
    let disk = tmp.join("disk.img");
    let disk_file = File::create(&disk).map_err(|e| io_fail("cannot create", &disk, e))?;
    let gb = env_secs(ENV_DISK_SIZE_GB, 50.0) as u64;
    disk_file
        .set_len(gb * 1_000_000_000)
        .map_err(|e| io_fail("cannot size", &disk, e))?;
    let digest = format!(
        "sha256:{:016x}{:016x}{:016x}{:016x}",
        h,
        fnv(&remote.repo),
        fnv(&remote.reference),
        fnv(&remote.host)
    );
    let digest_dir = repo_dir.join(&digest);
    if digest_dir.exists() {
        fs::remove_dir_all(&digest_dir).map_err(|e| io_fail("cannot replace", &digest_dir, e))?;
    }
    fs::rename(&tmp, &digest_dir).map_err(|e| io_fail("cannot move the image into", &digest_dir, e))?;
    if remote.reference != digest {
        let _ = fs::remove_file(&entry);
        std::os::unix::fs::symlink(&digest, &entry).map_err(|e| io_fail("cannot link", &entry, e))?;
    }
    drop(tmp_lock);
    Ok(entry)
}

// ---------------------------------------------------------------------------------------------------- set

#[allow(clippy::too_many_arguments)]
fn cmd_set(
    home: &Path,
    name: &str,
    cpu: Option<u32>,
    memory: Option<u64>,
    display: Option<String>,
    random_mac_flag: bool,
    random_serial: bool,
    disk_size: Option<u64>,
) -> Outcome {
    let dir = require_vm(home, name)?;
    let path = dir.join("config.json");
    let mut config = read_config(&path)?;
    if let Some(cpu) = cpu {
        let min = config.get("cpuCountMin").and_then(|v| v.as_u64()).unwrap_or(1);
        if (cpu as u64) < min {
            return Err(Fail::Bare(
                1,
                format!("VM should have {min} CPU cores at minimum (requested {cpu})"),
            ));
        }
        config.insert("cpuCount".into(), cpu.into());
    }
    if let Some(mb) = memory {
        let bytes = mb.saturating_mul(1024 * 1024);
        let min = config.get("memorySizeMin").and_then(|v| v.as_u64()).unwrap_or(1);
        if bytes < min {
            return Err(Fail::Bare(
                1,
                format!("VM should have {} MB of memory at minimum (requested {mb})", min >> 20),
            ));
        }
        config.insert("memorySize".into(), bytes.into());
    }
    if let Some(display) = display {
        let parsed = display
            .split_once('x')
            .and_then(|(w, h)| Some((w.parse::<u32>().ok()?, h.parse::<u32>().ok()?)));
        let Some((w, h)) = parsed else {
            return Err(Fail::Usage(format!(
                "invalid display {display:?}: expected WIDTHxHEIGHT"
            )));
        };
        config.insert(
            "display".into(),
            serde_json::json!({"width": w, "height": h, "unit": "point"}),
        );
    }
    if random_mac_flag {
        config.insert("macAddress".into(), random_mac().into());
    }
    if random_serial {
        config.insert("ecid".into(), uuid::Uuid::new_v4().simple().to_string().into());
    }
    if let Some(gb) = disk_size {
        let disk = dir.join("disk.img");
        let file = OpenOptions::new()
            .write(true)
            .open(&disk)
            .map_err(|e| io_fail("cannot open", &disk, e))?;
        let current = file.metadata().map_err(|e| io_fail("cannot stat", &disk, e))?.len();
        let wanted = gb * 1_000_000_000;
        if wanted < current {
            return Err(Fail::Bare(
                1,
                "the new disk size must be larger than the current one (shrinking is not supported)".into(),
            ));
        }
        file.set_len(wanted).map_err(|e| io_fail("cannot resize", &disk, e))?;
    }
    write_config(&path, &config)?;
    Ok(0)
}

// ---------------------------------------------------------------------------------------------------- run

fn cmd_run(home: &Path, name: &str) -> Outcome {
    // tart looks the VM up in Run.validate(), so a missing VM is an `Error: …`, exit 1 (never 2).
    let dir = vm_dir(home, name);
    if name.contains('/') || !dir.join("config.json").is_file() {
        return Err(Fail::Error(format!("the specified VM \"{name}\" does not exist")));
    }
    let fault = faults_for(home, name)?;
    // Handle SIGINT/SIGUSR2 synchronously from here on: a `stop` arriving right after the lock is taken must
    // still end in `Stopping VM...` and exit 0.
    let mut signals = SigSet::empty();
    signals.add(Signal::SIGINT);
    signals.add(Signal::SIGUSR2);
    signals
        .thread_block()
        .map_err(|e| Fail::Error(format!("cannot block signals: {e}")))?;
    let global = lock_home(home)?;
    // This descriptor must stay open for the VM's whole life: closing any descriptor of config.json in this
    // process would drop the lock.
    let Some(config) = take_vm_lock(&dir)? else {
        return Err(Fail::Bare(2, format!("VM \"{name}\" is already running!")));
    };
    drop(global);
    // Guest processes of an earlier run of this VM that was killed at once die now, before this guest boots
    // (those of this run, started from here on, are spared).
    guests::sweep(&dir, Some(Pid::this())).map_err(|e| Fail::Error(format!("{e}; the VM was not started")))?;
    let sock = dir.join("control.sock");
    fs::write(&sock, format!("{}\n", std::process::id())).map_err(|e| io_fail("cannot create", &sock, e))?;

    if let Some(after) = fault.run_dies_after_secs {
        std::thread::spawn(move || {
            std::thread::sleep(secs(after));
            let _ = kill(Pid::this(), Signal::SIGKILL);
        });
    }
    loop {
        match signals.wait() {
            Ok(Signal::SIGINT) => {
                println!("Stopping VM...");
                break;
            }
            Ok(Signal::SIGUSR2) => {
                println!("guest has stopped the virtual machine");
                break;
            }
            Ok(_) | Err(_) => continue,
        }
    }
    // The guest stops with the VM, while the lock still keeps a new run (and its guests) out.
    guests::sweep(&dir, None).map_err(|e| Fail::Error(format!("{e}; the VM has stopped")))?;
    drop(config);
    Ok(0)
}

/// Seconds since `run` started (control.sock's mtime), if running.
fn booted(home: &Path, name: &str, boot_delay: Duration) -> bool {
    let sock = vm_dir(home, name).join("control.sock");
    let Ok(mtime) = fs::metadata(&sock).and_then(|m| m.modified()) else {
        return false;
    };
    SystemTime::now().duration_since(mtime).unwrap_or_default() >= boot_delay
}

fn boot_delay(home: &Path, name: &str) -> Result<Duration, Fail> {
    let fault = faults_for(home, name)?;
    Ok(secs(
        fault.boot_delay_secs.unwrap_or_else(|| env_secs(ENV_BOOT_DELAY, 0.0)),
    ))
}

// ---------------------------------------------------------------------------------------------------- exec

fn cmd_exec(home: &Path, name: &str, interactive: bool, tty: bool, command: &[OsString]) -> Outcome {
    use std::os::fd::AsFd;
    let dir = require_vm(home, name)?;
    let run = match vm_lock(home, name)? {
        LockProbe::Free => return Err(not_running(name)),
        LockProbe::HeldBy(pid) => Some(pid),
        LockProbe::HeldByUnknown => None,
    };
    while faults_for(home, name)?.exec_hangs == Some(true) {
        std::thread::sleep(Duration::from_millis(200));
    }
    let connect_timeout = secs(env_secs(ENV_CONNECT_TIMEOUT, 1.0));
    let started = Instant::now();
    while !booted(home, name, boot_delay(home, name)?) {
        if started.elapsed() >= connect_timeout {
            return Err(Fail::Bare(
                1,
                format!(
                    "Failed to connect to the VM using its control socket: GRPCConnectionPoolError: connection to {} timed out after {:.1}s, is the Tart Guest Agent running?",
                    dir.join("control.sock").display(),
                    connect_timeout.as_secs_f64()
                ),
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut cmd = Command::new(&command[0]);
    cmd.args(&command[1..])
        .current_dir(&dir)
        .env(ENV_GUEST, guests::mark(run, &dir));
    if !interactive {
        cmd.stdin(std::process::Stdio::null());
    }
    if tty {
        // A guest PTY merges stderr into stdout.
        let stdout = io::stdout()
            .as_fd()
            .try_clone_to_owned()
            .map_err(|e| Fail::Error(format!("cannot dup stdout: {e}")))?;
        cmd.stderr(std::process::Stdio::from(stdout));
    }
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        // The guest's processes live in the VM, out of reach of signals aimed at the host's process
        // groups (launchd killing the agent's job): a session of their own stands for that. The
        // direct child still dies with its exec client, as tart-guest-agent kills it.
        // SAFETY: the closure only calls setsid(2) and prctl(2), which are async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                nix::unistd::setsid().map_err(io::Error::from)?;
                nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(io::Error::from)
            });
        }
    }
    let status = cmd
        .status()
        .map_err(|e| Fail::Error(format!("the guest could not start {:?}: {e}", command[0])))?;
    Ok(status.code().unwrap_or(255))
}

// ---------------------------------------------------------------------------------------------------- ip

fn cmd_ip(home: &Path, name: &str, wait: u64) -> Outcome {
    require_vm(home, name)?;
    let deadline = Instant::now() + Duration::from_secs(wait);
    loop {
        let running = vm_lock(home, name)?.is_held();
        if running && booted(home, name, boot_delay(home, name)?) {
            println!("192.168.64.{}", 2 + fnv(name) % 250);
            return Ok(0);
        }
        let now = Instant::now();
        if now >= deadline {
            let suffix = if running { "" } else { ", is your VM running?" };
            return Err(Fail::Bare(1, format!("no IP address found{suffix}")));
        }
        std::thread::sleep((deadline - now).min(Duration::from_secs(1)));
    }
}

// ---------------------------------------------------------------------------------------------------- stop

fn cmd_stop(home: &Path, name: &str, timeout: u64) -> Outcome {
    let dir = require_vm(home, name)?;
    let pid = match vm_lock(home, name)? {
        LockProbe::HeldBy(pid) => pid,
        LockProbe::HeldByUnknown => {
            return Err(Fail::Error(format!(
                "VM \"{name}\" is locked by a process whose pid is unknown"
            )));
        }
        LockProbe::Free => {
            sweep_stopped(home, name, &dir)?;
            let state = dir.join("state.vzvmsave");
            if state.exists() {
                fs::remove_file(&state).map_err(|e| io_fail("cannot remove", &state, e))?;
                return Ok(0);
            }
            return Err(not_running(name));
        }
    };
    let held_by_pid = || matches!(vm_lock(home, name), Ok(LockProbe::HeldBy(p)) if p == pid);
    let _ = kill(pid, Signal::SIGINT);
    let deadline = Instant::now() + Duration::from_secs(timeout);
    while held_by_pid() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    if held_by_pid() {
        if let Err(e) = kill(pid, Signal::SIGKILL)
            && e != nix::errno::Errno::ESRCH
        {
            return Err(Fail::Error(format!(
                "failed to kill the VM process {pid} of \"{name}\": {e}"
            )));
        }
        while held_by_pid() {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    sweep_stopped(home, name, &dir)?;
    Ok(0)
}

/// Kills the guest processes a stopped VM left (those of a `run` killed at once), sparing the guests of a
/// `run` that may have started since.
fn sweep_stopped(home: &Path, name: &str, dir: &Path) -> Result<(), Fail> {
    let spare = match vm_lock(home, name)? {
        LockProbe::HeldBy(pid) => Some(pid),
        LockProbe::Free | LockProbe::HeldByUnknown => None,
    };
    guests::sweep(dir, spare)
        .map(drop)
        .map_err(|e| Fail::Error(format!("{e}; the VM is not running")))
}

// ---------------------------------------------------------------------------------------------------- delete

fn cmd_delete(home: &Path, name: &str) -> Result<(), Fail> {
    if name.contains('/') {
        let remote = parse_remote(name)?;
        let entry = home
            .join("cache/OCIs")
            .join(&remote.host)
            .join(&remote.repo)
            .join(&remote.reference);
        if fs::symlink_metadata(&entry).is_err() {
            return Err(does_not_exist(name));
        }
        let removed = if entry.is_symlink() || entry.is_file() {
            fs::remove_file(&entry)
        } else {
            fs::remove_dir_all(&entry)
        };
        return removed.map_err(|e| io_fail("cannot delete", &entry, e));
    }
    // Before touching the VM and holding nothing: a killed `delete` leaves the VM as it was.
    if let Some(delay) = faults_for(home, name)?.delete_delay_secs {
        std::thread::sleep(secs(delay));
    }
    let dir = require_vm(home, name)?;
    let Some(config) = take_vm_lock(&dir)? else {
        return Err(Fail::Bare(1, format!("VM \"{name}\" is running")));
    };
    // Holding the lock: no run can start guests while the leftovers of a killed one die.
    guests::sweep(&dir, None).map_err(|e| Fail::Error(format!("{e}; the VM is left in place")))?;
    if faults_for(home, name)?.delete_fails == Some(true) {
        return Err(Fail::Error(format!(
            "failed to delete VM \"{name}\": injected fault delete_fails (see {}); the VM is left in place",
            Faults::path(home).display()
        )));
    }
    fs::remove_dir_all(&dir).map_err(|e| io_fail("cannot delete", &dir, e))?;
    drop(config);
    Ok(())
}

// ---------------------------------------------------------------------------------------------------- list / get

fn local_vm_names(home: &Path) -> Result<Vec<String>, Fail> {
    let vms = home.join("vms");
    let mut names = Vec::new();
    for entry in fs::read_dir(&vms).map_err(|e| io_fail("cannot list", &vms, e))? {
        let entry = entry.map_err(|e| io_fail("cannot list", &vms, e))?;
        let Some(name) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        if complete_vm(&entry.path()) {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

fn complete_vm(dir: &Path) -> bool {
    ["config.json", "disk.img", "nvram.bin"]
        .iter()
        .all(|f| dir.join(f).is_file())
}

fn allocated_bytes(dir: &Path) -> u64 {
    fs::read_dir(dir)
        .map(|it| {
            it.flatten()
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.blocks() * 512)
                .sum()
        })
        .unwrap_or(0)
}

fn disk_gb(dir: &Path) -> u64 {
    fs::metadata(dir.join("disk.img"))
        .map(|m| m.len() / 1_000_000_000)
        .unwrap_or(0)
}

fn iso_atime(dir: &Path) -> String {
    let atime = fs::metadata(dir)
        .and_then(|m| m.accessed())
        .unwrap_or(SystemTime::UNIX_EPOCH);
    let secs = atime
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    k8s_openapi::jiff::Timestamp::from_second(secs)
        .map(|t| t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string())
        .unwrap_or_else(|_| "1970-01-01T00:00:00Z".into())
}

fn state_of(dir: &Path, running: bool) -> VmState {
    if running {
        VmState::Running
    } else if dir.join("state.vzvmsave").exists() {
        VmState::Suspended
    } else {
        VmState::Stopped
    }
}

fn local_entry(home: &Path, name: &str) -> Result<VmListEntry, Fail> {
    let dir = vm_dir(home, name);
    let running = vm_lock(home, name)?.is_held();
    Ok(VmListEntry {
        source: "local".into(),
        name: name.into(),
        disk: disk_gb(&dir),
        size: allocated_bytes(&dir) / 1_000_000_000,
        accessed: Some(iso_atime(&dir)),
        running,
        state: state_of(&dir, running),
    })
}

fn oci_entries(home: &Path) -> Vec<VmListEntry> {
    fn walk(dir: &Path, prefix: &str, out: &mut Vec<VmListEntry>) {
        let Ok(entries) = fs::read_dir(dir) else { return };
        for entry in entries.flatten() {
            let Some(part) = entry.file_name().to_str().map(str::to_string) else {
                continue;
            };
            let path = entry.path();
            let is_link = entry.file_type().map(|t| t.is_symlink()).unwrap_or(false);
            let name = if part.starts_with("sha256:") {
                Some(format!("{prefix}@{part}"))
            } else if is_link {
                Some(format!("{prefix}:{part}"))
            } else {
                None
            };
            match name {
                Some(name) if complete_vm(&path) => out.push(VmListEntry {
                    source: "OCI".into(),
                    name,
                    disk: disk_gb(&path),
                    size: allocated_bytes(&path) / 1_000_000_000,
                    accessed: Some(iso_atime(&path)),
                    running: false,
                    state: VmState::Stopped,
                }),
                Some(_) => {}
                None if path.is_dir() => walk(&path, &format!("{prefix}/{part}"), out),
                None => {}
            }
        }
    }
    let mut out = Vec::new();
    let root = home.join("cache/OCIs");
    if let Ok(hosts) = fs::read_dir(&root) {
        for host in hosts.flatten() {
            if let Some(h) = host.file_name().to_str() {
                walk(&host.path(), h, &mut out);
            }
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// Swift's `JSONEncoder` with `.prettyPrinted`: two-space indent and `"key" : value`.
fn print_pretty_json<T: Serialize>(value: &T) -> Result<(), Fail> {
    struct SwiftPretty<'a>(serde_json::ser::PrettyFormatter<'a>);
    impl serde_json::ser::Formatter for SwiftPretty<'_> {
        fn begin_array<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
            self.0.begin_array(w)
        }
        fn end_array<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
            self.0.end_array(w)
        }
        fn begin_array_value<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
            self.0.begin_array_value(w, first)
        }
        fn end_array_value<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
            self.0.end_array_value(w)
        }
        fn begin_object<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
            self.0.begin_object(w)
        }
        fn end_object<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
            self.0.end_object(w)
        }
        fn begin_object_key<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
            self.0.begin_object_key(w, first)
        }
        fn begin_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
            w.write_all(b" : ")
        }
        fn end_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
            self.0.end_object_value(w)
        }
    }
    let mut out = Vec::new();
    let mut ser =
        serde_json::Serializer::with_formatter(&mut out, SwiftPretty(serde_json::ser::PrettyFormatter::new()));
    value
        .serialize(&mut ser)
        .map_err(|e| Fail::Error(format!("cannot encode JSON: {e}")))?;
    out.push(b'\n');
    io::stdout()
        .write_all(&out)
        .map_err(|e| Fail::Error(format!("cannot write to stdout: {e}")))
}

fn cmd_list(home: &Path, format: Format, source: Option<Source>, quiet: bool) -> Outcome {
    let mut entries = Vec::new();
    if source != Some(Source::Oci) {
        for name in local_vm_names(home)? {
            entries.push(local_entry(home, &name)?);
        }
    }
    if source != Some(Source::Local) {
        entries.extend(oci_entries(home));
    }
    if quiet {
        for e in &entries {
            println!("{}", e.name);
        }
        return Ok(0);
    }
    match format {
        Format::Json => print_pretty_json(&entries)?,
        Format::Text => {
            println!("Source\tName\tDisk\tSize\tAccessed\tState");
            for e in &entries {
                let state = serde_json::to_value(e.state)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default();
                println!(
                    "{}\t{}\t{}\t{}\t{}\t{}",
                    e.source,
                    e.name,
                    e.disk,
                    e.size,
                    e.accessed.as_deref().unwrap_or(""),
                    state
                );
            }
        }
    }
    Ok(0)
}

fn cmd_get(home: &Path, name: &str, format: Format) -> Outcome {
    let dir = require_vm(home, name)?;
    let config = read_config(&dir.join("config.json"))?;
    let num = |key: &str| config.get(key).and_then(|v| v.as_u64()).unwrap_or(0);
    let display = config.get("display");
    let dim = |key: &str| display.and_then(|d| d.get(key)).and_then(|v| v.as_u64()).unwrap_or(0);
    let running = vm_lock(home, name)?.is_held();
    let info = VmInfo {
        os: config
            .get("os")
            .and_then(|v| v.as_str())
            .unwrap_or("darwin")
            .to_string(),
        cpu: num("cpuCount") as u32,
        memory: num("memorySize") / 1024 / 1024,
        disk: disk_gb(&dir),
        disk_format: Some(
            config
                .get("diskFormat")
                .and_then(|v| v.as_str())
                .unwrap_or("raw")
                .to_string(),
        ),
        size: format!("{:.3}", allocated_bytes(&dir) as f64 / 1e9),
        display: format!("{}x{}", dim("width"), dim("height")),
        running,
        state: state_of(&dir, running),
    };
    match format {
        Format::Json => print_pretty_json(&info)?,
        Format::Text => {
            let value = serde_json::to_value(&info).map_err(|e| Fail::Error(format!("cannot encode: {e}")))?;
            if let serde_json::Value::Object(map) = value {
                for (k, v) in map {
                    println!(
                        "{k}\t{}",
                        v.as_str().map(str::to_string).unwrap_or_else(|| v.to_string())
                    );
                }
            }
        }
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_names_parse_like_oci_references() {
        let r = parse_remote("ghcr.io/cirruslabs/macos-sequoia-base:latest").unwrap_or_else(|_| panic!());
        assert_eq!(
            (r.host.as_str(), r.repo.as_str(), r.reference.as_str()),
            ("ghcr.io", "cirruslabs/macos-sequoia-base", "latest")
        );
        let r = parse_remote("localhost:5000/a/b").unwrap_or_else(|_| panic!());
        assert_eq!(
            (r.host.as_str(), r.repo.as_str(), r.reference.as_str()),
            ("localhost:5000", "a/b", "latest")
        );
        let r = parse_remote("ghcr.io/a/b@sha256:abc").unwrap_or_else(|_| panic!());
        assert_eq!(r.reference, "sha256:abc");
        assert!(parse_remote("ghcr.io/../x:1").is_err());
    }

    #[test]
    fn exec_argv_after_name_is_kept_verbatim() {
        let args = |v: &[&str]| v.iter().map(OsString::from).collect::<Vec<_>>();
        let (head, tail) = split_exec_argv(args(&["tart", "exec", "-i", "mb-x", "--", "ls", "-l"]));
        assert_eq!(head, args(&["tart", "exec", "-i", "mb-x"]));
        assert_eq!(tail, Some(args(&["--", "ls", "-l"])));
        let (head, tail) = split_exec_argv(args(&["tart", "list", "-q"]));
        assert_eq!((head.len(), tail), (3, None));
    }

    #[test]
    fn random_macs_are_local_unicast() {
        let mac = random_mac();
        let first = u8::from_str_radix(&mac[..2], 16).unwrap();
        assert_eq!(first & 0x03, 0x02, "{mac}");
        assert_eq!(mac.len(), 17);
    }
}
