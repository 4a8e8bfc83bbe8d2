//! [`AttemptExecutor`]: performs the attempt machine's host actions for one attempt and turns
//! each result into the event the machine expects next.

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tartan_api::deadline::{
    DEADLINES_DIR, DeadlineFile, deadline_file_name, remove_deadline_file, write_deadline_file,
};
use tartan_api::text::{TAIL_BYTES, TAIL_LINES, clean_str, last_lines};
use tartan_api::{BuildResults, MacBuildSpec};
use tartan_tart::{ExecOptions, RunOptions, RunningVm, SetOptions, Tart, TartError};
use tokio::sync::watch;

use super::artifacts::{
    Destination, DestinationPolicy, DestinationRefused, UploadPolicy, allowed_destination, artifact_key, upload,
};
use super::junit::{TestCounts, parse_report};
use super::log_shipper::{LogShipper, ShipSettings};
use super::steps::{GuestCommand, checkout_commands, log_dir, step_log};
use crate::config::ArtifactsConfig;
use crate::machine::{Action, DeleteContext, Deleted, Event};
use crate::record::BuildRef;

/// Why the build is being withdrawn (the reason the machine records).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Withdrawal {
    /// The MacBuild asked for cancellation (or is being deleted).
    CancelRequested,
    /// The MacBuild's owner (the CustomRun) was deleted.
    OwnerDeleted,
}

type Signal = Option<(Withdrawal, Instant)>;

/// The runtime's side of the cancellation signal: [`CancelHandle::cancel`] stops the attempt in
/// whatever phase it is, at once.
#[derive(Debug)]
pub struct CancelHandle(watch::Sender<Signal>);

/// The executor's side of the cancellation signal.
#[derive(Clone, Debug)]
pub struct CancelSignal(watch::Receiver<Signal>);

/// A connected pair of cancellation handle and signal.
pub fn cancel_pair() -> (CancelHandle, CancelSignal) {
    let (tx, rx) = watch::channel(None);
    (CancelHandle(tx), CancelSignal(rx))
}

impl CancelHandle {
    /// Withdraws the build. The first call wins; later ones change nothing.
    pub fn cancel(&self, why: Withdrawal) {
        self.0.send_if_modified(|v| {
            if v.is_some() {
                return false;
            }
            *v = Some((why, Instant::now()));
            true
        });
    }
}

impl CancelSignal {
    /// The withdrawal, if one was signalled.
    pub fn current(&self) -> Option<Withdrawal> {
        self.0.borrow().map(|(w, _)| w)
    }

    /// Resolves once a withdrawal is signalled (never, if the handle was dropped without one).
    async fn wait(&mut self) -> (Withdrawal, Instant) {
        let signalled = self.0.wait_for(Option::is_some).await.map(|v| *v);
        match signalled {
            Ok(Some(v)) => v,
            // The handle is gone without a withdrawal: none will come.
            Ok(None) | Err(_) => std::future::pending().await,
        }
    }
}

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
    /// Bytes of each step's raw output kept in memory; a failing step's status gets its last
    /// lines from them, cleaned ([`tartan_api::text::last_lines`]). Larger than the status bound
    /// because terminal escapes take room and are dropped.
    pub tail_bytes: usize,
    /// Largest test report read from the guest.
    pub report_cap: u64,
    /// Largest artifact read from the guest.
    pub artifact_cap: u64,
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
            tail_bytes: 16 << 10,
            report_cap: 32 << 20,
            artifact_cap: 16 << 30,
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

/// How often a clone that lost its temporary directory to tart's garbage collection is tried
/// again within the attempt.
const CLONE_TMP_RACE_RETRIES: u32 = 3;

enum Interrupt {
    Withdrawn(Withdrawal, Instant),
    Deadline,
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

    /// Starts shipping the step logs unless that was decided already: to the build's artifact
    /// destination (`spec.artifacts.destination`, else the agent config's), if the policy allows
    /// it. With no destination at all nothing is shipped; a refused one is the artifacts'
    /// business (it fails the build at admission) and ships nothing either.
    fn ensure_log_shipping(&mut self) {
        if self.log_shipping_decided {
            return;
        }
        self.log_shipping_decided = true;
        // A build gone from the cluster is only retired (its spec is a stand-in without steps).
        if self.attempt.spec.steps.is_empty() {
            return;
        }
        let named = self
            .attempt
            .spec
            .artifacts
            .as_ref()
            .map_or("", |a| a.destination.as_str());
        let home = self.tart.home().ok();
        let policy = DestinationPolicy::new(&self.cfg.artifacts, &self.cfg.state_dir, home.as_deref());
        let vm = self.attempt.vm.clone();
        match allowed_destination(named, &policy) {
            Ok(dest) => {
                let shipper = LogShipper::start(
                    &vm,
                    log_dir(&self.cfg.state_dir, &vm),
                    dest,
                    self.cfg.log_ship.clone(),
                    &self.cfg.artifacts,
                );
                self.logs_location = Some(shipper.location().to_string());
                self.log_shipper = Some(shipper);
            }
            Err(DestinationRefused::NoDestination) => {
                tracing::info!(%vm, "no artifact destination: the step logs stay on this host only");
            }
            Err(refused) => {
                tracing::warn!(%vm, %refused, "the step logs are not shipped; they stay on this host only");
            }
        }
    }

    /// Asks the shipper (if any) to ship its last bytes and the whole logs; [`Self::end_log_shipping`]
    /// waits for it. Called as the retirement starts, so it overlaps the VM's stop and deletion.
    fn begin_log_shipping_end(&mut self) -> Instant {
        self.ensure_log_shipping();
        if let Some(s) = &self.log_shipper {
            s.begin_finish();
        }
        Instant::now()
    }

    /// Waits (bounded by [`ShipSettings::finish_limit`] since `since`) for the shipper's end.
    async fn end_log_shipping(&mut self, since: Instant) {
        if let Some(s) = self.log_shipper.take() {
            s.finish(since, self.cfg.log_ship.finish_limit).await;
        }
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
    pub fn deadline_file(&self) -> PathBuf {
        self.deadlines_dir().join(deadline_file_name(&self.attempt.vm))
    }

    fn deadlines_dir(&self) -> PathBuf {
        self.cfg.state_dir.join(DEADLINES_DIR)
    }

    fn tmp_dir(&self) -> PathBuf {
        self.cfg.state_dir.join("tmp").join(&self.attempt.vm)
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
                let done = self.stop_and_delete_vm(*context).await;
                self.end_log_shipping(since).await;
                done
            }
            Action::ConfirmVmGone { .. } => {
                let since = self.begin_log_shipping_end();
                let done = self.confirm_gone().await;
                self.end_log_shipping(since).await;
                done
            }
            Action::RetryDeleteLater { after, .. } => {
                // A restarted agent resolving a quarantine still owes the logs their end.
                let since = self.begin_log_shipping_end();
                self.end_log_shipping(since).await;
                // From 1 s, doubling up to `after`: a transient failure (or one an agent restart
                // finds already lifted) frees the slot soon; a lasting one is not hammered.
                let after = Duration::try_from(*after).unwrap_or(Duration::from_secs(30));
                let mut wait = after.min(Duration::from_secs(1));
                loop {
                    tokio::time::sleep(wait).await;
                    match self.retry_delete().await {
                        Ok(_) => return Performed::Event(Event::VmDeleted { how: Deleted::OnRetry }),
                        Err(error) => {
                            wait = (wait * 2).min(after);
                            tracing::warn!(%vm, %error, retry_in = ?wait, "quarantined VM still not deleted; retrying")
                        }
                    }
                }
            }
            Action::RemoveDeadlineFile { .. } => {
                let dir = self.deadlines_dir();
                let v = vm.clone();
                crate::crash_point!("deadline_file.remove.before");
                let removed = tokio::task::spawn_blocking(move || remove_deadline_file(&dir, &v)).await;
                crate::crash_point!("deadline_file.remove.after");
                match removed {
                    Ok(Ok(_)) => {}
                    Ok(Err(error)) => tracing::warn!(%vm, %error, "deadline file not removed"),
                    Err(error) => tracing::warn!(%vm, %error, "deadline file removal task failed"),
                }
                Performed::Done
            }
            Action::ClaimBuild { .. }
            | Action::ReleaseSlot { .. }
            | Action::DeliverStatus
            | Action::RemoveFinalizer
            | Action::AdmitNextAttempt { .. } => Performed::NotHost,
        }
    }

    /// Runs `work` unless a withdrawal or the deadline comes first; if one does, the work is
    /// dropped (its tart child is SIGKILLed by `kill_on_drop`) and every tart process of the VM
    /// is killed before the matching event is returned.
    async fn guarded<F>(&mut self, work: F) -> Performed
    where
        F: for<'a> FnOnce(&'a mut Self) -> std::pin::Pin<Box<dyn std::future::Future<Output = Performed> + Send + 'a>>,
    {
        let mut cancel = self.cancel.clone();
        let deadline = self.attempt.deadline;
        let signalled = *cancel.0.borrow();
        // Whichever was seen first is the reason. A withdrawal seen only after the deadline (an
        // agent paused or slow past it) gives way to the deadline: the time was up first, and the
        // watchdog may have deleted the VM since, which is then what it says. One seen before the
        // deadline but acted on only after it (a slow journal sync in between) is still the reason.
        let past_deadline = || Timestamp::now() >= deadline;
        let interrupt = if let Some((w, at)) = signalled
            && seen_before(at.elapsed(), Timestamp::now(), deadline)
        {
            Some(Interrupt::Withdrawn(w, at))
        } else if past_deadline() {
            Some(Interrupt::Deadline)
        } else if let Some((w, at)) = signalled {
            Some(Interrupt::Withdrawn(w, at))
        } else {
            tokio::select! {
                biased;
                (w, at) = cancel.wait() => Some(if past_deadline() {
                    Interrupt::Deadline
                } else {
                    Interrupt::Withdrawn(w, at)
                }),
                () = until(deadline) => Some(Interrupt::Deadline),
                done = work(self) => return done,
            }
        };
        let Some(interrupt) = interrupt else {
            return Performed::Done;
        };
        let killed = self.kill_children().await;
        let vm = &self.attempt.vm;
        match interrupt {
            Interrupt::Withdrawn(why, at) => {
                let took = at.elapsed();
                self.interrupt_latency = Some(took);
                tracing::info!(%vm, ?why, killed, took = ?took, "build withdrawn; tart children killed");
                Performed::Event(match why {
                    Withdrawal::CancelRequested => Event::CancelRequested { at_start: None },
                    Withdrawal::OwnerDeleted => Event::OwnerDeleted { at_start: None },
                })
            }
            // Only the watchdog deletes a VM of ours behind our back, and only after the
            // deadline: a VM already gone here was removed by it (the agent was paused or slow).
            Interrupt::Deadline if self.vm_created && self.check_gone().is_ok() => {
                tracing::warn!(%vm, deadline = %self.attempt.deadline, killed, "host execution deadline passed and the watchdog already deleted the VM");
                Performed::Event(Event::WatchdogRemovedVm)
            }
            Interrupt::Deadline => {
                tracing::warn!(%vm, deadline = %self.attempt.deadline, killed, "host execution deadline passed; tart children killed");
                Performed::Event(Event::DeadlinePassed { at_start: None })
            }
        }
    }

    /// SIGKILLs our `tart run` and every other tart process of the VM; returns how many died.
    async fn kill_children(&mut self) -> usize {
        let vm = self.attempt.vm.clone();
        let mut killed = 0;
        if let Some(run) = self.run.as_mut() {
            match run.try_wait() {
                Ok(None) => match run.kill().await {
                    Ok(_) => killed += 1,
                    Err(error) => tracing::warn!(%vm, %error, "could not kill tart run"),
                },
                Ok(Some(_)) => {}
                Err(error) => tracing::warn!(%vm, %error, "could not poll tart run"),
            }
        }
        self.run = None;
        match self.tart.kill_vm_processes(&vm).await {
            Ok(report) => killed += report.count(),
            Err(error) => tracing::warn!(%vm, %error, "could not kill every tart process; stop and delete go on"),
        }
        killed
    }

    fn fail_start(&self, error: String) -> Performed {
        tracing::warn!(vm = %self.attempt.vm, %error, "VM start failed");
        Performed::Event(Event::VmStartFailed { error })
    }

    /// Where the artifacts go, if the spec publishes any and the agent config allows it there.
    fn artifact_destination(&self) -> Option<Result<Destination, DestinationRefused>> {
        let named = &self.attempt.spec.artifacts.as_ref()?.destination;
        let home = self.tart.home().ok();
        let policy = DestinationPolicy::new(&self.cfg.artifacts, &self.cfg.state_dir, home.as_deref());
        Some(allowed_destination(named, &policy))
    }

    async fn write_deadline(&mut self, deadline: Timestamp) -> Performed {
        // An image or destination the agent will refuse fails the build now, before any VM exists.
        if let Err(refused) = tartan_api::names::check_image(&self.attempt.spec.image, &self.cfg.local_images) {
            return self.fail_start(format!("image refused: {refused}; nothing was cloned"));
        }
        if let Some(Err(refused)) = self.artifact_destination() {
            return self.fail_start(format!("{refused}; nothing was cloned"));
        }
        match super::mounts::shares_for(&self.attempt.spec.mounts, &self.cfg.mounts) {
            Ok(_) => {}
            Err(super::mounts::MountRefused::NotDeclared(e)) => {
                tracing::warn!(vm = %self.attempt.vm, error = %e, "mount refused; nothing is cloned");
                return Performed::Event(Event::MountRefused {
                    error: format!("{e}; nothing was cloned"),
                });
            }
            Err(super::mounts::MountRefused::Unusable(e)) => {
                return self.fail_start(format!("{e}; nothing was cloned"));
            }
        }
        if let Err(refused) = self.ensure_env().await {
            return refused;
        }
        let a = &self.attempt;
        let file = DeadlineFile {
            vm: a.vm.clone(),
            namespace: a.build.namespace.clone(),
            name: a.build.name.clone(),
            uid: a.build.uid.clone(),
            attempt: a.attempt,
            deadline,
            agent: a.agent.clone(),
            written_at: Timestamp::now(),
        };
        let dir = self.deadlines_dir();
        crate::crash_point!("deadline_file.write.before");
        let written = tokio::task::spawn_blocking(move || write_deadline_file(&dir, &file)).await;
        crate::crash_point!("deadline_file.write.after");
        match written {
            Ok(Ok(_)) => Performed::Done,
            Ok(Err(e)) => self.fail_start(format!("{e}; nothing was cloned")),
            Err(e) => self.fail_start(format!("deadline file task failed: {e}; nothing was cloned")),
        }
    }

    async fn clone_vm(&mut self) -> Performed {
        let vm = self.attempt.vm.clone();
        let image = self.attempt.spec.image.clone();
        if !self.deadline_file().is_file() {
            return self.fail_start(format!(
                "no deadline file at {}; refusing to clone {vm} without one (the watchdog could not find it)",
                self.deadline_file().display()
            ));
        }
        let dir = match self.tart.vm_dir(&vm) {
            Ok(d) => d,
            Err(e) => return self.fail_start(e.to_string()),
        };
        if std::fs::symlink_metadata(&dir).is_ok() {
            self.refused_existing = true;
            return self.fail_start(format!(
                "{} already exists before the clone; refusing to clone {image} over it (tart overwrites silently) \
                 and leaving it for an operator",
                dir.display()
            ));
        }
        let started = Instant::now();
        let mut pause = Duration::from_millis(250);
        for race in 0..=CLONE_TMP_RACE_RETRIES {
            crate::crash_point!("tart.clone.before");
            let cloned = self.tart.clone_vm(&image, &vm).await;
            crate::crash_point!("tart.clone.after");
            match cloned {
                Ok(()) => {
                    tracing::info!(%vm, %image, took = ?started.elapsed(), "cloned");
                    self.vm_created = true;
                    return Performed::Done;
                }
                // Another tart command collected the clone's temporary directory: nothing was
                // made (the VM folder is checked), so it is cloned again within this attempt.
                Err(e)
                    if e.is_clone_tmp_race()
                        && race < CLONE_TMP_RACE_RETRIES
                        && std::fs::symlink_metadata(&dir).is_err() =>
                {
                    tracing::warn!(%vm, %image, error = %e, retry_in = ?pause, "clone lost its temporary directory to tart's garbage collection; cloning again");
                    tokio::time::sleep(pause).await;
                    pause *= 2;
                }
                Err(e) => return self.fail_start(e.to_string()),
            }
        }
        unreachable!("the last try returns")
    }

    async fn set_vm(&mut self) -> Performed {
        let res = self.attempt.spec.resources.clone().unwrap_or_default();
        let options = SetOptions {
            cpu: res.cpu,
            memory_mb: res.memory_mib.map(u64::from),
            random_mac: true,
        };
        crate::crash_point!("tart.set.before");
        let set = self.tart.set(&self.attempt.vm, &options).await;
        crate::crash_point!("tart.set.after");
        match set {
            Ok(()) => Performed::Done,
            Err(e) => self.fail_start(e.to_string()),
        }
    }

    async fn start_vm(&mut self) -> Performed {
        let vm = self.attempt.vm.clone();
        let logs = log_dir(&self.cfg.state_dir, &vm);
        if let Err(e) = std::fs::create_dir_all(&logs) {
            return self.fail_start(format!(
                "creating log folder {}: {e}; tart run not started",
                logs.display()
            ));
        }
        // Checked at the admission; checked again, as the folders may have gone since.
        let extra_args = match super::mounts::shares_for(&self.attempt.spec.mounts, &self.cfg.mounts)
            .map_err(|e| e.to_string())
            .and_then(|shares| tartan_tart::run_args(&shares, &self.cfg.network))
        {
            Ok(args) => args,
            Err(e) => return self.fail_start(format!("{e}; tart run not started")),
        };
        let options = RunOptions {
            log_path: Some(logs.join("_tart-run.log")),
            extra_args,
            detached: self.cfg.detach_vm,
        };
        self.boot_started = Some(Instant::now());
        crate::crash_point!("tart.run.before");
        match self.tart.run(&vm, &options) {
            Ok(run) => self.run = Some(run),
            Err(e) => return self.fail_start(e.to_string()),
        }
        crate::crash_point!("tart.run.after");
        let timeout = self.cfg.boot_timeout;
        let run = self.run.as_mut().expect("just set");
        match run.wait_until_running(timeout).await {
            Ok(()) => Performed::Done,
            Err(e) => self.fail_start(e.to_string()),
        }
    }

    async fn probe_ready(&mut self) -> Performed {
        let vm = self.attempt.vm.clone();
        let started = *self.boot_started.get_or_insert_with(Instant::now);
        let limit = started + self.cfg.boot_timeout;
        let log = step_log(&self.cfg.state_dir, &vm, "_probe");
        let mut last = String::from("no probe finished");
        loop {
            if let Some(run) = self.run.as_mut()
                && let Ok(Some(exit)) = run.try_wait()
            {
                self.run = None;
                return self.fail_start(format!(
                    "tart run {vm} exited ({exit}) before the guest answered tart exec"
                ));
            }
            let now = Instant::now();
            if now >= limit {
                return self.fail_start(format!(
                    "the guest did not answer tart exec {vm} true within {:?} of tart run (last: {last})",
                    self.cfg.boot_timeout
                ));
            }
            let mut options = ExecOptions::new(&log, self.cfg.probe_timeout.min(limit - now));
            options.log_cap = 64 << 10;
            options.tail_bytes = 1024;
            match self.tart.exec(&vm, &["true".to_string()], &options).await {
                Ok(out) if out.exit_code == 0 => {
                    let after = started.elapsed();
                    tracing::info!(%vm, ?after, "guest ready");
                    return Performed::Event(Event::GuestReady {
                        after: after.try_into().unwrap_or_default(),
                    });
                }
                Ok(out) => last = format!("`true` exited {} in the guest: {}", out.exit_code, out.tail.trim()),
                Err(e @ (TartError::VmNotRunning { .. } | TartError::VmDoesNotExist { .. })) => {
                    return self.fail_start(e.to_string());
                }
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(self.cfg.probe_interval).await;
        }
    }

    /// The exec limit of a guest command: until the deadline (which interrupts first) plus a
    /// margin, so that even a missed interrupt cannot leave `tart exec` running for ever.
    fn exec_timeout(&self) -> Duration {
        let left = Timestamp::now().duration_until(self.attempt.deadline);
        Duration::try_from(left).unwrap_or_default() + Duration::from_secs(30)
    }

    /// The commands the guest runs, in order: the source checkout's, then the spec's steps. A
    /// step's index in this list is what the journal records.
    fn guest_commands(&self) -> Result<Vec<GuestCommand>, Performed> {
        let mut commands: Vec<GuestCommand> = Vec::new();
        if let Some(source) = &self.attempt.spec.source {
            match checkout_commands(source, &self.cfg.checkout_dir) {
                Ok(c) => commands.extend(c),
                Err(e) => return Err(failed_step(super::steps::CHECKOUT_STEP.to_string(), -1, e.to_string())),
            }
        }
        commands.extend(self.attempt.spec.steps.iter().map(|s| GuestCommand {
            name: s.name.clone(),
            argv: s.run.clone(),
        }));
        Ok(commands)
    }

    /// Reads `spec.env` (its Secrets) unless this executor did: a refusal is the event that ends
    /// the attempt. Nothing of a value is logged.
    async fn ensure_env(&mut self) -> Result<(), Performed> {
        if self.env.is_some() {
            return Ok(());
        }
        let namespace = self.attempt.build.namespace.clone();
        match super::env::resolve(&self.attempt.spec.env, &namespace, self.cfg.secrets.as_ref()).await {
            Ok(env) => {
                if !env.vars.is_empty() {
                    tracing::info!(vm = %self.attempt.vm, env = ?env, "step environment resolved");
                }
                self.env = Some(env);
                Ok(())
            }
            Err(refused) => {
                tracing::warn!(vm = %self.attempt.vm, reason = %refused.reason, error = %refused.message, "spec.env refused; the build fails");
                Err(Performed::Event(Event::EnvRefused {
                    reason: refused.reason,
                    error: refused.message,
                }))
            }
        }
    }

    /// The VM's guest folder, which holds the env file and the step jobs' folders.
    fn guest_vm_dir(&self) -> String {
        format!(
            "{}/{}",
            super::guest_job::GUEST_ROOT,
            super::steps::safe_name(&self.attempt.vm)
        )
    }

    /// Writes the env file into the guest through `tart exec -i` stdin (never argv), unless there
    /// is no env or this executor wrote it. Rewriting it after an agent restart is harmless: the
    /// same values, replaced by a rename.
    async fn write_env_file(&mut self) -> Result<(), String> {
        let Some(env) = self.env.as_ref().filter(|e| !e.vars.is_empty()) else {
            return Ok(());
        };
        if self.env_written {
            return Ok(());
        }
        let file = super::env::render_env_file(&env.vars);
        let log = self.tmp_dir().join("env-write.log");
        std::fs::create_dir_all(self.tmp_dir()).map_err(|e| format!("creating {}: {e}", self.tmp_dir().display()))?;
        let _ = std::fs::remove_file(&log);
        let mut options = ExecOptions::new(&log, Duration::from_secs(60).min(self.exec_timeout()));
        options.log_cap = 64 << 10;
        options.tail_bytes = 2048;
        let argv = super::env::write_script_argv(&self.guest_vm_dir());
        let out = self.tart.exec_input(&self.attempt.vm, &argv, file, &options).await;
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let _ = std::fs::remove_file(&log);
        match out {
            Ok(o) if o.exit_code == 0 && text == super::env::WRITTEN => {
                self.env_written = true;
                tracing::info!(vm = %self.attempt.vm, vars = env.vars.len(), "env file written in the guest (mode 0600)");
                Ok(())
            }
            Ok(o) => Err(format!(
                "writing the env file in the guest exited {}: {}",
                o.exit_code,
                text.trim()
            )),
            Err(e) => Err(format!("writing the env file in the guest: {e}")),
        }
    }

    /// Removes the env file from the guest once no step needs it (best effort: the VM is
    /// deleted next anyway).
    async fn remove_env_file(&mut self) {
        if self.env.as_ref().is_none_or(|e| e.vars.is_empty()) {
            return;
        }
        let log = self.tmp_dir().join("env-remove.log");
        let _ = std::fs::create_dir_all(self.tmp_dir());
        let options = ExecOptions::new(&log, Duration::from_secs(30).min(self.exec_timeout()));
        let argv = super::env::remove_script_argv(&self.guest_vm_dir());
        match self.tart.exec(&self.attempt.vm, &argv, &options).await {
            Ok(o) if o.exit_code == 0 => tracing::info!(vm = %self.attempt.vm, "env file removed from the guest"),
            Ok(o) => {
                tracing::warn!(vm = %self.attempt.vm, code = o.exit_code, "env file not removed from the guest; the VM is deleted next")
            }
            Err(error) => {
                tracing::warn!(vm = %self.attempt.vm, %error, "env file not removed from the guest; the VM is deleted next")
            }
        }
        let _ = std::fs::remove_file(&log);
        self.env_written = false;
    }

    /// Runs guest command `index` (started at `since`) to its exit, or stops it at its
    /// `timeoutSeconds`; then removes the env file if the attempt's steps ended. The next one's
    /// start goes through the journal first.
    async fn run_step(&mut self, index: u32, since: Timestamp) -> Performed {
        let performed = self.run_step_inner(index, since).await;
        let ended = !matches!(&performed, Performed::Event(Event::StepStarting { .. }));
        if ended {
            self.remove_env_file().await;
        }
        performed
    }

    async fn run_step_inner(&mut self, index: u32, since: Timestamp) -> Performed {
        let vm = self.attempt.vm.clone();
        let commands = match self.guest_commands() {
            Ok(c) => c,
            Err(failed) => return self.record_failure(failed),
        };
        if let Err(refused) = self.ensure_env().await {
            return refused;
        }
        let Some(cmd) = usize::try_from(index).ok().and_then(|i| commands.get(i)).cloned() else {
            return Performed::Event(Event::StepsSucceeded {
                steps: self.attempt.spec.steps.len() as u32,
            });
        };
        let logs = log_dir(&self.cfg.state_dir, &vm);
        if let Err(e) = std::fs::create_dir_all(&logs) {
            let msg = format!("creating log folder {}: {e}", logs.display());
            return self.step_failed(cmd.name, -1, msg);
        }
        // The step runs as a detached job in the guest (docs/resume.md): a restarted agent
        // re-attaches to it here, and its guard folder keeps it from starting twice.
        let follow = super::guest_job::FollowConfig {
            poll_interval: self.cfg.step_poll,
            no_pid_limit: self.cfg.step_no_pid_limit,
            log_cap: self.cfg.step_log_cap,
            tail_bytes: self.cfg.tail_bytes as u64,
            mask: self.env.as_ref().map(|e| e.masker.clone()).unwrap_or_default(),
            ..super::guest_job::FollowConfig::default()
        };
        if let Err(e) = self.write_env_file().await {
            return self.step_failed(cmd.name, -1, format!("{e}; the step did not run"));
        }
        let job = super::guest_job::Job::new(&vm, index as usize, &cmd.name, cmd.argv.clone());
        let host_log = step_log(&self.cfg.state_dir, &vm, &cmd.name);
        tracing::info!(%vm, step = %cmd.name, index, job = %job.dir, argv = %tartan_tart::argv_for_log(&cmd.argv), "step started or re-attached");
        // The checkout's commands come first and have no limit of their own.
        let limit = (index as usize)
            .checked_sub(commands.len() - self.attempt.spec.steps.len())
            .and_then(|i| self.attempt.spec.steps.get(i))
            .and_then(|s| s.timeout_seconds);
        let followed = match limit {
            None => super::guest_job::run_or_attach(&self.tart, &job, &host_log, &follow).await,
            Some(secs) => {
                let at = super::step_timeout::step_deadline(since, secs);
                tokio::select! {
                    end = super::guest_job::run_or_attach(&self.tart, &job, &host_log, &follow) => end,
                    () = until(at) => match self.stop_timed_out_step(&job, &host_log, &follow, secs).await {
                        Some(timed_out) => return timed_out,
                        // It had exited on its own at its limit: its own end counts.
                        None => super::guest_job::run_or_attach(&self.tart, &job, &host_log, &follow).await,
                    },
                }
            }
        };
        match followed {
            Ok(end) => {
                tracing::info!(%vm, step = %cmd.name, code = end.exit_code, took = ?end.elapsed, attached = end.attached, "step finished");
                if end.exit_code != 0 {
                    let last = last_lines(end.tail.as_bytes(), TAIL_LINES, TAIL_BYTES);
                    return self.step_failed(cmd.name, end.exit_code, last);
                }
                self.last_step = Some((cmd.name.clone(), end.tail));
            }
            // Not the step's doing: its start was cut short (an agent death in the start call).
            Err(e @ super::guest_job::JobError::NeverLaunched { .. }) => {
                tracing::warn!(%vm, step = %cmd.name, error = %e, "the step's guest job was never launched; the attempt is interrupted");
                return Performed::Event(Event::AgentFault { message: e.to_string() });
            }
            Err(e) => {
                tracing::warn!(%vm, step = %cmd.name, error = %e, "the step's guest job failed");
                return self.step_failed(cmd.name, -1, e.to_string());
            }
        }
        self.after_step(index, &cmd.name, &commands)
    }

    /// Stops the job of a step that ran past its `timeoutSeconds` (`secs`) and reads its end
    /// (bounded: the VM's deletion that follows ends whatever is left). Returns the `StepTimedOut`
    /// event, or `None` if the job had already exited on its own.
    async fn stop_timed_out_step(
        &mut self,
        job: &super::guest_job::Job,
        host_log: &Path,
        follow: &super::guest_job::FollowConfig,
        secs: u32,
    ) -> Option<Performed> {
        use super::step_timeout::{Stopped, host_log_tail, stop};
        let vm = &self.attempt.vm;
        tracing::warn!(%vm, step = %job.step, timeout_seconds = secs, "step ran past its timeoutSeconds; stopping its guest job");
        let stopped = stop(
            &self.tart,
            job,
            host_log,
            follow.exec_timeout,
            follow.unresponsive_limit,
        )
        .await;
        let killed = match &stopped {
            Ok(Stopped::Exited(code)) => {
                tracing::info!(%vm, step = %job.step, code, "the step had exited on its own at its timeout");
                return None;
            }
            Ok(Stopped::Killed(n)) => format!("it was killed in the guest ({n} process(es))"),
            Ok(Stopped::NoPid) => "its guest job had no pid to kill; the VM's deletion ends it".to_string(),
            Err(e) => format!("stopping it in the guest failed ({e}); the VM's deletion ends it"),
        };
        // Read what the step wrote up to its death (its job now exits 137 at once).
        let drained = match stopped {
            Ok(Stopped::Killed(_)) => tokio::time::timeout(
                follow.exec_timeout,
                super::guest_job::run_or_attach(&self.tart, job, host_log, follow),
            )
            .await
            .ok()
            .and_then(Result::ok),
            _ => None,
        };
        let tail = match drained {
            Some(end) => end.tail,
            None => host_log_tail(host_log, self.cfg.tail_bytes as u64),
        };
        let output = last_lines(tail.as_bytes(), TAIL_LINES, TAIL_BYTES);
        self.last_step = Some((job.step.clone(), output.clone()));
        tracing::warn!(%vm, step = %job.step, %killed, "step timed out");
        Some(Performed::Event(Event::StepTimedOut {
            step: job.step.clone(),
            timeout_seconds: secs,
            killed,
            output: clean_str(&output, TAIL_BYTES),
        }))
    }

    /// What follows guest command `index`, which exited 0: the next one's start, or the end.
    fn after_step(&self, index: u32, name: &str, commands: &[GuestCommand]) -> Performed {
        let next = index.saturating_add(1);
        match usize::try_from(next).ok().and_then(|i| commands.get(i)) {
            Some(cmd) => Performed::Event(Event::StepStarting {
                index: next,
                of: u32::try_from(commands.len()).unwrap_or(u32::MAX),
                name: cmd.name.clone(),
                previous: name.to_string(),
            }),
            None => Performed::Event(Event::StepsSucceeded {
                steps: self.attempt.spec.steps.len() as u32,
            }),
        }
    }

    /// Keeps what a [`failed_step`] event says as the last step's output.
    fn record_failure(&mut self, failed: Performed) -> Performed {
        if let Performed::Event(Event::StepFailed { step, output, .. }) = &failed {
            self.last_step = Some((step.clone(), output.clone()));
        }
        failed
    }

    /// Ends the steps with `step` failed: `why` (its last lines, or the error that kept it from
    /// running) goes into the event, so the record, the status and the CustomRun say it.
    fn step_failed(&mut self, step: String, exit_code: i32, why: String) -> Performed {
        let failed = failed_step(step, exit_code, why);
        self.record_failure(failed)
    }

    /// Copies guest file `path` to host file `to` through `tart exec NAME cat PATH` (at most `cap`
    /// bytes). Returns the size.
    async fn read_guest_file(&self, path: &str, to: &Path, cap: u64) -> Result<u64, String> {
        let vm = &self.attempt.vm;
        if let Some(parent) = to.parent() {
            std::fs::create_dir_all(parent).map_err(|e| format!("creating {}: {e}", parent.display()))?;
        }
        match std::fs::remove_file(to) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("removing stale {}: {e}", to.display())),
        }
        let options = ExecOptions {
            log_path: to.to_path_buf(),
            log_cap: cap,
            tail_bytes: 2048,
            timeout: self.exec_timeout(),
        };
        let argv = vec!["cat".to_string(), path.to_string()];
        let out = self.tart.exec(vm, &argv, &options).await.map_err(|e| e.to_string())?;
        if out.exit_code != 0 {
            return Err(format!(
                "`cat {path}` in the guest exited {}: {}",
                out.exit_code,
                out.tail.trim()
            ));
        }
        if out.truncated {
            return Err(format!("{path} is larger than the {cap}-byte limit"));
        }
        Ok(out.output_bytes)
    }

    async fn collect_results(&mut self) -> Performed {
        let Some(report) = self.attempt.spec.test_report.clone() else {
            return Performed::Done;
        };
        let host = self.tmp_dir().join("test-report.xml");
        let counted = match self.read_guest_file(&report, &host, self.cfg.report_cap).await {
            Err(e) => Err(format!("test report {report} could not be read from the guest: {e}")),
            Ok(_) => match std::fs::read(&host) {
                Err(e) => Err(format!("reading {}: {e}", host.display())),
                Ok(bytes) => parse_report(&report, &bytes).map_err(|e| e.to_string()),
            },
        };
        let _ = std::fs::remove_file(&host);
        match counted {
            Ok(c) => {
                tracing::info!(vm = %self.attempt.vm, total = c.total, failed = c.failed(), skipped = c.skipped, "test report counted");
                self.counts = Some(c);
                if c.failed() > 0 {
                    Performed::Event(Event::TestsFailed {
                        failed: c.failed(),
                        total: c.total,
                    })
                } else {
                    Performed::Done
                }
            }
            Err(e) => {
                tracing::warn!(vm = %self.attempt.vm, error = %e, "test report unusable; the attempt fails");
                self.report_error = Some(e.clone());
                Performed::Event(Event::TestReportUnusable { error: e })
            }
        }
    }

    async fn upload_artifacts(&mut self) -> Performed {
        let counts = self.counts.unwrap_or_default();
        let passed = Event::TestsPassed {
            passed: counts.passed(),
            total: counts.total,
        };
        let Some(artifacts) = self.attempt.spec.artifacts.clone() else {
            return Performed::Event(passed);
        };
        let failed = |error: String| Performed::Event(Event::ArtifactUploadFailed { error });
        // Checked again: the folders may have changed since the admission, and the upload must
        // write to the folder as resolved now.
        let dest = match self.artifact_destination() {
            Some(Ok(d)) => d,
            Some(Err(e)) => return failed(e.to_string()),
            None => return Performed::Event(passed),
        };
        let vm = self.attempt.vm.clone();
        let mut urls = Vec::new();
        for (i, path) in artifacts.paths.iter().enumerate() {
            let key = match artifact_key(&vm, path) {
                Ok(k) => k,
                Err(e) => return failed(e.to_string()),
            };
            let host = self.tmp_dir().join(format!("artifact-{i}"));
            let size = match self.read_guest_file(path, &host, self.cfg.artifact_cap).await {
                Ok(n) => n,
                Err(e) => return failed(format!("artifact {path} could not be read from the guest: {e}")),
            };
            crate::crash_point!("artifacts.upload.before");
            let result = upload(&dest, &key, &host, &self.cfg.upload, &self.cfg.artifacts).await;
            crate::crash_point!("artifacts.upload.after");
            let _ = std::fs::remove_file(&host);
            match result {
                Ok(url) => {
                    tracing::info!(%vm, %path, %url, size, "artifact published");
                    urls.push(url);
                }
                Err(e) => return failed(e.to_string()),
            }
        }
        self.artifact_url = match urls.as_slice() {
            [one] => Some(one.clone()),
            _ => Some(dest.url_of(&format!("{vm}/"))),
        };
        Performed::Event(passed)
    }

    async fn stop_and_delete_vm(&mut self, context: DeleteContext) -> Performed {
        let started = Instant::now();
        let result = if self.refused_existing {
            self.check_gone()
                .map_err(|e| format!("{e}; it existed before this attempt's clone, so it is not deleted"))
        } else {
            self.stop_and_delete().await
        };
        match result {
            Ok(()) => {
                let took = started.elapsed();
                tracing::info!(vm = %self.attempt.vm, ?took, "stopped and deleted");
                Performed::Event(Event::VmDeleted {
                    how: context.deleted(took.try_into().unwrap_or_default()),
                })
            }
            Err(error) => {
                tracing::warn!(vm = %self.attempt.vm, %error, "VM not deleted");
                Performed::Event(Event::DeleteFailed { context, error })
            }
        }
    }

    /// One more try at deleting a quarantined VM (stop, delete, check the folder is gone).
    /// A VM found before this attempt's clone is never deleted: it only counts as gone once an
    /// operator removed it. Returns how long it took.
    pub async fn retry_delete(&mut self) -> Result<Duration, String> {
        let started = Instant::now();
        if self.refused_existing {
            self.check_gone()?;
        } else {
            self.stop_and_delete().await?;
        }
        Ok(started.elapsed())
    }

    fn check_gone(&self) -> Result<(), String> {
        let dir = self.tart.vm_dir(&self.attempt.vm).map_err(|e| e.to_string())?;
        match std::fs::symlink_metadata(&dir) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(format!("cannot check {}: {e}", dir.display())),
            Ok(_) => Err(format!("{} still exists", dir.display())),
        }
    }

    /// `tart stop` (killing the VM's processes if that fails), `tart delete` (absent counts as
    /// deleted), then the VM folder must be gone.
    async fn stop_and_delete(&mut self) -> Result<(), String> {
        let vm = self.attempt.vm.clone();
        crate::crash_point!("tart.stop.before");
        let stopped = self.tart.stop(&vm, self.cfg.stop_timeout).await;
        crate::crash_point!("tart.stop.after");
        match stopped {
            Ok(()) => {}
            Err(e) if e.is_not_running() || e.is_vm_missing() => {}
            Err(e) => {
                tracing::warn!(%vm, error = %e, "tart stop failed; killing the VM's tart processes");
                self.tart
                    .kill_vm_processes(&vm)
                    .await
                    .map_err(|k| format!("{e}; killing its processes failed too: {k}"))?;
            }
        }
        if let Some(mut run) = self.run.take() {
            // `tart stop` has returned, so our `tart run` has exited or is about to.
            if tokio::time::timeout(Duration::from_secs(5), run.wait()).await.is_err() {
                let _ = run.kill().await;
            }
        }
        crate::crash_point!("tart.delete.before");
        let deleted = self.tart.delete(&vm).await;
        crate::crash_point!("tart.delete.after");
        match deleted {
            Ok(()) => {}
            Err(e) if e.is_vm_missing() => {}
            Err(e) => return Err(e.to_string()),
        }
        self.check_gone()
            .map_err(|e| format!("tart delete {vm} returned, but {e}"))?;
        let _ = std::fs::remove_dir_all(self.tmp_dir());
        Ok(())
    }

    async fn confirm_gone(&mut self) -> Performed {
        let vm = self.attempt.vm.clone();
        let listed = match self.tart.list().await {
            Ok(list) => list.iter().any(|e| e.is_local() && e.name == vm),
            Err(e) => {
                return Performed::Event(Event::DeleteFailed {
                    context: DeleteContext::Watchdog,
                    error: format!("cannot confirm {vm} is gone: {e}"),
                });
            }
        };
        match (listed, self.check_gone()) {
            (false, Ok(())) => Performed::Event(Event::VmDeleted {
                how: Deleted::ByWatchdog,
            }),
            (true, _) => Performed::Event(Event::DeleteFailed {
                context: DeleteContext::Watchdog,
                error: format!("{vm} is still listed by tart list"),
            }),
            (false, Err(e)) => Performed::Event(Event::DeleteFailed {
                context: DeleteContext::Watchdog,
                error: e,
            }),
        }
    }
}

/// The `StepFailed` event of `step`: `why` (its last lines, or the error that kept it from
/// running) goes into the event, so the record, the status and the CustomRun say it.
fn failed_step(step: String, exit_code: i32, why: String) -> Performed {
    Performed::Event(Event::StepFailed {
        step,
        exit_code,
        output: clean_str(&why, TAIL_BYTES),
    })
}

fn action_vm(action: &Action) -> Option<&str> {
    match action {
        Action::WriteDeadlineFile { vm, .. }
        | Action::CloneVm { vm }
        | Action::SetVm { vm }
        | Action::StartVm { vm }
        | Action::ProbeReady { vm }
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

/// Resolves once the wall clock reaches `deadline`.
/// Whether something seen `ago` before `now` was seen before `deadline`. (`ago` comes from the
/// monotonic clock, which on macOS stops while the Mac sleeps: a sleep makes it look seen later,
/// never earlier, so the deadline is then the reason, as for a paused agent.)
fn seen_before(ago: Duration, now: Timestamp, deadline: Timestamp) -> bool {
    SignedDuration::try_from(ago)
        .ok()
        .and_then(|ago| now.checked_sub(ago).ok())
        .is_some_and(|seen| seen < deadline)
}

async fn until(deadline: Timestamp) {
    loop {
        let left = Timestamp::now().duration_until(deadline);
        match Duration::try_from(left) {
            Ok(d) if !d.is_zero() => tokio::time::sleep(d.min(Duration::from_secs(60))).await,
            _ => return,
        }
    }
}
