//! The one error type of this crate. Every variant names the tart command, the VM and what became of the child.

use std::path::PathBuf;
use std::time::Duration;

/// Why a tart call did not produce what was asked.
#[derive(Debug, thiserror::Error)]
pub enum TartError {
    /// tart exit 2 (exit 1 for `run`, whose lookup happens in `validate()`): `the specified VM "x" does not exist`.
    #[error("tart {command} {vm}: the VM does not exist ({message}); nothing was changed")]
    VmDoesNotExist {
        command: &'static str,
        vm: String,
        message: String,
    },

    /// tart exit 2: `VM "x" is not running`.
    #[error("tart {command} {vm}: the VM is not running ({message}); nothing was changed")]
    VmNotRunning {
        command: &'static str,
        vm: String,
        message: String,
    },

    /// tart exit 2: `VM "x" is already running!` (from `run`).
    #[error("tart {command} {vm}: the VM is already running ({message}); the new run exited, the old one is untouched")]
    VmAlreadyRunning {
        command: &'static str,
        vm: String,
        message: String,
    },

    /// tart exit 1: `VM "x" is running` — `delete` refused because a `tart run` holds the VM lock.
    #[error("tart {command} {vm}: refused because the VM is running ({message}); stop it or kill its `tart run` first")]
    VmRunning {
        command: &'static str,
        vm: String,
        message: String,
    },

    /// `tart exec` could not reach the guest agent (exit 1, `Failed to connect to the VM using its control
    /// socket: … is the Tart Guest Agent running?`): the guest is still booting, or the socket is stale.
    #[error("tart exec {vm}: the guest agent did not answer ({message}); the command did not run in the guest")]
    GuestAgentUnavailable { vm: String, message: String },

    /// tart exit 64 (`EX_USAGE`): tart rejected the arguments.
    #[error("tart {command} {vm}: tart rejected the arguments (exit 64): {stderr}")]
    Usage {
        command: &'static str,
        vm: String,
        stderr: String,
    },

    /// Any other non-zero exit of tart itself.
    #[error("tart {command} {vm} failed with exit code {code}: {stderr}")]
    Failed {
        command: &'static str,
        vm: String,
        code: i32,
        stderr: String,
    },

    /// The tart process was killed by a signal (by someone else: our own timeout kills are [`TartError::Timeout`]).
    #[error("tart {command} {vm} was killed by signal {signal}: {stderr}")]
    Killed {
        command: &'static str,
        vm: String,
        signal: i32,
        stderr: String,
    },

    /// The call did not finish in time. tart turns lock contention into a hang, so this is the usual face of a
    /// contended VM or home lock. The child process has been killed.
    #[error(
        "tart {command} {vm} did not finish within {after:?} (tart hangs on lock contention); the tart process was killed"
    )]
    Timeout {
        command: &'static str,
        vm: String,
        after: Duration,
    },

    /// `tart exec` did not finish in time; the `tart exec` process was killed. `tail` is the end of its output.
    #[error("tart exec {vm} did not finish within {after:?}; the tart exec process was killed (output tail: {tail:?})")]
    ExecTimeout { vm: String, after: Duration, tail: String },

    /// The tart program could not be started at all.
    #[error("could not start `{program} {command}` for {vm}: {source}; is tart installed and on the configured path?")]
    Spawn {
        command: &'static str,
        vm: String,
        program: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The operating system refused to start tart with these arguments (E2BIG): together with the
    /// environment they exceed its limit (`getconf ARG_MAX`).
    #[error(
        "could not start `{program} {command}` for {vm}: its {count} arguments, {bytes} bytes in all, are more than \
         the operating system accepts (Argument list too long); nothing ran — shorten the command or pass the data \
         through a file"
    )]
    ArgumentsTooLong {
        command: &'static str,
        vm: String,
        program: PathBuf,
        count: usize,
        bytes: usize,
    },

    /// An argument holds a NUL byte, which no program can be passed (C strings end at NUL).
    #[error(
        "could not start `{program} {command}` for {vm}: argument {index} contains a NUL byte, which no program can receive; nothing ran"
    )]
    ArgumentHasNul {
        command: &'static str,
        vm: String,
        program: PathBuf,
        /// 0-based, among the arguments after the tart command.
        index: usize,
    },

    /// tart exited 0 but printed something we cannot understand (e.g. not the JSON `--format json` promises).
    #[error("tart {command} {vm} printed unexpected output ({detail}); output was: {output:?}")]
    UnexpectedOutput {
        command: &'static str,
        vm: String,
        detail: String,
        output: String,
    },

    /// A file-system or process operation of this crate failed.
    #[error("{action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// Neither `TART_HOME` nor `HOME` is set, so tart's home folder cannot be located.
    #[error("cannot locate tart's home folder: TART_HOME and HOME are both unset; set TART_HOME")]
    NoHome,

    /// The VM lock is held but the kernel did not say by whom, so the `tart run` process cannot be found.
    #[error("VM lock on {path} is held by a process whose pid the kernel did not report; cannot signal it")]
    LockHolderUnknown { path: PathBuf },

    /// Processes of a VM were sent SIGKILL but some were still alive when the bounded wait ended.
    #[error("killed tart processes of {vm}, but pids {pids:?} were still alive after {after:?}; retry later")]
    ProcessesSurvived {
        vm: String,
        pids: Vec<i32>,
        after: Duration,
    },

    /// A `tart run` we spawned exited before it took the VM lock.
    #[error("tart run {vm} exited ({status}) before the VM was running: {detail}")]
    RunExitedEarly { vm: String, status: String, detail: String },
}

impl TartError {
    /// True for "the VM does not exist" (useful for idempotent deletes: already gone is success).
    pub fn is_vm_missing(&self) -> bool {
        matches!(self, TartError::VmDoesNotExist { .. })
    }

    /// True for "the VM is not running" (useful for idempotent stops).
    pub fn is_not_running(&self) -> bool {
        matches!(self, TartError::VmNotRunning { .. })
    }

    /// True for a `clone` that lost its temporary directory to another tart command's garbage
    /// collection before it locked it (tart creates `tmp/<uuid>` first and locks it after: see
    /// the double's module docs). Nothing was cloned; cloning again is safe.
    pub fn is_clone_tmp_race(&self) -> bool {
        let TartError::Failed {
            command: "clone",
            stderr,
            ..
        } = self
        else {
            return false;
        };
        // `failed to lock <home>/tmp/<entry>: <why>`: the entry's parent folder is tart's `tmp`.
        stderr.lines().any(|line| {
            line.split_once("failed to lock ")
                .and_then(|(_, rest)| rest.split_once(": "))
                .and_then(|(path, _)| std::path::Path::new(path).parent()?.file_name())
                .is_some_and(|dir| dir == "tmp")
        })
    }

    /// True when the call was abandoned by our own timeout.
    pub fn is_timeout(&self) -> bool {
        matches!(self, TartError::Timeout { .. } | TartError::ExecTimeout { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed(command: &'static str, stderr: &str) -> TartError {
        TartError::Failed {
            command,
            vm: "mb-x".into(),
            code: 1,
            stderr: stderr.into(),
        }
    }

    #[test]
    fn only_a_clone_that_lost_its_tmp_entry_is_a_race() {
        let lost = "Error: failed to lock /Users/ci/.tart/tmp/5B0C0E5A-1F0B: No such file or directory";
        assert!(failed("clone", lost).is_clone_tmp_race());
        // Another command, another lock, or a path that merely lives under /tmp are not.
        assert!(!failed("pull", lost).is_clone_tmp_race());
        assert!(!failed("clone", "failed to lock /tmp/home/vms/mb-x/config.json: Resource busy").is_clone_tmp_race());
        assert!(!failed("clone", "Error: disk full writing /tmp/x").is_clone_tmp_race());
    }
}
