//! The watchdog: deletes VMs that are more than a grace period past their host execution deadline,
//! reading only the deadline files the agent writes before `tart clone` — never the journal, never
//! the agent's lock — so it works while the agent is paused, dead or busy.
//!
//! - [`plan`]: pure decisions with `now` passed in (overdue set, next wake = min(deadline) + grace,
//!   capped backoff, folder diff).
//! - [`scan`] / [`deadline`]: the deadline folder (`<state>/deadlines/<vm>.json`, `tartan_api::deadline`).
//! - [`reap`]: one overdue VM: kill its tart processes, `tart stop`, `tart delete`, confirm the
//!   directory is gone, record the line, then remove the deadline file.
//! - [`mod@run`]: the loop (sleeps until the next due time, rescans the folder every second, runs a
//!   bounded number of jobs concurrently, retries failures with capped backoff).
//! - [`record`]: `<state>/watchdog.jsonl`, one synced JSON line per action, in the source's form:
//!   `{"time","vm","deadline","action","detail"}` with `action` one of `deleted`,
//!   `already-absent`, `delete-failed`, `deadline-file-remove-failed`, `bad-deadline-file`.
//!
//! `tartan-agent watchdog --state-dir DIR [--grace 60s] [--tart PATH]` runs [`run()`].

pub mod deadline;
pub mod plan;
pub mod reap;
pub mod record;
pub mod run;
pub mod scan;

pub use record::{Action, Line, RECORD_FILE, read_lines};
pub use run::{Config, DEFAULT_GRACE, Error, run, terminated};
pub use tartan_api::duration::{parse_duration, parse_std_duration};
