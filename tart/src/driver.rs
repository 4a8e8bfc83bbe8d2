//! The async tart driver: one method per tart command, each with a timeout that kills the child.

use std::collections::VecDeque;
use std::ffi::{OsStr, OsString};
use std::io::Write;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::AsyncReadExt;
use tokio::process::{Child, Command};

use crate::discovery::{self, ClientFilter, KillReport};
use crate::error::TartError;
use crate::types::{VmInfo, VmListEntry};

mod output;

pub use output::{LOG_FILE_MODE, OutputConsumer, log_cap_note};
use output::{LogSink, pump};

/// Per-command time limits. tart turns lock contention into a hang, so these are what gets a caller unstuck.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// `clone` (may pull an image: many minutes).
    pub clone: Duration,
    /// `set`.
    pub set: Duration,
    /// `delete`.
    pub delete: Duration,
    /// `list`.
    pub list: Duration,
    /// `get`.
    pub get: Duration,
    /// Added to `ip --wait N` (the call may take N seconds by design).
    pub ip_margin: Duration,
    /// Added to `stop --timeout S` (tart sends SIGKILL after S seconds, then waits for the exit).
    pub stop_margin: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            clone: Duration::from_secs(30 * 60),
            set: Duration::from_secs(60),
            delete: Duration::from_secs(60),
            list: Duration::from_secs(60),
            get: Duration::from_secs(60),
            ip_margin: Duration::from_secs(30),
            stop_margin: Duration::from_secs(30),
        }
    }
}

/// Arguments of `tart set`. `None`/`false` leaves a setting alone.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SetOptions {
    pub cpu: Option<u32>,
    /// Memory in MB.
    pub memory_mb: Option<u64>,
    /// `--random-mac`: do this after every clone (DHCP leases are keyed by MAC).
    pub random_mac: bool,
}

/// Arguments of `tart run` beyond the fixed `--no-graphics`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunOptions {
    /// Where `tart run`'s stdout and stderr go (appended); `None` discards them.
    pub log_path: Option<PathBuf>,
    /// Extra flags placed before the VM name, e.g. `["--dir", "src:/path"]`.
    pub extra_args: Vec<String>,
    /// Start `tart run` in a session of its own (`setsid`: its process group is its pid) instead of the
    /// caller's process group. See [`Tart::run`] for what each mode means when the caller dies.
    pub detached: bool,
}

/// How to run `tart exec`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOptions {
    /// stdout and stderr are appended here, interleaved in arrival order.
    pub log_path: PathBuf,
    /// At most this many bytes are written to the log by one exec; then a marker line, then nothing more.
    pub log_cap: u64,
    /// How many bytes of the most recent output [`ExecOutcome::tail`] keeps.
    pub tail_bytes: usize,
    /// The whole exec, including the guest command; on expiry the `tart exec` process is killed.
    pub timeout: Duration,
    /// Once the cap is reached, kill the `tart exec` process and return at once (its outcome:
    /// `truncated`, `exit_code` -1) instead of reading (and dropping) output until the command
    /// ends: for a read whose output past the cap is worthless, which a guest could otherwise
    /// make endless (`cat /dev/zero`).
    pub stop_at_cap: bool,
}

impl ExecOptions {
    /// 64 MiB log cap and a 16 KiB tail.
    pub fn new(log_path: impl Into<PathBuf>, timeout: Duration) -> Self {
        ExecOptions {
            log_path: log_path.into(),
            log_cap: 64 << 20,
            tail_bytes: 16 << 10,
            timeout,
            stop_at_cap: false,
        }
    }
}

/// How to run a `tart exec` whose output is kept in memory ([`Tart::exec_capture`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CaptureOptions {
    /// Most bytes of output kept; past it [`ExecOutcome::truncated`] is set and the rest is
    /// counted, not kept.
    pub max_bytes: u64,
    /// The whole exec, including the guest command; on expiry the `tart exec` process is killed.
    pub timeout: Duration,
    /// Once the cap is reached, kill the `tart exec` process and return at once, as
    /// [`ExecOptions::stop_at_cap`]; otherwise output past the cap is read and counted until
    /// the exec ends, so that its own end decides the outcome.
    pub stop_at_cap: bool,
}

/// A `tart exec` whose output was kept in memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Captured {
    /// As for [`Tart::exec`], except that `tail` is the end of tart's stderr only (what tart
    /// itself says), so that the output, which may hold what must not reach a log, stays here.
    pub outcome: ExecOutcome,
    /// stdout and stderr interleaved in arrival order, at most `max_bytes` of it.
    pub output: Vec<u8>,
}

/// The result of a `tart exec` that reached the guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutcome {
    /// The guest command's exit code (255 if it was killed by a signal in the guest; -1 if the
    /// exec was stopped at the cap, see [`ExecOptions::stop_at_cap`]).
    pub exit_code: i32,
    /// The end of the combined output (lossy UTF-8), for status messages.
    pub tail: String,
    /// Bytes of output produced (including any not written because of the cap).
    pub output_bytes: u64,
    /// True if the log cap was reached.
    pub truncated: bool,
    pub elapsed: Duration,
}

/// A `tart exec` whose output went to a consumer ([`Tart::exec_into`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Consumed {
    /// As for [`Tart::exec`]; an exec the consumer stopped has exit code -1.
    pub outcome: ExecOutcome,
    /// Why the consumer refused the output, if it did.
    pub refused: Option<String>,
}

/// How a `tart run` ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunExit {
    pub code: Option<i32>,
    pub signal: Option<i32>,
}

impl RunExit {
    fn from_status(status: ExitStatus) -> Self {
        use std::os::unix::process::ExitStatusExt;
        RunExit {
            code: status.code(),
            signal: status.signal(),
        }
    }
}

impl std::fmt::Display for RunExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.code, self.signal) {
            (Some(c), _) => write!(f, "exit code {c}"),
            (None, Some(s)) => write!(f, "killed by signal {s}"),
            (None, None) => write!(f, "unknown status"),
        }
    }
}

/// A `tart run NAME` we started, in the caller's process group or, with [`RunOptions::detached`], in a
/// session of its own (see [`Tart::run`]). Dropping the handle does **not** stop the VM: a process that
/// outlives its caller (always when detached; in the caller's group only if the caller dies alone, as under
/// `nohup`) is found again with [`discovery::run_pid`] and ended with [`discovery::kill_vm_processes`].
#[derive(Debug)]
pub struct RunningVm {
    name: String,
    pid: Pid,
    child: Child,
    config_path: PathBuf,
    log_path: Option<PathBuf>,
}

impl RunningVm {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The pid of the `tart run` process.
    pub fn pid(&self) -> Pid {
        self.pid
    }

    /// Waits for `tart run` to exit.
    pub async fn wait(&mut self) -> Result<RunExit, TartError> {
        let status = self.child.wait().await.map_err(|source| TartError::Io {
            action: "could not wait for tart run of",
            path: self.config_path.clone(),
            source,
        })?;
        Ok(RunExit::from_status(status))
    }

    /// `Some` once `tart run` has exited.
    pub fn try_wait(&mut self) -> Result<Option<RunExit>, TartError> {
        let status = self.child.try_wait().map_err(|source| TartError::Io {
            action: "could not poll tart run of",
            path: self.config_path.clone(),
            source,
        })?;
        Ok(status.map(RunExit::from_status))
    }

    /// Sends `signal` to `tart run` (SIGINT: hard stop, exit 0; SIGUSR2: ask the guest to shut down).
    /// Returns `Ok(false)` without signalling if it has already exited (its pid may belong to someone else now).
    pub fn signal(&mut self, signal: Signal) -> Result<bool, TartError> {
        if self.try_wait()?.is_some() {
            return Ok(false);
        }
        kill(self.pid, signal).map(|()| true).map_err(|e| TartError::Io {
            action: "could not signal tart run of",
            path: self.config_path.clone(),
            source: std::io::Error::other(format!("{signal} to pid {}: {e}", self.pid)),
        })
    }

    /// SIGKILLs `tart run` and waits for it to exit (the kernel then drops the VM lock).
    pub async fn kill(&mut self) -> Result<RunExit, TartError> {
        if self.try_wait()?.is_none() {
            let _ = self.child.start_kill();
        }
        self.wait().await
    }

    /// Waits until this process holds the VM lock (the VM reads as running), polling every 50 ms.
    /// If `tart run` exits first, returns [`TartError::RunExitedEarly`] with the end of its log. On timeout it
    /// kills `tart run` (e.g. stuck behind the global lock of a long clone) and returns [`TartError::Timeout`].
    pub async fn wait_until_running(&mut self, timeout: Duration) -> Result<(), TartError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(exit) = self.try_wait()? {
                return Err(TartError::RunExitedEarly {
                    vm: self.name.clone(),
                    status: exit.to_string(),
                    detail: self.log_tail(),
                });
            }
            match crate::lock::probe_write_lock(&self.config_path) {
                Ok(crate::lock::LockProbe::HeldBy(p)) if p == self.pid => return Ok(()),
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => {
                    return Err(TartError::Io {
                        action: "could not query the VM lock (F_GETLK) on",
                        path: self.config_path.clone(),
                        source,
                    });
                }
            }
            if Instant::now() >= deadline {
                let _ = self.kill().await;
                return Err(TartError::Timeout {
                    command: "run",
                    vm: self.name.clone(),
                    after: timeout,
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn log_tail(&self) -> String {
        match &self.log_path {
            Some(p) => std::fs::read(p)
                .map(|b| {
                    String::from_utf8_lossy(&b[b.len().saturating_sub(2048)..])
                        .trim()
                        .to_string()
                })
                .unwrap_or_else(|e| format!("(log {} unreadable: {e})", p.display())),
            None => "(tart run output was discarded; pass RunOptions::log_path to keep it)".to_string(),
        }
    }
}

/// A configured tart CLI: which program to run and which `TART_HOME` it works on.
#[derive(Debug, Clone)]
pub struct Tart {
    program: PathBuf,
    home: Option<PathBuf>,
    timeouts: Timeouts,
}

impl Tart {
    /// `program` is `tart` (found on PATH), an absolute path, or the test double. `home`, if given, is passed as
    /// `TART_HOME`; otherwise tart's own default applies (the inherited `TART_HOME`, else `~/.tart`).
    pub fn new(program: impl Into<PathBuf>, home: Option<PathBuf>) -> Self {
        Tart {
            program: program.into(),
            home,
            timeouts: Timeouts::default(),
        }
    }

    pub fn with_timeouts(mut self, timeouts: Timeouts) -> Self {
        self.timeouts = timeouts;
        self
    }

    pub fn program(&self) -> &Path {
        &self.program
    }

    pub fn timeouts(&self) -> &Timeouts {
        &self.timeouts
    }

    /// The home folder the tart processes of this driver work on.
    pub fn home(&self) -> Result<PathBuf, TartError> {
        match &self.home {
            Some(h) => Ok(h.clone()),
            None => discovery::tart_home(),
        }
    }

    /// `<home>/vms/<name>`.
    pub fn vm_dir(&self, name: &str) -> Result<PathBuf, TartError> {
        Ok(discovery::vm_dir(&self.home()?, name))
    }

    /// Which processes count as this driver's tart clients (its program name, in its home).
    pub fn client_filter(&self) -> Result<ClientFilter, TartError> {
        Ok(ClientFilter::new(&self.program).in_home(self.home()?))
    }

    /// The `tart run` pid of `name` via `F_GETLK` (never takes the lock).
    pub fn run_pid(&self, name: &str) -> Result<Option<Pid>, TartError> {
        discovery::run_pid(&self.home()?, name)
    }

    /// Tart client processes of `name` (see [`discovery::client_pids`]).
    pub fn client_pids(&self, name: &str) -> Result<Vec<Pid>, TartError> {
        Ok(discovery::client_pids(name, &self.client_filter()?))
    }

    /// SIGKILLs the `tart run` and every tart client of `name`, and waits until they are gone.
    pub async fn kill_vm_processes(&self, name: &str) -> Result<KillReport, TartError> {
        discovery::kill_vm_processes(&self.home()?, name, &self.client_filter()?).await
    }

    fn command(&self) -> Command {
        let mut cmd = Command::new(&self.program);
        if let Some(home) = &self.home {
            cmd.env("TART_HOME", home);
        }
        cmd.stdin(Stdio::null());
        cmd
    }

    async fn invoke(
        &self,
        command: &'static str,
        vm: &str,
        args: &[&OsStr],
        timeout: Duration,
    ) -> Result<std::process::Output, TartError> {
        let mut cmd = self.command();
        cmd.arg(command)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let child = cmd
            .spawn()
            .map_err(|source| self.spawn_error(command, vm, args, source))?;
        tracing::debug!(command, vm, args = %argv_for_log(args), "tart call");
        let output = match tokio::time::timeout(timeout, child.wait_with_output()).await {
            Err(_elapsed) => {
                tracing::warn!(command, vm, ?timeout, "tart call timed out; killed");
                return Err(TartError::Timeout {
                    command,
                    vm: vm.to_string(),
                    after: timeout,
                });
            }
            Ok(Err(source)) => {
                return Err(TartError::Io {
                    action: "could not collect the output of tart",
                    path: self.program.clone(),
                    source,
                });
            }
            Ok(Ok(output)) => output,
        };
        if output.status.success() {
            return Ok(output);
        }
        Err(classify(
            command,
            vm,
            output.status,
            &String::from_utf8_lossy(&output.stderr),
        ))
    }

    /// The error for a tart child that did not start: E2BIG says the arguments are too long
    /// (with their size, not their text), a NUL byte which argument holds it, anything else that
    /// tart could not be started.
    fn spawn_error(
        &self,
        command: &'static str,
        vm: &str,
        args: &[impl AsRef<OsStr>],
        source: std::io::Error,
    ) -> TartError {
        if source.raw_os_error() == Some(libc::E2BIG) {
            return TartError::ArgumentsTooLong {
                command,
                vm: vm.to_string(),
                program: self.program.clone(),
                count: args.len(),
                bytes: args.iter().map(|a| a.as_ref().len()).sum(),
            };
        }
        if let Some(index) = args.iter().position(|a| a.as_ref().as_encoded_bytes().contains(&0)) {
            return TartError::ArgumentHasNul {
                command,
                vm: vm.to_string(),
                program: self.program.clone(),
                index,
            };
        }
        TartError::Spawn {
            command,
            vm: vm.to_string(),
            program: self.program.clone(),
            source,
        }
    }

    /// `tart clone SRC NAME`. Never clone onto a name that may exist or run: tart overwrites silently.
    pub async fn clone_vm(&self, src: &str, name: &str) -> Result<(), TartError> {
        self.invoke("clone", name, &[src.as_ref(), name.as_ref()], self.timeouts.clone)
            .await?;
        Ok(())
    }

    /// `tart set NAME [--cpu N] [--memory MB] [--random-mac]`.
    pub async fn set(&self, name: &str, options: &SetOptions) -> Result<(), TartError> {
        let mut args: Vec<OsString> = vec![name.into()];
        if let Some(cpu) = options.cpu {
            args.extend(["--cpu".into(), cpu.to_string().into()]);
        }
        if let Some(mb) = options.memory_mb {
            args.extend(["--memory".into(), mb.to_string().into()]);
        }
        if options.random_mac {
            args.push("--random-mac".into());
        }
        let args: Vec<&OsStr> = args.iter().map(OsString::as_os_str).collect();
        self.invoke("set", name, &args, self.timeouts.set).await?;
        Ok(())
    }

    /// Starts `tart run --no-graphics [extra] NAME` and returns at once, with stdin from `/dev/null`. Use
    /// [`RunningVm::wait_until_running`] to wait until it holds the VM lock. Dropping the handle never stops
    /// the VM. The VM lives inside this one process: whatever kills it kills the guest and every process in it.
    ///
    /// Where the process goes decides whether the VM outlives the caller. The agent's LaunchAgent leaves
    /// `AbandonProcessGroup` unset (false), so when the agent's job ends (exit, crash, `launchctl bootout`)
    /// launchd SIGKILLs whatever is left in the job's process group:
    ///
    /// * Default (`detached: false`): `tart run` stays in the caller's process group, so it dies with the
    ///   agent's job, as does any signal sent to that group (e.g. a terminal's Ctrl-C). No VM runs without
    ///   its agent.
    /// * `detached: true`: `tart run` calls `setsid` before exec (a new session and process group, both its
    ///   own pid), outside the job's group: neither launchd's group kill, nor signals to the caller's group,
    ///   nor the caller's exit reach it. The VM keeps running across an agent restart or upgrade; the next
    ///   agent finds it with [`Tart::run_pid`] (`F_GETLK`) and ends it with [`Tart::stop`] or
    ///   [`Tart::kill_vm_processes`]. For an agent that never comes back, the watchdog's deadline is what
    ///   deletes it (the watchdog kills through the same discovery).
    pub fn run(&self, name: &str, options: &RunOptions) -> Result<RunningVm, TartError> {
        let home = self.home()?;
        let mut cmd = self.command();
        cmd.arg("run").arg("--no-graphics").args(&options.extra_args).arg(name);
        cmd.kill_on_drop(false);
        if options.detached {
            // SAFETY: the closure only calls setsid(2), which is async-signal-safe. It cannot fail in a
            // freshly forked child (which never leads a process group).
            unsafe {
                cmd.pre_exec(|| nix::unistd::setsid().map(drop).map_err(std::io::Error::from));
            }
        }
        match &options.log_path {
            Some(path) => {
                let open = || {
                    use std::os::unix::fs::OpenOptionsExt;
                    std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .mode(LOG_FILE_MODE)
                        .open(path)
                        .map_err(|source| TartError::Io {
                            action: "could not open the tart run log",
                            path: path.clone(),
                            source,
                        })
                };
                cmd.stdout(open()?).stderr(open()?);
            }
            None => {
                cmd.stdout(Stdio::null()).stderr(Stdio::null());
            }
        }
        let child = cmd.spawn().map_err(|source| TartError::Spawn {
            command: "run",
            vm: name.to_string(),
            program: self.program.clone(),
            source,
        })?;
        let Some(raw_pid) = child.id() else {
            return Err(TartError::RunExitedEarly {
                vm: name.to_string(),
                status: "reaped before its pid was read".into(),
                detail: "tart run exited immediately".into(),
            });
        };
        let pid = Pid::from_raw(raw_pid as i32);
        tracing::info!(vm = name, %pid, "started tart run");
        Ok(RunningVm {
            name: name.to_string(),
            pid,
            child,
            config_path: discovery::vm_config_path(&home, name),
            log_path: options.log_path.clone(),
        })
    }

    /// `tart exec NAME argv…` (no host shell; no `--`, which tart would pass to the guest as argv[0]).
    ///
    /// Output is streamed to `options.log_path` with a cap; the guest's exit code comes back in
    /// [`ExecOutcome::exit_code`], whatever it is. tart's own refusals are told apart from guest exit codes by
    /// their exact last stderr line: [`TartError::VmNotRunning`], [`TartError::VmDoesNotExist`],
    /// [`TartError::GuestAgentUnavailable`]. On timeout the `tart exec` process is killed.
    pub async fn exec(&self, name: &str, argv: &[String], options: &ExecOptions) -> Result<ExecOutcome, TartError> {
        let sink = LogSink::open(&options.log_path, options.log_cap, options.tail_bytes)?;
        self.exec_with(name, argv, None, sink, options.timeout, options.stop_at_cap)
            .await
            .map(|(o, _)| o)
    }

    /// `tart exec [-i] NAME argv…` (`-i` with `input` as the guest command's stdin) with the
    /// output kept in memory, never written to a file: for output that may hold secret values
    /// before they are masked. Otherwise as [`exec`](Self::exec).
    pub async fn exec_capture(
        &self,
        name: &str,
        argv: &[String],
        input: Option<Vec<u8>>,
        options: &CaptureOptions,
    ) -> Result<Captured, TartError> {
        let sink = LogSink::memory(options.max_bytes);
        let (outcome, sink) = self
            .exec_with(name, argv, input, sink, options.timeout, options.stop_at_cap)
            .await?;
        Ok(Captured {
            outcome,
            output: sink.into_memory(),
        })
    }

    /// `tart exec NAME argv…` with its stdout handed to `consumer` as it comes (at most
    /// `options.log_cap` bytes; `options.log_path` is not used; stderr goes only to the tail and
    /// is not counted in `output_bytes`), never written by the driver:
    /// for output the caller checks before it writes any of it. A consumer's refusal stops the
    /// exec and is returned as [`Consumed::refused`]. Otherwise as [`exec`](Self::exec), with the
    /// tail of tart's stderr only (as [`exec_capture`](Self::exec_capture)).
    pub async fn exec_into(
        &self,
        name: &str,
        argv: &[String],
        consumer: Box<dyn OutputConsumer>,
        options: &ExecOptions,
    ) -> Result<Consumed, TartError> {
        let sink = LogSink::consumer(consumer, options.log_cap);
        let (outcome, sink) = self
            .exec_with(name, argv, None, sink, options.timeout, options.stop_at_cap)
            .await?;
        Ok(Consumed {
            outcome,
            refused: sink.refused,
        })
    }

    /// `tart exec -i NAME argv…` with `input` as the guest command's stdin (then EOF): the way to
    /// hand the guest data that must not appear on a command line (every argv shows in `ps`).
    /// Otherwise as [`exec`](Self::exec).
    pub async fn exec_input(
        &self,
        name: &str,
        argv: &[String],
        input: Vec<u8>,
        options: &ExecOptions,
    ) -> Result<ExecOutcome, TartError> {
        let sink = LogSink::open(&options.log_path, options.log_cap, options.tail_bytes)?;
        self.exec_with(name, argv, Some(input), sink, options.timeout, options.stop_at_cap)
            .await
            .map(|(o, _)| o)
    }

    /// Runs the exec into `sink`; returns the outcome and the sink (what a memory sink kept, why
    /// a consumer refused).
    async fn exec_with(
        &self,
        name: &str,
        argv: &[String],
        input: Option<Vec<u8>>,
        mut sink: LogSink,
        timeout: Duration,
        stop_at_cap: bool,
    ) -> Result<(ExecOutcome, LogSink), TartError> {
        if argv.is_empty() {
            return Err(TartError::Usage {
                command: "exec",
                vm: name.to_string(),
                stderr: "no command given: tart exec needs NAME CMD [ARG...]".into(),
            });
        }
        let started = Instant::now();
        let mut cmd = self.command();
        cmd.arg("exec");
        if input.is_some() {
            // Flags must precede NAME; after it everything is the guest's argv.
            cmd.arg("-i").stdin(Stdio::piped());
        }
        cmd.arg(name).args(argv);
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).kill_on_drop(true);
        let mut child = cmd
            .spawn()
            .map_err(|source| self.spawn_error("exec", name, argv, source))?;
        if let (Some(input), Some(mut stdin)) = (input, child.stdin.take()) {
            // Written alongside the output pump (a guest that answers before reading all of its
            // input must not deadlock us); closing stdin is the guest command's EOF. A guest
            // command that exits without reading it all only shows in its exit code.
            tokio::spawn(async move {
                use tokio::io::AsyncWriteExt;
                let _ = stdin.write_all(&input).await;
                let _ = stdin.shutdown().await;
            });
        }
        let (Some(mut out), Some(mut err)) = (child.stdout.take(), child.stderr.take()) else {
            return Err(TartError::Io {
                action: "tart exec started without its output pipes for",
                path: sink.path.clone(),
                source: std::io::Error::other("stdout/stderr not captured"),
            });
        };
        let pumped = tokio::time::timeout(timeout, pump(&mut child, &mut out, &mut err, &mut sink, stop_at_cap)).await;
        let status = match pumped {
            Err(_elapsed) => {
                let _ = child.start_kill();
                let _ = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
                sink.note(&format!("[tartan: tart exec killed after {timeout:?} timeout]\n"));
                return Err(TartError::ExecTimeout {
                    vm: name.to_string(),
                    after: timeout,
                    tail: sink.tail(),
                });
            }
            Ok(Err(source)) => {
                return Err(TartError::Io {
                    action: "could not stream tart exec output to",
                    path: sink.path.clone(),
                    source,
                });
            }
            Ok(Ok(Some(status))) => status,
            Ok(Ok(None)) => {
                // Stopped at the cap or by the consumer: what follows is not wanted, and may
                // never end.
                let _ = child.start_kill();
                let _ = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
                sink.flush();
                let outcome = ExecOutcome {
                    exit_code: -1,
                    tail: sink.tail(),
                    output_bytes: sink.total,
                    // False when the consumer, not the cap, stopped it.
                    truncated: sink.truncated,
                    elapsed: started.elapsed(),
                };
                return Ok((outcome, sink));
            }
        };
        sink.flush();
        let code = match status.code() {
            Some(code) => code,
            None => {
                use std::os::unix::process::ExitStatusExt;
                return Err(TartError::Killed {
                    command: "exec",
                    vm: name.to_string(),
                    signal: status.signal().unwrap_or_default(),
                    stderr: sink.stderr_tail(),
                });
            }
        };
        if code != 0
            && let Some(e) = exec_refusal(name, code, &sink.stderr_tail())
        {
            return Err(e);
        }
        let outcome = ExecOutcome {
            exit_code: code,
            tail: sink.tail(),
            output_bytes: sink.total,
            truncated: sink.truncated,
            elapsed: started.elapsed(),
        };
        Ok((outcome, sink))
    }

    /// `tart ip NAME --wait N`.
    pub async fn ip(&self, name: &str, wait: Duration) -> Result<IpAddr, TartError> {
        let secs = wait.as_secs().to_string();
        let out = self
            .invoke(
                "ip",
                name,
                &[name.as_ref(), "--wait".as_ref(), secs.as_ref()],
                wait + self.timeouts.ip_margin,
            )
            .await?;
        let text = String::from_utf8_lossy(&out.stdout);
        text.trim().parse().map_err(|e| TartError::UnexpectedOutput {
            command: "ip",
            vm: name.to_string(),
            detail: format!("not an IP address: {e}"),
            output: text.to_string(),
        })
    }

    /// `tart stop NAME --timeout S`: SIGINT, then SIGKILL after S seconds. Errors with
    /// [`TartError::VmNotRunning`] if it was not running.
    pub async fn stop(&self, name: &str, timeout: Duration) -> Result<(), TartError> {
        let secs = timeout.as_secs().to_string();
        let limit = timeout + self.timeouts.stop_margin;
        self.invoke(
            "stop",
            name,
            &[name.as_ref(), "--timeout".as_ref(), secs.as_ref()],
            limit,
        )
        .await?;
        Ok(())
    }

    /// `tart delete NAME`. Refused with [`TartError::VmRunning`] while a `tart run` holds the VM lock;
    /// [`TartError::VmDoesNotExist`] if already gone.
    pub async fn delete(&self, name: &str) -> Result<(), TartError> {
        self.invoke("delete", name, &[name.as_ref()], self.timeouts.delete)
            .await?;
        Ok(())
    }

    /// `tart list --format json`: local VMs, then OCI cache entries.
    pub async fn list(&self) -> Result<Vec<VmListEntry>, TartError> {
        let out = self
            .invoke("list", "", &["--format".as_ref(), "json".as_ref()], self.timeouts.list)
            .await?;
        parse_json("list", "", &out.stdout)
    }

    /// `tart get NAME --format json`.
    pub async fn get(&self, name: &str) -> Result<VmInfo, TartError> {
        let out = self
            .invoke(
                "get",
                name,
                &[name.as_ref(), "--format".as_ref(), "json".as_ref()],
                self.timeouts.get,
            )
            .await?;
        parse_json("get", name, &out.stdout)
    }
}

fn parse_json<T: serde::de::DeserializeOwned>(command: &'static str, vm: &str, stdout: &[u8]) -> Result<T, TartError> {
    serde_json::from_slice(stdout).map_err(|e| TartError::UnexpectedOutput {
        command,
        vm: vm.to_string(),
        detail: format!("not the JSON tart documents: {e}"),
        output: cap_text(&String::from_utf8_lossy(stdout), 4096),
    })
}

/// Most bytes of an argv [`argv_for_log`] shows.
pub const ARGV_LOG_MAX: usize = 1024;

/// An argv for a log line: its words, quoted as by `{:?}`, cut after [`ARGV_LOG_MAX`] bytes with
/// the count and size of the whole (a step may pass megabytes, which must not flood the log).
pub fn argv_for_log(argv: &[impl AsRef<OsStr>]) -> String {
    let mut out = String::from("[");
    for (i, a) in argv.iter().enumerate() {
        let word = format!("{:?}", a.as_ref());
        if out.len() + word.len() + 2 > ARGV_LOG_MAX {
            let bytes: usize = argv.iter().map(|a| a.as_ref().len()).sum();
            let shown = cap_head(&word, ARGV_LOG_MAX.saturating_sub(out.len()).min(word.len()));
            out.push_str(if i > 0 { ", " } else { "" });
            out.push_str(shown);
            out.push_str(&format!("…] ({} arguments, {bytes} bytes in all)", argv.len()));
            return out;
        }
        if i > 0 {
            out.push_str(", ");
        }
        out.push_str(&word);
    }
    out.push(']');
    out
}

/// The first `max` bytes of `s` (at a character boundary).
fn cap_head(s: &str, max: usize) -> &str {
    let mut end = max.min(s.len());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn cap_text(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut cut = s.len() - max;
    while !s.is_char_boundary(cut) {
        cut += 1;
    }
    format!("…{}", &s[cut..])
}

fn last_line(stderr: &str) -> &str {
    stderr.lines().map(str::trim).rfind(|l| !l.is_empty()).unwrap_or("")
}

/// Maps a failed tart invocation to an error, from its exit status and its (last) stderr line.
pub(crate) fn classify(command: &'static str, vm: &str, status: ExitStatus, stderr: &str) -> TartError {
    use std::os::unix::process::ExitStatusExt;
    let vm_s = vm.to_string();
    let stderr_capped = cap_text(stderr.trim(), 4096);
    let Some(code) = status.code() else {
        return TartError::Killed {
            command,
            vm: vm_s,
            signal: status.signal().unwrap_or_default(),
            stderr: stderr_capped,
        };
    };
    if code == 64 {
        return TartError::Usage {
            command,
            vm: vm_s,
            stderr: stderr_capped,
        };
    }
    let line = last_line(stderr);
    let message = line.strip_prefix("Error: ").unwrap_or(line).to_string();
    if (code == 2 || code == 1) && message.contains("does not exist") {
        return TartError::VmDoesNotExist {
            command,
            vm: vm_s,
            message,
        };
    }
    if code == 2 && message.ends_with("is not running") {
        return TartError::VmNotRunning {
            command,
            vm: vm_s,
            message,
        };
    }
    if code == 2 && message.contains("is already running") {
        return TartError::VmAlreadyRunning {
            command,
            vm: vm_s,
            message,
        };
    }
    if code == 1 && message.ends_with("is running") {
        return TartError::VmRunning {
            command,
            vm: vm_s,
            message,
        };
    }
    TartError::Failed {
        command,
        vm: vm_s,
        code,
        stderr: stderr_capped,
    }
}

/// tart's own refusals of an exec, recognised only by their exact wording for this VM (guest exit codes 1 and 2
/// are common, so the code alone proves nothing).
fn exec_refusal(vm: &str, code: i32, stderr: &str) -> Option<TartError> {
    let line = last_line(stderr);
    let message = line.to_string();
    if code == 2 && line == format!("VM \"{vm}\" is not running") {
        return Some(TartError::VmNotRunning {
            command: "exec",
            vm: vm.to_string(),
            message,
        });
    }
    if code == 2 && line == format!("the specified VM \"{vm}\" does not exist") {
        return Some(TartError::VmDoesNotExist {
            command: "exec",
            vm: vm.to_string(),
            message,
        });
    }
    if code == 1 && line.contains("Failed to connect to the VM using its control socket") {
        return Some(TartError::GuestAgentUnavailable {
            vm: vm.to_string(),
            message,
        });
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    fn exited(code: i32) -> ExitStatus {
        ExitStatus::from_raw(code << 8)
    }

    #[test]
    fn classify_tells_exit_2_messages_apart() {
        let e = classify("stop", "mb-x", exited(2), "VM \"mb-x\" is not running\n");
        assert!(matches!(e, TartError::VmNotRunning { .. }), "{e}");
        let e = classify(
            "delete",
            "mb-x",
            exited(2),
            "the specified VM \"mb-x\" does not exist\n",
        );
        assert!(e.is_vm_missing(), "{e}");
        let e = classify("run", "mb-x", exited(2), "VM \"mb-x\" is already running!\n");
        assert!(matches!(e, TartError::VmAlreadyRunning { .. }), "{e}");
        let e = classify("delete", "mb-x", exited(1), "VM \"mb-x\" is running\n");
        assert!(matches!(e, TartError::VmRunning { .. }), "{e}");
        let e = classify(
            "run",
            "mb-x",
            exited(1),
            "Error: the specified VM \"mb-x\" does not exist\n",
        );
        assert!(e.is_vm_missing(), "{e}");
        let e = classify(
            "clone",
            "a/b",
            exited(64),
            "Error: <new-name> should be a local name\nUsage: …",
        );
        assert!(matches!(e, TartError::Usage { .. }), "{e}");
        let e = classify("delete", "mb-x", exited(1), "Error: disk full\n");
        assert!(matches!(e, TartError::Failed { code: 1, .. }), "{e}");
        let e = classify("list", "", ExitStatus::from_raw(9), "");
        assert!(matches!(e, TartError::Killed { signal: 9, .. }), "{e}");
    }

    #[test]
    fn exec_refusals_need_the_exact_line() {
        assert!(exec_refusal("mb-x", 2, "VM \"mb-x\" is not running\n").is_some());
        assert!(exec_refusal("mb-x", 2, "grep: no such file\n").is_none());
        assert!(exec_refusal("mb-x", 2, "VM \"mb-y\" is not running\n").is_none());
        let e = exec_refusal(
            "mb-x",
            1,
            "Failed to connect to the VM using its control socket: x, is the Tart Guest Agent running?",
        );
        assert!(matches!(e, Some(TartError::GuestAgentUnavailable { .. })));
    }

    #[test]
    fn argv_for_log_is_capped_with_the_size_of_the_whole() {
        assert_eq!(argv_for_log(&["sh", "-c", "echo hi"]), r#"["sh", "-c", "echo hi"]"#);
        let huge = vec!["sh".to_string(), "-c".to_string(), "x".repeat(3 << 20)];
        let line = argv_for_log(&huge);
        assert!(line.len() <= ARGV_LOG_MAX + 64, "{} bytes", line.len());
        assert!(line.starts_with(r#"["sh", "-c", "xxx"#), "{line}");
        assert!(
            line.ends_with(&format!("…] (3 arguments, {} bytes in all)", 4 + (3 << 20))),
            "{line}"
        );
    }

    #[test]
    fn log_sink_caps_the_file_and_keeps_the_tail() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let mut sink = LogSink::open(&path, 10, 4).unwrap();
        sink.write(b"0123456", false);
        sink.write(b"789abcdef", true);
        sink.flush();
        let file = std::fs::read_to_string(&path).unwrap();
        assert!(file.starts_with("0123456789\n[tartan: log cap of 10 bytes"), "{file}");
        assert!(!file.contains("abc") && file.ends_with("not logged]\n"), "{file}");
        assert_eq!(sink.tail(), "cdef");
        assert_eq!(sink.total, 16);
        assert!(sink.truncated);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode & 0o007, 0, "an exec log is not world-readable: {mode:o}");
    }

    #[test]
    fn a_memory_sink_keeps_the_output_and_tells_only_stderr() {
        let mut sink = LogSink::memory(10);
        sink.write(b"secret-0", false);
        sink.write(b"9abcdef", true);
        sink.note("[note]");
        sink.flush();
        assert_eq!(sink.tail(), "9abcdef", "the tail is stderr's, never stdout's");
        assert_eq!((sink.total, sink.truncated), (15, true));
        assert_eq!(sink.into_memory(), b"secret-09a", "the first 10 bytes, no note");
    }
}
