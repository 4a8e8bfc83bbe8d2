//! Recovery at agent start: gather what the journal, tart and the cluster say, ask the pure
//! planner what to do, and do it. Unknown VMs are journaled first (their slots are blocked before
//! anything is admitted); every build's actions then run in order in that build's own task.
//!
//! This module owns nothing of its own: what it learns goes into [`super::core::Builds`], and
//! each build's task (its [`BuildTask`]) into `build`'s hands.

use super::build::{self, BuildTask, ReadBuildError, Rest, Start, drive, known_attempt};
use super::core::Shared;
use crate::machine::{Action, AttemptKey, Event};
use crate::record::{BuildRef, Record};
use crate::recovery::{self, AgentId, BuildView, ClaimView, ClusterView, Ending, ObservedVm, RecoveryAction};
use k8s_openapi::jiff::Timestamp;
use std::collections::BTreeMap;
use std::sync::Arc;
use tartan_api::{AttemptState, FINALIZER, MacBuild, VM_PREFIX};
use tartan_tart::TartError;

/// What the cluster says of one MacBuild, for the planner.
pub fn build_view(mb: &MacBuild) -> BuildView {
    let status = mb.status.clone().unwrap_or_default();
    BuildView {
        namespace: mb.metadata.namespace.clone().unwrap_or_default(),
        name: mb.metadata.name.clone().unwrap_or_default(),
        uid: mb.metadata.uid.clone().unwrap_or_default(),
        // The MacBuild carries no trace of its owner's deletion beyond its own (the garbage
        // collector deletes it); either way the outcome is `Cancelled` and nothing is retried.
        owner_deleted: false,
        deletion_requested: mb.metadata.deletion_timestamp.is_some(),
        cancel_requested: mb.spec.cancel_requested,
        claim: status.claim.as_ref().and_then(|c| {
            crate::cluster::claim::attempt_number(c).map(|attempt| ClaimView {
                holder: c.holder.clone(),
                attempt,
            })
        }),
        journal_seq: status.journal_seq,
        max_attempts: u8::try_from(mb.spec.max_attempts).ok(),
        generation: mb.metadata.generation,
        timeout_seconds: mb.spec.timeout_seconds,
        has_finalizer: mb.metadata.finalizers.iter().flatten().any(|f| f == FINALIZER),
    }
}

/// Runs recovery: plans from `records` and the live world, journals the unknown VMs, and starts
/// one task per build with its actions. Returns once the plan is under way.
///
/// The cluster is read first (one API timeout at most). If it does not answer, the host side —
/// killing survivors and deleting the VMs of open attempts, from the journal and `tart list`
/// alone — starts at once, and a background task waits for the cluster (backing off, naming the
/// server, `/healthz` saying why) to plan the rest: claims, redelivery, owed retries, finalizers.
pub async fn recover(shared: &Arc<Shared>, records: Vec<Record>) -> anyhow::Result<()> {
    let began = std::time::Instant::now();
    let vms: Vec<ObservedVm> = shared
        .tart
        .list()
        .await
        .map_err(|e| anyhow::anyhow!("listing tart VMs for recovery: {e}; the agent cannot account for its VMs"))?
        .into_iter()
        .filter(|v| v.source.eq_ignore_ascii_case("local"))
        .map(|v| ObservedVm {
            name: v.name,
            running: v.running,
        })
        .collect();
    let listed = began.elapsed();
    let me = AgentId(shared.config.agent_id.clone());
    let replayed = recovery::replay(&records, &shared.machine);

    let reading = std::time::Instant::now();
    let (view, pending) = match read_cluster(shared, &records).await {
        Ok((view, macbuilds)) => (view, Some(macbuilds)),
        Err(error) => {
            let why = format!(
                "{error}; recovering the host side now (killing survivors, deleting the VMs of open attempts), \
                 the rest once the API server {} answers",
                shared.api_server
            );
            tracing::warn!(target: "recovery", "{why}");
            *shared.recovery_waits.lock().expect("not poisoned") = Some(why);
            (ClusterView::as_journaled(&replayed, &me), None)
        }
    };
    let read = reading.elapsed();
    let host_only = pending.is_none();
    let plan = recovery::plan(&records, &vms, &view, &me, Timestamp::now(), &shared.machine);
    // Where the start's time went (scripts/bench-agent reads this line).
    tracing::info!(
        target: "recovery",
        records = records.len(),
        vms = vms.iter().filter(|v| v.name.starts_with(VM_PREFIX)).count(),
        actions = plan.len(),
        cluster = if host_only { "unreachable: host side only" } else { "read" },
        tart_list = ?listed,
        cluster_read = ?read,
        recovery = ?began.elapsed(),
        since_start = ?shared.started.elapsed(),
        "recovery planned"
    );
    {
        let mut replayed = replayed.clone();
        replayed.see(&view, &shared.machine);
        // The last snapshot of each build: the journal's, else the cluster's.
        shared.builds.load_replay(&replayed, &records).await;
    }
    let host_builds = recovery::host_side(&replayed);
    let (mine, deferred): (Vec<RecoveryAction>, Vec<RecoveryAction>) = plan
        .into_iter()
        .partition(|a| !host_only || a.build().is_none_or(|b| host_builds.contains(&b.uid)));
    match pending {
        Some(macbuilds) => {
            learn_from_cluster(shared, &macbuilds).await;
            start(shared, mine, &macbuilds, &records).await
        }
        None => {
            start(shared, mine, &BTreeMap::new(), &records).await?;
            tracing::info!(target: "recovery", deferred = deferred.len(), "waiting for the cluster to plan the rest");
            let shared = Arc::clone(shared);
            tokio::spawn(async move { finish_with_cluster(&shared, records, vms, host_builds).await });
            Ok(())
        }
    }
}

/// MacBuild reads in flight at once while recovery reads the cluster.
const RECOVERY_READS: usize = 16;

/// Every build the journal names, as the cluster has it now, read [`RECOVERY_READS`] at a time;
/// the first failure ends the read (about one API timeout at most: recovery must not wait on an
/// API that is down). The view lists the builds in uid order, whatever order the answers came in.
async fn read_cluster(
    shared: &Shared,
    records: &[Record],
) -> Result<(ClusterView, BTreeMap<String, MacBuild>), ReadBuildError> {
    use futures::{StreamExt, TryStreamExt};
    let builds: BTreeMap<String, BuildRef> = records
        .iter()
        .filter_map(|r| r.build.as_ref().map(|b| (b.uid.clone(), b.clone())))
        .collect();
    let macbuilds: BTreeMap<String, MacBuild> = futures::stream::iter(builds.into_values())
        .map(|b| async move { Ok::<_, ReadBuildError>(build::read_build(shared, &b).await?.map(|mb| (b.uid, mb))) })
        .buffer_unordered(RECOVERY_READS)
        .try_filter_map(|found| async move { Ok(found) })
        .try_collect()
        .await?;
    let cluster = ClusterView {
        builds: macbuilds.values().map(build_view).collect(),
        ..ClusterView::default()
    };
    Ok((cluster, macbuilds))
}

/// What only the cluster knows: our claim epochs, what earlier runs delivered, and the status of
/// builds the journal saved none for.
async fn learn_from_cluster(shared: &Shared, macbuilds: &BTreeMap<String, MacBuild>) {
    let agent = &shared.config.agent_id;
    shared.builds.learn_from_cluster(agent, macbuilds).await;
    // Delivery goes on from what the cluster shows of the builds this agent holds.
    let held = |mb: &&MacBuild| {
        mb.status
            .as_ref()
            .and_then(|s| s.claim.as_ref())
            .is_some_and(|c| &c.holder == agent)
    };
    for mb in macbuilds.values().filter(held) {
        shared.delivery.observed(mb);
    }
}

/// How many failed reads of one MacBuild, while others are read fine (so the API answers and
/// the fault is that object's: it keeps failing or does not decode), before recovery gives up
/// on that build until the next agent start. Reads that all fail (the API is down) are waited
/// out without a count.
pub const MAX_FAILED_BUILD_READS: u32 = 6;

/// The part of recovery that waited for the cluster: each build the host side did not take is
/// read on its own, with capped backoff, and recovered as soon as its read answers. One build
/// whose MacBuild cannot be read holds up no other: it is read again (at most
/// [`MAX_FAILED_BUILD_READS`] times while other reads succeed; then it is left, logged, to the
/// next start), and `/healthz` names it meanwhile.
pub async fn finish_with_cluster(
    shared: &Arc<Shared>,
    records: Vec<Record>,
    vms: Vec<ObservedVm>,
    host_builds: std::collections::BTreeSet<String>,
) {
    let mut waiting: BTreeMap<String, BuildRef> = records
        .iter()
        .filter_map(|r| r.build.as_ref())
        .filter(|b| !host_builds.contains(&b.uid))
        .map(|b| (b.uid.clone(), b.clone()))
        .collect();
    let mut failures: BTreeMap<String, u32> = BTreeMap::new();
    let mut wait = std::time::Duration::from_secs(1);
    while !waiting.is_empty() {
        let answers = read_each(shared, waiting.values().cloned().collect()).await;
        let mut answered: BTreeMap<String, Option<MacBuild>> = BTreeMap::new();
        let mut failed: Vec<(BuildRef, ReadFailure)> = Vec::new();
        for (build, answer) in answers {
            match answer {
                Ok(mb) => {
                    answered.insert(build.uid.clone(), mb);
                }
                Err(error) => failed.push((build, error)),
            }
        }
        // The API answers when any read did: a read that fails then is that build's fault, as
        // is an object that does not decode.
        let api_answers = !answered.is_empty();
        if !answered.is_empty() {
            for uid in answered.keys() {
                waiting.remove(uid);
                failures.remove(uid);
            }
            recover_answered(shared, &records, &vms, &host_builds, answered).await;
            wait = std::time::Duration::from_secs(1);
        }
        for (build, error) in &failed {
            let tries = failures.entry(build.uid.clone()).or_default();
            if api_answers || error.undecodable {
                *tries += 1;
            }
            if *tries >= MAX_FAILED_BUILD_READS {
                tracing::error!(
                    target: "recovery",
                    %build,
                    error = %error.message,
                    "MacBuild still cannot be read after {tries} tries while the API answers; its recovery is left \
                     to the next agent start (its journal records are kept)"
                );
                waiting.remove(&build.uid);
            }
        }
        if waiting.is_empty() {
            break;
        }
        let names: Vec<String> = failed.iter().map(|(_, e)| e.message.clone()).collect();
        let why = format!(
            "recovery waits for the API server {} to answer for {} MacBuild(s) ({}); retrying in {wait:?}",
            shared.api_server,
            waiting.len(),
            names.join("; ")
        );
        tracing::warn!(target: "recovery", "{why}");
        *shared.recovery_waits.lock().expect("not poisoned") = Some(why);
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(std::time::Duration::from_secs(30));
    }
    *shared.recovery_waits.lock().expect("not poisoned") = None;
}

/// Why one MacBuild could not be read.
struct ReadFailure {
    message: String,
    /// The API answered, with an object that does not decode: that build's fault, not the API's.
    undecodable: bool,
}

/// Reads each of `builds` on its own ([`RECOVERY_READS`] at a time): one answer per build, a
/// failure of one not ending the others (each read is bounded by the API timeout).
async fn read_each(shared: &Shared, builds: Vec<BuildRef>) -> Vec<(BuildRef, Result<Option<MacBuild>, ReadFailure>)> {
    use futures::StreamExt;
    let limit = shared.config.timing.api_timeout;
    futures::stream::iter(builds)
        .map(|b| async move {
            let api: kube::Api<MacBuild> = kube::Api::namespaced(shared.client.clone(), &b.namespace);
            let answer = match tokio::time::timeout(limit, api.get_opt(&b.name)).await {
                Ok(Ok(Some(mb))) if mb.metadata.uid.as_deref() == Some(b.uid.as_str()) => Ok(Some(mb)),
                Ok(Ok(_)) => Ok(None),
                Ok(Err(e)) => Err(ReadFailure {
                    undecodable: matches!(e, kube::Error::SerdeError(_)),
                    message: format!("reading MacBuild {b}: {e}"),
                }),
                Err(_) => Err(ReadFailure {
                    undecodable: false,
                    message: format!("reading MacBuild {b}: no answer within {limit:?}"),
                }),
            };
            (b, answer)
        })
        .buffer_unordered(RECOVERY_READS)
        .collect()
        .await
}

/// Plans and starts recovery for the builds in `answered` (each MacBuild as read now, `None` if
/// it is gone), which waited for the cluster.
async fn recover_answered(
    shared: &Arc<Shared>,
    records: &[Record],
    vms: &[ObservedVm],
    host_builds: &std::collections::BTreeSet<String>,
    answered: BTreeMap<String, Option<MacBuild>>,
) {
    let macbuilds: BTreeMap<String, MacBuild> = answered
        .iter()
        .filter_map(|(uid, mb)| mb.clone().map(|mb| (uid.clone(), mb)))
        .collect();
    // Only the answered builds' records: a build not read yet must not be planned as gone.
    let records: Vec<Record> = records
        .iter()
        .filter(|r| r.build.as_ref().is_none_or(|b| answered.contains_key(&b.uid)))
        .cloned()
        .collect();
    let view = ClusterView {
        builds: macbuilds.values().map(build_view).collect(),
        ..ClusterView::default()
    };
    let me = AgentId(shared.config.agent_id.clone());
    let plan = recovery::plan(&records, vms, &view, &me, Timestamp::now(), &shared.machine);
    let rest: Vec<RecoveryAction> = plan
        .into_iter()
        .filter(|a| {
            a.build()
                .is_some_and(|b| answered.contains_key(&b.uid) && !host_builds.contains(&b.uid))
        })
        .collect();
    {
        let mut replayed = recovery::replay(&records, &shared.machine);
        replayed.see(&view, &shared.machine);
        // Whether each waiting build still exists and its maxAttempts, as the cluster says now.
        let waited = replayed
            .attempts
            .iter()
            .filter(|a| answered.contains_key(&a.build.uid) && !host_builds.contains(&a.build.uid));
        shared.builds.refresh_attempts(waited).await;
    }
    learn_from_cluster(shared, &macbuilds).await;
    tracing::info!(target: "recovery", builds = answered.len(), actions = rest.len(), "the cluster answers; recovering these builds");
    if let Err(error) = start(shared, rest, &macbuilds, &records).await {
        tracing::error!(target: "recovery", %error, "the rest of recovery could not start; the next agent start retries it");
    }
}

/// Journals the unknown-VM actions of `plan`, then starts one task per build with its actions.
async fn start(
    shared: &Arc<Shared>,
    plan: Vec<RecoveryAction>,
    macbuilds: &BTreeMap<String, MacBuild>,
    records: &[Record],
) -> anyhow::Result<()> {
    let mut per_build: BTreeMap<String, Vec<RecoveryAction>> = BTreeMap::new();
    for action in plan {
        tracing::info!(target: "recovery", "{action}");
        match action.build() {
            None => {
                let seq = shared.builds.next_seq().await;
                if let Some(record) = action.record(seq, Timestamp::now()) {
                    shared
                        .journal_unknown(record)
                        .await
                        .map_err(|e| anyhow::anyhow!("journaling {action}: {e}"))?;
                }
            }
            Some(build) => per_build.entry(build.uid.clone()).or_default().push(action),
        }
    }
    for (uid, actions) in per_build {
        let mb = macbuilds.get(&uid).cloned();
        let records = records.to_vec();
        let cancel = build::register(shared, &uid).await;
        let Some(build) = actions[0].build().cloned() else {
            continue;
        };
        build::spawn_supervised(
            Arc::clone(shared),
            build.clone(),
            cancel,
            move |shared, cancel| async move {
                let mut task = BuildTask::new(cancel);
                let rest = run_actions(&shared, mb, &records, actions, &mut task).await;
                build::follow_retries(shared, build, rest, task).await;
            },
        );
    }
    Ok(())
}

/// Kills the VM's surviving tart processes, then follows the attempt from `then` with their count.
async fn kill_then_drive(
    shared: &Shared,
    mb: &Option<MacBuild>,
    attempt: &AttemptKey,
    vm: &str,
    then: Ending,
    generation: Option<i64>,
    task: &mut BuildTask,
) -> Rest {
    crate::crash_point!("recover.kill_survivors.before");
    let killed = shared.tart.kill_vm_processes(vm).await;
    crate::crash_point!("recover.kill_survivors.after");
    let killed = match killed {
        Ok(report) => report.killed.len(),
        Err(error) => {
            tracing::error!(%vm, %error, "could not kill the VM's tart processes; recovery of this build stops here");
            return Rest::Stuck(error.to_string());
        }
    };
    let killed = u32::try_from(killed).unwrap_or(u32::MAX);
    drive(shared, mb, attempt, Start::Event(then.event(killed)), generation, task).await
}

/// Why a still-running VM's attempt is not followed again (it is interrupted and its VM deleted).
#[derive(Debug, thiserror::Error)]
enum NotResumable {
    #[error("the previous agent's clone of {vm} could not be killed: {error}")]
    CloneNotKilled { vm: String, error: TartError },
    #[error("{0}")]
    Tart(TartError),
    #[error("{} appeared while the previous agent's clone was stopped ({killed} tart process(es) killed)", dir.display())]
    CloneAppeared { dir: std::path::PathBuf, killed: usize },
    #[error("creating {}: {error}", dir.display())]
    ProbeLog {
        dir: std::path::PathBuf,
        error: std::io::Error,
    },
    #[error("the guest did not answer tart exec {vm} true within {limit:?} (last: {last})")]
    GuestSilent {
        vm: String,
        limit: std::time::Duration,
        last: String,
    },
    #[error("the Lease keeper stopped")]
    LeaseKeeperStopped,
    #[error("the Lease was not renewed within {limit:?} of the agent's start (last error: {last_error})")]
    LeaseNotRenewed {
        limit: std::time::Duration,
        last_error: String,
    },
}

/// Whether a still-running VM's attempt can be followed again: within `timing.resume_probe`, the
/// guest answers `tart exec VM true` and the Lease is live (no status is written before it is).
/// For a boot stopped before its clone finished (`clone_again`) there is no guest to ask: a
/// clone the previous agent left running (a `kill -9` spares its children) is killed, and the VM
/// must still be absent, so the clone made again is the only one. A boot (`found` `Booting`) is
/// not asked either: its guest may take longer than the probe to come up, and the resumed boot's
/// own readiness probe waits for it within `boot_timeout`.
async fn resumable(shared: &Shared, vm: &str, found: AttemptState, clone_again: bool) -> Result<(), NotResumable> {
    let limit = shared.config.timing.resume_probe;
    let until = tokio::time::Instant::now() + limit;
    if clone_again {
        let killed = shared
            .tart
            .kill_vm_processes(vm)
            .await
            .map_err(|error| NotResumable::CloneNotKilled {
                vm: vm.to_string(),
                error,
            })?;
        let dir = shared.tart.vm_dir(vm).map_err(NotResumable::Tart)?;
        if std::fs::symlink_metadata(&dir).is_ok() {
            return Err(NotResumable::CloneAppeared {
                dir,
                killed: killed.count(),
            });
        }
        return lease_live(shared, until, limit).await;
    }
    if found == AttemptState::Booting {
        return lease_live(shared, until, limit).await;
    }
    let log = crate::host::steps::step_log(&shared.config.state_dir, vm, "_probe");
    if let Some(dir) = log.parent() {
        std::fs::create_dir_all(dir).map_err(|error| NotResumable::ProbeLog {
            dir: dir.to_path_buf(),
            error,
        })?;
    }
    let mut last = String::from("no probe finished");
    loop {
        let left = until.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            return Err(NotResumable::GuestSilent {
                vm: vm.to_string(),
                limit,
                last,
            });
        }
        let mut options = tartan_tart::ExecOptions::new(&log, left.min(std::time::Duration::from_secs(10)));
        options.log_cap = 64 << 10;
        options.tail_bytes = 1024;
        match shared.tart.exec(vm, &["true".to_string()], &options).await {
            Ok(out) if out.exit_code == 0 => break,
            Ok(out) => last = format!("`true` exited {} in the guest", out.exit_code),
            Err(e @ (TartError::VmNotRunning { .. } | TartError::VmDoesNotExist { .. })) => {
                return Err(NotResumable::Tart(e));
            }
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(std::time::Duration::from_millis(500).min(left)).await;
    }
    lease_live(shared, until, limit).await
}

/// Waits until `until` for the Lease to be live; `limit` is what the wait was given, for the message.
async fn lease_live(
    shared: &Shared,
    until: tokio::time::Instant,
    limit: std::time::Duration,
) -> Result<(), NotResumable> {
    let mut lease = shared.lease.clone();
    let live = tokio::time::timeout_at(until, async {
        lease
            .wait_for(|l| l.can_claim(tokio::time::Instant::now()))
            .await
            .map(|_| ())
    })
    .await;
    match live {
        Ok(Ok(())) => Ok(()),
        Ok(Err(_)) => Err(NotResumable::LeaseKeeperStopped),
        Err(_) => Err(NotResumable::LeaseNotRenewed {
            limit,
            last_error: shared
                .lease
                .borrow()
                .last_error
                .as_deref()
                .unwrap_or("none")
                .to_string(),
        }),
    }
}

/// One build's recovery actions, in order; returns where its last attempt rests.
async fn run_actions(
    shared: &Shared,
    mb: Option<MacBuild>,
    records: &[Record],
    actions: Vec<RecoveryAction>,
    task: &mut BuildTask,
) -> Rest {
    let generation = mb.as_ref().and_then(|m| m.metadata.generation);
    let mut rest = Rest::Retired { next: None };
    for action in actions {
        rest = match action {
            RecoveryAction::KillVmProcesses { attempt, vm, then, .. } => {
                kill_then_drive(shared, &mb, &attempt, &vm, then, generation, task).await
            }
            RecoveryAction::Resume {
                attempt,
                vm,
                found,
                clone_again,
            } => match resumable(shared, &vm, found, clone_again).await {
                Ok(()) => {
                    let after = shared.started.elapsed().try_into().unwrap_or_default();
                    tracing::info!(target: "recovery", attempt = %attempt, %vm, ?after, clone_again, "guest answers (or the clone is made again) and the Lease is live; resuming");
                    drive(
                        shared,
                        &mb,
                        &attempt,
                        Start::Event(Event::Resume { after, clone_again }),
                        generation,
                        task,
                    )
                    .await
                }
                Err(why) => {
                    tracing::warn!(target: "recovery", attempt = %attempt, %vm, "not resumed: {why}; interrupting it and deleting the VM");
                    kill_then_drive(shared, &mb, &attempt, &vm, Ending::AgentRestarted, generation, task).await
                }
            },
            RecoveryAction::Step { attempt, event } => {
                drive(shared, &mb, &attempt, Start::Event(event), generation, task).await
            }
            RecoveryAction::DeleteVm { attempt, vm, context } => {
                let action = if context == crate::machine::DeleteContext::Retry {
                    Action::RetryDeleteLater {
                        vm,
                        after: shared.machine.quarantine_retry,
                    }
                } else {
                    Action::StopAndDeleteVm { vm, context }
                };
                drive(shared, &mb, &attempt, Start::Perform(action), generation, task).await
            }
            RecoveryAction::ConfirmVmGone { attempt, vm } => {
                let start = Start::Perform(Action::ConfirmVmGone { vm });
                drive(shared, &mb, &attempt, start, generation, task).await
            }
            RecoveryAction::ResumeAdmission { attempt, .. } => {
                let Some(mb) = &mb else {
                    tracing::warn!(attempt = %attempt, "MacBuild gone before its admission");
                    continue;
                };
                let Some(a) = known_attempt(shared, &attempt).await else {
                    continue;
                };
                build::resume_admission(shared, mb, a, task).await
            }
            RecoveryAction::RedeliverStatus { attempt, seq } => {
                match records.iter().find(|r| r.seq == seq).and_then(Record::saved_status) {
                    Some(status) => shared.delivery.submit(&attempt.build, status, seq),
                    None => tracing::error!(%seq, "record has no saved status to deliver"),
                }
                Rest::Retired { next: None }
            }
            RecoveryAction::AdmitNextAttempt { next } => Rest::Retired { next: Some(next) },
            RecoveryAction::RemoveFinalizer { build } => {
                build::release_finalizer(shared, &build).await;
                Rest::Retired { next: None }
            }
            RecoveryAction::QuarantineUnknownVm { .. } | RecoveryAction::ResolveUnknownVm { .. } => continue,
        };
        if matches!(rest, Rest::Stuck(_) | Rest::JournalFailed(_)) {
            return rest;
        }
    }
    rest
}
