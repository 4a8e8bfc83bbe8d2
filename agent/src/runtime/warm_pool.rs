//! The warm pool's task: rounds of [`Shared::pool_round`] (what to delete, what to refill, each
//! journaled first), then the I/O of each in a task of its own, and the Lease's list of the
//! images this host has a ready warm VM of.
//!
//! A warm VM's I/O has one owner at a time: its refill task (clone, set, run, probe; on a failure
//! or a cancellation it deletes the VM itself), or its deletion task. A VM handed to a build is
//! the build's executor's from its `Admitted` record on. The refill and the deletion run through
//! an [`AttemptExecutor`] of a stand-in build (the profile's image and resources, no steps, no
//! mounts): the same clone, boot, probe, deadline file and deletion as any build VM.

use super::core::{PoolWork, Shared, warm_deadline};
use crate::cluster::placement;
use crate::config::PoolConfig;
use crate::host::{AttemptExecutor, CancelHandle, ExecutorConfig, HostAttempt, Performed, Withdrawal, cancel_pair};
use crate::machine::{Action, DeleteContext, Event};
use crate::pool::WarmProfile;
use crate::record::BuildRef;
use k8s_openapi::jiff::Timestamp;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tartan_api::{MacBuildSpec, Reason, Resources};

/// How often the pool looks again without being woken (a warm VM's age counts towards `max_idle`).
const POOL_TICK: Duration = Duration::from_secs(5);

/// How long a failed round waits before the next (the journal could not be written).
const POOL_RETRY: Duration = Duration::from_secs(5);

/// A refill that failed waits this long before its profile is refilled again, doubled per
/// failure in a row up to [`REFILL_BACKOFF_MAX`].
const REFILL_BACKOFF: Duration = Duration::from_secs(30);
const REFILL_BACKOFF_MAX: Duration = Duration::from_secs(600);

/// What the pool's task remembers between rounds.
#[derive(Default)]
struct Memory {
    /// How to stop each refill under way.
    refills: BTreeMap<String, CancelHandle>,
    /// Profiles whose refills failed: failures in a row, and when the next may start.
    failing: Vec<(WarmProfile, u32, tokio::time::Instant)>,
}

type SharedMemory = Arc<Mutex<Memory>>;

fn memory(m: &Mutex<Memory>) -> std::sync::MutexGuard<'_, Memory> {
    // Each change is one insert or remove: the map is whole after any panic.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Starts the pool's task: it deletes warm VMs an earlier run left, and keeps `[pool]`'s VMs
/// warm (an image not on the host only with `prepull`); the Lease's facts get the ready images.
/// `held` is the host's images as last listed.
pub fn spawn(
    shared: Arc<Shared>,
    held: tokio::sync::watch::Receiver<Option<std::collections::BTreeSet<String>>>,
    published: tokio::sync::watch::Sender<BTreeMap<String, String>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mem: SharedMemory = Arc::default();
        loop {
            let below_floor = shared.disk.check().pressure.is_some();
            let spec = refillable(&shared.config.pool, held.borrow().as_ref(), &mem, below_floor);
            let wait = match shared
                .builds
                .pool_round(&spec, shared.config.slots, Timestamp::now())
                .await
            {
                Ok(work) => {
                    for w in work {
                        start(&shared, &mem, w);
                    }
                    POOL_TICK
                }
                Err(error) => {
                    tracing::error!(%error, "warm pool round not journaled; nothing of it is done, tried again in {POOL_RETRY:?}");
                    POOL_RETRY
                }
            };
            publish_warm_images(&shared, &published).await;
            tokio::select! {
                () = shared.builds.pool_changed().notified() => {}
                () = tokio::time::sleep(wait) => {}
            }
        }
    })
}

/// Puts the images with a ready warm VM on the Lease's facts when they changed.
async fn publish_warm_images(shared: &Shared, published: &tokio::sync::watch::Sender<BTreeMap<String, String>>) {
    let images = shared.builds.ready_warm_images().await;
    published.send_if_modified(|facts| {
        let value = (!images.is_empty()).then(|| placement::published(&images));
        let old = match &value {
            Some(v) => facts.insert(placement::WARM_ANNOTATION.to_string(), v.clone()),
            None => facts.remove(placement::WARM_ANNOTATION),
        };
        old != value
    });
}

/// The pool as configured, less the entries it may not refill now: an image not on the host
/// (unless `prepull`: the clone pulls it), a profile whose refills failed lately, or all of them
/// while the disk is below the floor (`below_floor`: no build is claimed to use them). Their
/// sizes become 0, so their VMs are kept but none is added.
fn refillable(
    pool: &PoolConfig,
    held: Option<&std::collections::BTreeSet<String>>,
    mem: &Mutex<Memory>,
    below_floor: bool,
) -> crate::pool::PoolSpec {
    let now = tokio::time::Instant::now();
    let mut spec = pool.spec.clone();
    let mem = memory(mem);
    for entry in &mut spec.entries {
        let local = placement::holds_image(&entry.profile.image, held) && held.is_some();
        let backing_off = mem
            .failing
            .iter()
            .any(|(p, _, until)| *p == entry.profile && now < *until);
        if (!local && !pool.prepull) || backing_off || below_floor {
            entry.size = 0;
        }
    }
    spec
}

/// Notes how a refill of `profile` ended: a failure delays its next refill, a success clears that.
fn note_refill(mem: &Mutex<Memory>, profile: &WarmProfile, ready: bool) {
    let mut mem = memory(mem);
    let failures = mem
        .failing
        .iter()
        .find(|(p, ..)| p == profile)
        .map_or(0, |(_, n, _)| *n);
    mem.failing.retain(|(p, ..)| p != profile);
    if !ready {
        let wait = REFILL_BACKOFF
            .saturating_mul(1 << failures.min(6))
            .min(REFILL_BACKOFF_MAX);
        tracing::warn!(image = %profile.image, retry_in = ?wait, "warm VM refill failed; this image is refilled again later");
        mem.failing
            .push((profile.clone(), failures + 1, tokio::time::Instant::now() + wait));
    }
}

/// Starts the I/O of one piece of work.
fn start(shared: &Arc<Shared>, mem: &SharedMemory, work: PoolWork) {
    match work {
        PoolWork::Refill {
            vm, profile, deadline, ..
        } => {
            let (handle, signal) = cancel_pair();
            memory(mem).refills.insert(vm.clone(), handle);
            let (shared, mem) = (Arc::clone(shared), Arc::clone(mem));
            tokio::spawn(async move {
                let mut exec = executor(&shared, &vm, &profile, deadline, signal);
                let ready = refill(&shared, &mut exec, &vm).await;
                memory(&mem).refills.remove(&vm);
                note_refill(&mem, &profile, ready);
            });
        }
        PoolWork::CancelRefill { vm } => {
            if let Some(handle) = memory(mem).refills.get(&vm) {
                tracing::info!(%vm, "warm VM still booting must go; stopping its refill");
                handle.cancel(Withdrawal::CancelRequested);
            }
        }
        PoolWork::Delete { vm } => {
            let shared = Arc::clone(shared);
            tokio::spawn(async move {
                let (_handle, signal) = cancel_pair();
                let stand_in = WarmProfile::new("", None, None);
                let mut exec = executor(&shared, &vm, &stand_in, Timestamp::MAX, signal);
                delete(&shared, &mut exec, &vm).await;
            });
        }
    }
}

/// Clones, sets, starts and probes `vm`, recording it ready (true); on a failure or a
/// cancellation it records why and deletes the VM (false).
async fn refill(shared: &Shared, exec: &mut AttemptExecutor, vm: &str) -> bool {
    let boot = [
        Action::WriteDeadlineFile {
            vm: vm.to_string(),
            deadline: exec.deadline(),
        },
        Action::CloneVm { vm: vm.to_string() },
        Action::SetVm { vm: vm.to_string() },
        Action::StartVm { vm: vm.to_string() },
        Action::ProbeReady { vm: vm.to_string() },
    ];
    let mut outcome = Err((Reason::VMStartFailed, "the boot ended without a probe".to_string()));
    for action in &boot {
        match exec.perform(action).await {
            Performed::Done | Performed::NotHost => continue,
            Performed::Event(Event::GuestReady { after }) => {
                // Idle from now on: its deadline file counts `max_idle` from its readiness.
                let deadline = warm_deadline(Timestamp::now(), shared.config.pool.spec.max_idle);
                let rewrite = Action::WriteDeadlineFile {
                    vm: vm.to_string(),
                    deadline,
                };
                outcome = match exec.perform(&rewrite).await {
                    Performed::Done => Ok((after, deadline)),
                    other => Err((
                        Reason::VMStartFailed,
                        format!("warm VM's deadline file not rewritten: {other:?}"),
                    )),
                };
            }
            Performed::Event(Event::VmStartFailed { error }) => {
                outcome = Err((Reason::VMStartFailed, format!("warm VM not ready: {error}")));
            }
            Performed::Event(Event::CancelRequested { .. } | Event::OwnerDeleted { .. }) => {
                let why = "stopped while booting: a build needs its slot, or the pool no longer asks for it";
                outcome = Err((Reason::Evicted, why.to_string()));
            }
            Performed::Event(other) => {
                outcome = Err((Reason::VMStartFailed, format!("warm VM not ready: {other:?}")));
            }
        }
        break;
    }
    let ready = outcome.is_ok();
    let cancelled = matches!(&outcome, Err((Reason::Evicted, _)));
    if let Err(error) = shared.builds.warm_booted(vm, outcome).await {
        tracing::error!(%vm, %error, "warm VM's boot not journaled; deleting it (the next start finds its records open)");
    } else if ready {
        tracing::info!(%vm, "warm VM ready");
        return true;
    }
    delete(shared, exec, vm).await;
    // A refill stopped for a build did not fail.
    cancelled
}

/// Stops and deletes `vm` and its deadline file, and records whether its deletion is confirmed.
/// Every tart process working on it is killed first: a clone of an earlier run that outlived its
/// agent would otherwise make the VM after its deletion, untracked and without a deadline file.
async fn delete(shared: &Shared, exec: &mut AttemptExecutor, vm: &str) {
    if let Err(error) = shared.tart.kill_vm_processes(vm).await {
        tracing::warn!(%vm, %error, "could not look for the warm VM's tart processes; deleting it anyway");
    }
    let outcome = match exec
        .perform(&Action::StopAndDeleteVm {
            vm: vm.to_string(),
            context: DeleteContext::Normal,
        })
        .await
    {
        Performed::Event(Event::VmDeleted { .. }) => {
            let _ = exec.perform(&Action::RemoveDeadlineFile { vm: vm.to_string() }).await;
            Ok(())
        }
        Performed::Event(Event::DeleteFailed { error, .. }) => Err(error),
        other => Err(format!("unexpected result of the deletion: {other:?}")),
    };
    if let Err(error) = &outcome {
        tracing::warn!(%vm, %error, "warm VM not deleted; its slot stays held and it is tried again");
    }
    if let Err(error) = shared.builds.warm_deleted(vm, outcome).await {
        tracing::error!(%vm, %error, "warm VM's deletion not journaled; the next start deletes it again");
    }
}

/// An executor for warm VM `vm` of `profile`: a stand-in build with the profile's image and
/// resources, no steps, no mounts, no environment.
fn executor(
    shared: &Shared,
    vm: &str,
    profile: &WarmProfile,
    deadline: Timestamp,
    signal: crate::host::CancelSignal,
) -> AttemptExecutor {
    let mut spec = MacBuildSpec::new(profile.image.clone(), Vec::new());
    spec.resources = Some(Resources {
        cpu: profile.cpu,
        memory_mib: profile.memory_mib,
    });
    spec.max_attempts = 1;
    let host = HostAttempt {
        build: BuildRef {
            namespace: String::new(),
            name: "warm-pool".to_string(),
            uid: String::new(),
        },
        attempt: 0,
        vm: vm.to_string(),
        deadline,
        spec,
        agent: shared.config.agent_id.clone(),
    };
    let cfg = ExecutorConfig {
        local_images: shared.config.local_images.clone(),
        detach_vm: shared.machine.resume_after_restart,
        network: shared.config.network.clone(),
        ..ExecutorConfig::new(&shared.config.state_dir)
    };
    AttemptExecutor::new(host, shared.tart.clone(), cfg, signal)
}
