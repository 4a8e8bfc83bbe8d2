//! The tart CLI contract for Tartan (docs/tart-contract.md):
//!
//! * [`Tart`]: an async driver with one method per tart command, each bounded by a timeout that kills the child;
//!   errors are typed from tart's exit codes and messages ([`TartError`]).
//! * Process discovery: [`run_pid`] (`F_GETLK` on `vms/<name>/config.json`, never taking the lock),
//!   [`client_pids`] and [`kill_vm_processes`], shared by the agent's recovery and the watchdog.
//!
//! The test double, `tart-double` (a faithful stand-in for tart on Linux, with fault injection), is a crate of
//! its own (`tart-double/`), as are the contract tests run against it or against real tart.
//!
//! What outlives what (`tart run` and the agent's process group, `tart exec` disconnects, guest processes and
//! their VM), with sources and what the double reproduces: `docs/tart-contract.md`.

pub mod discovery;
pub mod driver;
pub mod error;
pub mod lock;
pub mod run_args;
pub mod types;

pub use discovery::{
    ClientFilter, KillReport, client_pids, kill_vm_processes, process_alive, run_pid, tart_home, vm_config_path, vm_dir,
};
pub use driver::{
    ARGV_LOG_MAX, CaptureOptions, Captured, Consumed, ExecOptions, ExecOutcome, LOG_FILE_MODE, OutputConsumer, RunExit,
    RunOptions, RunningVm, SetOptions, Tart, Timeouts, argv_for_log, log_cap_note,
};
pub use error::TartError;
pub use lock::LockProbe;
pub use nix::unistd::Pid;
pub use run_args::{DirShare, Ipv4Cidr, Network as RunNetwork, run_args};
pub use types::{VmInfo, VmListEntry, VmState};
