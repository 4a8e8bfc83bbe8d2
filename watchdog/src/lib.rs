//! The watchdog: deletes VMs that are more than a grace period past their host execution deadline,
//! reading only the deadline files the agent writes before `tart clone` — never the journal, never
//! the agent's lock — so it works while the agent is paused, dead or busy.

pub mod deadline;
pub mod duration;
pub mod plan;
pub mod reap;
pub mod record;
pub mod run;
pub mod scan;

pub use duration::{parse_duration, parse_std_duration};
pub use record::{Action, Line, RECORD_FILE, read_lines};
pub use run::{Config, DEFAULT_GRACE, Error, run, terminated};
