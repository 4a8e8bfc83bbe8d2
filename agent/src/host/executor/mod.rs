//! [`AttemptExecutor`]: performs the attempt machine's host actions for one attempt and turns
//! each result into the event the machine expects next.
//!
//! This file holds the executor's type, its configuration and [`AttemptExecutor::perform`], the
//! order of the phases: each action goes to the phase that owns it, open phases under
//! `cancel`'s guard. The phases live beside it:
//! - `cancel`: the withdrawal signal and the guard that interrupts an open phase at once;
//! - `boot`: deadline file (and the checks before any clone), clone, set, run, readiness;
//! - `env_file`: `spec.env` read from the Secrets and written into (and removed from) the guest;
//! - `steps`: the guest commands, each run (or re-attached) to its exit or its timeout;
//! - `collect`: the test report and the artifacts read from the guest;
//! - `retire`: stop and delete the VM (or confirm the watchdog did), retries, the deadline file;
//! - `shipping`: the step logs shipped to the artifact destination while the attempt runs.

use k8s_openapi::jiff::Timestamp;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tartan_api::deadline::{DEADLINES_DIR, deadline_file_name};
use tartan_api::{BuildResults, MacBuildSpec};
use tartan_tart::{RunningVm, Tart};

use super::artifacts::UploadPolicy;
use super::junit::TestCounts;
use super::log_shipper::{LogShipper, ShipSettings};
use crate::config::ArtifactsConfig;
use crate::machine::{Action, Event};
use crate::record::BuildRef;

mod boot;
mod cancel;
mod collect;
mod env_file;
mod retire;
mod shipping;
mod steps;

pub use cancel::{CancelHandle, CancelSignal, Withdrawal, cancel_pair};
pub use collect::{GUEST_READ_RATE, READ_GUEST_FILE, guest_read_failed, guest_read_limit};
pub use steps::{status_text, step_log_cap};

/// The attempt an executor works for (from the journal's `Admitted` record and the MacBuild).
#[derive(Clone, Debug)]
pub struct HostAttempt {
    pub build: BuildRef,
    /// 1-based attempt number.
    pub attempt: u32,
    pub vm: String,
    pub spec: MacBuildSpec,
    /// The host execution deadline: at it, whatever phase, the attempt fails with `DeadlinePassed`.
    /// Replaced by the deadline of the `WriteDeadlineFile` action when that runs (the admission
    /// fixes it), so an executor made before admission may pass a provisional one.
    pub deadline: Timestamp,
    /// The agent's name, written into the deadline file.
    pub agent: String,
}

/// Limits and places of the host side. Defaults suit a real Mac.
#[derive(Clone, Debug)]
pub struct ExecutorConfig {
    /// The agent's state directory: `deadlines/`, `logs/<vm>/`, `tmp/<vm>/` live under it.
    pub state_dir: PathBuf,
    /// From `tart run` until `tart exec NAME true` answers; then `VMStartFailed`.
    pub boot_timeout: Duration,
    /// Pause between readiness probes.
    pub probe_interval: Duration,
    /// Limit of one readiness probe (`tart exec` waits ~10 s for an absent guest agent).
    pub probe_timeout: Duration,
    /// `tart stop --timeout` (SIGINT, then SIGKILL after this).
    pub stop_timeout: Duration,
    /// Size cap of each step's log file.
    pub step_log_cap: u64,
    /// Size cap of all step logs of one attempt together (`[logs] max_build_mib`): a step gets
    /// what its predecessors left, at most `step_log_cap`.
    pub build_log_budget: u64,
    /// Bytes of each step's raw output kept in memory; a failing step's status gets its last
    /// lines from them, cleaned ([`tartan_api::text::last_lines`]). Larger than the status bound
    /// because terminal escapes take room and are dropped.
    pub tail_bytes: usize,
    /// Largest test report read from the guest.
    pub report_cap: u64,
    /// Largest artifact read from the guest.
    pub artifact_cap: u64,
    /// The least time a guest file (test report, artifact) is given to come out; each also gets
    /// one second per [`GUEST_READ_RATE`] bytes its cap allows ([`guest_read_limit`]).
    pub guest_read_floor: Duration,
    /// Guest directory (relative to the exec working directory) the source is checked out into.
    pub checkout_dir: String,
    /// Retries of each artifact upload.
    pub upload: UploadPolicy,
    /// The default destination (for a MacBuild that names none) and the S3 settings.
    pub artifacts: ArtifactsConfig,
    /// Local VM names a MacBuild may clone (the agent config's `local_images`).
    pub local_images: Vec<String>,
    /// Start `tart run` in a session of its own so the VM outlives the agent
    /// (`on_restart = "resume"`); otherwise it stays in the agent's process group and dies with it.
    pub detach_vm: bool,
    /// How often a running step's guest job is polled (`timing.step_poll`).
    pub step_poll: Duration,
    /// How long a step's guest folder may lack its job's pid before the start counts as cut
    /// short before the launch ([`super::guest_job::FollowConfig::no_pid_limit`]).
    pub step_no_pid_limit: Duration,
    /// Shipping of the step logs to the artifact destination while the attempt runs.
    pub log_ship: ShipSettings,
    /// Host folders a MacBuild may mount (the agent config's `[[mounts]]`).
    pub mounts: Vec<crate::config::MountConfig>,
    /// The VMs' network (the agent config's `network` and `softnet_allow`).
    pub network: tartan_tart::RunNetwork,
    /// The Secrets a MacBuild's `spec.env` may name and how to read them; `None`: none.
    pub secrets: Option<super::env::SecretAccess>,
}

impl ExecutorConfig {
    pub fn new(state_dir: impl Into<PathBuf>) -> Self {
        ExecutorConfig {
            state_dir: state_dir.into(),
            boot_timeout: Duration::from_secs(180),
            probe_interval: Duration::from_millis(500),
            probe_timeout: Duration::from_secs(30),
            stop_timeout: Duration::from_secs(10),
            step_log_cap: 64 << 20,
            build_log_budget: crate::config::DEFAULT_BUILD_LOG_BYTES,
            tail_bytes: 16 << 10,
            report_cap: 32 << 20,
            artifact_cap: 16 << 30,
            guest_read_floor: Duration::from_secs(60),
            checkout_dir: "src".to_string(),
            upload: UploadPolicy::default(),
            artifacts: ArtifactsConfig::default(),
            local_images: Vec::new(),
            detach_vm: false,
            step_poll: Duration::from_secs(1),
            step_no_pid_limit: super::guest_job::FollowConfig::default().no_pid_limit,
            log_ship: ShipSettings::default(),
            mounts: Vec::new(),
            network: tartan_tart::RunNetwork::Shared,
            secrets: None,
        }
    }
}

/// What [`AttemptExecutor::perform`] did with one action.
#[derive(Clone, Debug, PartialEq)]
pub enum Performed {
    /// Done; go on with the transition's next action.
    Done,
    /// The action ended in this event: journal it (through the machine) and drop the
    /// transition's remaining actions.
    Event(Event),
    /// Not a host action (claim, slot, status, finalizer, next attempt): the runtime's to do.
    NotHost,
}

/// Performs the host actions of one attempt. Every tart call has a timeout, a cancellation or
/// the deadline interrupts any action of an open phase at once (the in-flight tart child is
/// SIGKILLed, `tart run` too), and nothing is done that its transition did not ask for, so
/// with "journal, then [`perform`](Self::perform)" no side effect precedes its record.
pub struct AttemptExecutor {
    attempt: HostAttempt,
    tart: Tart,
    cfg: ExecutorConfig,
    cancel: CancelSignal,
    run: Option<RunningVm>,
    boot_started: Option<Instant>,
    refused_existing: bool,
    /// Whether this executor's clone of the VM completed: only a VM that existed can have been
    /// deleted by the watchdog (a clone hanging until the deadline never made one).
    vm_created: bool,
    counts: Option<TestCounts>,
    report_error: Option<String>,
    artifact_url: Option<String>,
    last_step: Option<(String, String)>,
    interrupt_latency: Option<Duration>,
    /// Ships the step logs while the attempt runs (see [`Self::ensure_log_shipping`]).
    log_shipper: Option<LogShipper>,
    /// Where the step logs go, once shipping started (kept after it finished).
    logs_location: Option<String>,
    /// Whether shipping was decided on (started, or found impossible), so it is started once.
    log_shipping_decided: bool,
    /// `spec.env` with the Secret values, read once per executor (at admission, or at the first
    /// step of an executor that took the attempt over). Held in memory only.
    env: Option<super::env::ResolvedEnv>,
    /// Whether this executor wrote the env file into the guest.
    env_written: bool,
}

impl AttemptExecutor {
    pub fn new(attempt: HostAttempt, tart: Tart, cfg: ExecutorConfig, cancel: CancelSignal) -> Self {
        AttemptExecutor {
            attempt,
            tart,
            cfg,
            cancel,
            run: None,
            boot_started: None,
            refused_existing: false,
            vm_created: false,
            counts: None,
            report_error: None,
            artifact_url: None,
            last_step: None,
            interrupt_latency: None,
            log_shipper: None,
            logs_location: None,
            log_shipping_decided: false,
            env: None,
            env_written: false,
        }
    }

    /// Where the step logs are shipped (`status.logs`), once shipping started.
    pub fn logs_location(&self) -> Option<String> {
        self.logs_location.clone()
    }

    pub fn attempt(&self) -> &HostAttempt {
        &self.attempt
    }

    /// Tells an executor made for an attempt found past its clone (at recovery, after a task
    /// fault, or resumed) that the VM was created, so a VM gone at the deadline is known to be
    /// the watchdog's doing.
    pub fn vm_was_created(&mut self) {
        self.vm_created = true;
    }

    /// Test counts and artifact location gathered so far (for the status snapshot).
    pub fn results(&self) -> BuildResults {
        BuildResults {
            tests_passed: self.counts.map(|c| c.passed()),
            tests_total: self.counts.map(|c| c.total),
            artifact_url: self.artifact_url.clone(),
        }
    }

    /// Why the test report could not be counted (the attempt then failed with `TestReportUnusable`).
    pub fn report_error(&self) -> Option<&str> {
        self.report_error.as_deref()
    }

    /// The last step run and the tail of its output (for a failed step: its cleaned last lines, or
    /// the error that kept it from running).
    pub fn last_step(&self) -> Option<(&str, &str)> {
        self.last_step.as_ref().map(|(s, t)| (s.as_str(), t.as_str()))
    }

    /// How long the last cancellation took from [`CancelHandle::cancel`] until the in-flight
    /// work was stopped and the tart children killed.
    pub fn interrupt_latency(&self) -> Option<Duration> {
        self.interrupt_latency
    }

    /// `<state>/deadlines/<vm>.json`.
    /// The deadline the executor enforces (the admission's, once its deadline file is written).
    pub fn deadline(&self) -> Timestamp {
        self.attempt.deadline
    }

    pub fn deadline_file(&self) -> PathBuf {
        self.deadlines_dir().join(deadline_file_name(&self.attempt.vm))
    }

    fn deadlines_dir(&self) -> PathBuf {
        self.cfg.state_dir.join(DEADLINES_DIR)
    }

    fn tmp_dir(&self) -> PathBuf {
        self.cfg.state_dir.join("tmp").join(&self.attempt.vm)
    }

    /// The exec limit of a guest command: until the deadline (which interrupts first) plus a
    /// margin, so that even a missed interrupt cannot leave `tart exec` running for ever.
    fn exec_timeout(&self) -> Duration {
        let left = Timestamp::now().duration_until(self.attempt.deadline);
        Duration::try_from(left).unwrap_or_default() + Duration::from_secs(30)
    }

    /// Performs one action of a journaled transition.
    pub async fn perform(&mut self, action: &Action) -> Performed {
        let vm = self.attempt.vm.clone();
        if let Some(target) = action_vm(action)
            && target != vm
        {
            tracing::error!(%vm, %target, ?action, "action names another VM; refusing it");
            return Performed::NotHost;
        }
        match action {
            Action::StopAndDeleteVm { .. } | Action::ConfirmVmGone { .. } | Action::RetryDeleteLater { .. } => {}
            _ => self.ensure_log_shipping(),
        }
        match action {
            Action::WriteDeadlineFile { deadline, .. } => {
                // The admission fixed the deadline; from here on it is the one enforced.
                let deadline = *deadline;
                self.attempt.deadline = deadline;
                self.guarded(|s| Box::pin(s.write_deadline(deadline))).await
            }
            Action::CloneVm { .. } => self.guarded(|s| Box::pin(s.clone_vm())).await,
            Action::SetVm { .. } => self.guarded(|s| Box::pin(s.set_vm())).await,
            Action::StartVm { .. } => self.guarded(|s| Box::pin(s.start_vm())).await,
            Action::ProbeReady { .. } => self.guarded(|s| Box::pin(s.probe_ready())).await,
            Action::ProbeAdopted { .. } => self.guarded(|s| Box::pin(s.probe_adopted())).await,
            Action::RunStep { index, since, .. } => {
                let (index, since) = (*index, *since);
                self.guarded(move |s| Box::pin(s.run_step(index, since))).await
            }
            Action::CollectResults { .. } => self.guarded(|s| Box::pin(s.collect_results())).await,
            Action::UploadArtifacts { .. } => self.guarded(|s| Box::pin(s.upload_artifacts())).await,
            // The step logs are complete once the steps stopped: their end overlaps the VM's
            // deletion and is waited for (bounded) before the deletion is reported, so the
            // build turns terminal with its logs shipped.
            Action::StopAndDeleteVm { context, .. } => {
                let since = self.begin_log_shipping_end();
                self.remove_scratch_files();
                let done = self.stop_and_delete_vm(*context).await;
                self.end_log_shipping(since).await;
                done
            }
            Action::ConfirmVmGone { .. } => {
                let since = self.begin_log_shipping_end();
                self.remove_scratch_files();
                let done = self.confirm_gone().await;
                self.end_log_shipping(since).await;
                done
            }
            Action::RetryDeleteLater { after, .. } => {
                // A restarted agent resolving a quarantine still owes the logs their end.
                let since = self.begin_log_shipping_end();
                self.end_log_shipping(since).await;
                self.retry_delete_later(*after).await
            }
            Action::RemoveDeadlineFile { .. } => self.remove_vm_deadline_file().await,
            Action::ClaimBuild { .. }
            | Action::ReleaseSlot { .. }
            | Action::DeliverStatus
            | Action::RemoveFinalizer
            | Action::AdmitNextAttempt { .. } => Performed::NotHost,
        }
    }
}

fn action_vm(action: &Action) -> Option<&str> {
    match action {
        Action::WriteDeadlineFile { vm, .. }
        | Action::CloneVm { vm }
        | Action::SetVm { vm }
        | Action::StartVm { vm }
        | Action::ProbeReady { vm }
        | Action::ProbeAdopted { vm }
        | Action::RunStep { vm, .. }
        | Action::CollectResults { vm }
        | Action::UploadArtifacts { vm }
        | Action::StopAndDeleteVm { vm, .. }
        | Action::ConfirmVmGone { vm }
        | Action::RetryDeleteLater { vm, .. }
        | Action::RemoveDeadlineFile { vm } => Some(vm),
        _ => None,
    }
}
