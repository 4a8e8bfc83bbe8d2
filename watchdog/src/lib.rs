//! The watchdog: deletes VMs that are more than a grace period past their host execution deadline,
//! reading only the deadline files the agent writes before `tart clone` — never the journal, never
//! the agent's lock — so it works while the agent is paused, dead or busy.

pub mod plan;
pub mod record;
pub mod scan;
