//! Every end-to-end scenario in one test binary: one link instead of twenty, and one binary on
//! disk (each links the whole agent). `scripts/e2e` runs them one at a time by name.

mod abandon_process_group;
mod agent_hung;
mod agent_restart;
mod api_down_at_start;
mod cancel;
mod controller_restart;
mod env_secrets;
mod failover;
mod finalizer_outage;
mod frozen_cancel;
mod happy_path;
mod harness;
mod image_aware_claim;
mod image_local_vm;
mod journal_blip;
mod mac_sleep;
mod mounts_network;
mod old_journal_max_attempts;
mod partition;
mod quarantine;
mod reboot;
mod recovery_faults;
mod redelivery;
mod refused_past_deadline;
mod resume;
mod retiring_kept;
mod stale_writer;
mod step_logs;
mod step_timeout;
mod task_fault;
mod two_agents;
mod two_slots_killed;
mod watchdog;
mod watchdog_frozen;
