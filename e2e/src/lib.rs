//! Tartan's end-to-end harness: it starts and owns real processes (the Kubernetes API emulator or
//! a real cluster, `tartan-controller run`, `tartan-agent run`, `tartan-agent watchdog`, with
//! `tart-double` as tart), injects faults (signals, deny rules, failing deletes), reads the facts
//! (journal, watchdog record, cluster objects, VMs) and checks the invariants ([`invariants::TITLES`]) at the
//! end of every scenario.
//!
//! Every wait is on an observable fact with a bound, and every process started here is killed
//! (whole process group) when its owner is dropped, also on panic.

pub mod admission;
pub mod agentbench;
pub mod bins;
pub mod chaos;
pub mod cluster;
pub mod fleet;
pub mod invariants;
pub mod layering;
pub mod poolbench;
pub mod process;
pub mod promql;
pub mod repeat;
pub mod stack;
pub mod sweep;
pub mod wait;

pub use stack::{AgentOptions, ControllerOptions, KillMode, LEADER_LEASE, LeaderOptions, Stack};
pub use wait::{wait_for, wait_for_async};
