//! `tartan-agent run`: the agent's life. Take the state-dir lock, replay the journal, recover,
//! then watch MacBuilds: claim what matches while a slot is free and the Lease is fresh, and
//! withdraw builds whose MacBuild asks for it.
//!
//! An unreachable API never stops a VM: builds already running go on; only new claims wait for
//! the Lease.

pub mod build;
pub mod core;
pub mod metrics;
pub mod recover;

use self::core::{Core, Shared};
use crate::cluster::claim::claimable;
use crate::cluster::delivery::{Delivery, DeliveryConfig};
use crate::cluster::events::Events;
use crate::cluster::lease::{LeaseConfig, LeaseKeeper};
use crate::cluster::placement;
use crate::config::Config;
use crate::journal::{Journal, JournalOptions};
use crate::lock::StateLock;
use crate::machine;
use crate::record::BuildRef;
use crate::recovery::RecoveryAction;
use anyhow::Context;
use futures::StreamExt;
use k8s_openapi::jiff::SignedDuration;
use kube::Api;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tartan_api::MacBuild;
use tartan_tart::Tart;
use tokio::sync::{Mutex, Notify};

/// How often the agent looks again at every MacBuild when nothing happened. Changes wake the scan
/// at once (a watch event, a freed slot, a Lease renewal or failure); this catches what has no
/// event: a quarantined VM removed by an operator, a journal writable again.
const RESCAN: Duration = Duration::from_secs(5);

/// The machine's configuration from the agent's.
pub fn machine_config(config: &Config) -> machine::Config {
    machine::Config {
        slots: config.slots,
        retry_min_remaining: SignedDuration::try_from(config.timing.retry_min_window)
            .unwrap_or(SignedDuration::from_secs(120)),
        watchdog_grace: SignedDuration::try_from(config.timing.watchdog_grace).unwrap_or(SignedDuration::from_secs(60)),
        resume_after_restart: config.on_restart == crate::config::OnRestart::Resume,
        ..machine::Config::default()
    }
}

/// Runs the agent until SIGTERM/SIGINT. Errors at start (lock held, damaged journal of a newer
/// version, cluster unreachable during recovery) end the process; launchd restarts it.
pub async fn run(config: Config) -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    std::fs::create_dir_all(&config.state_dir)
        .with_context(|| format!("creating the state directory {}", config.state_dir.display()))?;
    let lock = StateLock::acquire(&config.state_dir)?;
    let (journal, replay) = Journal::open(&lock, JournalOptions::default())
        .with_context(|| format!("opening the journal in {}", config.state_dir.display()))?;
    for warning in &replay.warnings {
        tracing::warn!(target: "journal", "{warning}");
    }
    tracing::info!(
        agent = %config.agent_id,
        records = replay.records.len(),
        next_seq = journal.next_seq(),
        slots = config.slots,
        "agent starting"
    );

    let (client, api_server) = crate::cluster::client(&config).await?;
    // The Lease has a client (and connections) of its own: its renewal never waits in line behind
    // the agent's other requests on a shared connection.
    let (lease_client, _) = crate::cluster::client(&config).await?;
    // What the host holds: listed by a task, published on the Lease, consulted by every claim.
    let (held_tx, held) = tokio::sync::watch::channel(None);
    let (published_tx, published) = tokio::sync::watch::channel(None);
    let lease = LeaseKeeper::spawn_publishing(lease_client, LeaseConfig::from_config(&config), published);
    let delivery = Delivery::spawn(client.clone(), DeliveryConfig::from_config(&config));
    let events = Events::spawn(client.clone(), &config.agent_id, config.timing.api_timeout);
    let tart = Tart::new(&config.tart, config.tart_home.clone());
    let shared = Arc::new(Shared {
        machine: machine_config(&config),
        core: Mutex::new(Core::new(journal)),
        client: client.clone(),
        tart,
        delivery,
        events,
        slot_freed: Notify::new(),
        api_server,
        recovery_waits: std::sync::Mutex::new(None),
        lease: lease.state(),
        started,
        config,
    });

    let image_listing = tokio::spawn(list_images(shared.tart.clone(), held_tx, published_tx));
    recover::recover(&shared, replay.records).await?;
    let metrics = metrics::serve(Arc::clone(&shared), lease.state()).await?;

    // One watch per configured namespace, so that a namespaced Role is enough for an agent (a
    // cluster-wide list needs a ClusterRole); all namespaces only when none are configured.
    let apis: Vec<Api<MacBuild>> = if shared.config.namespaces.is_empty() {
        vec![Api::all(client)]
    } else {
        shared
            .config
            .namespaces
            .iter()
            .map(|ns| Api::namespaced(client.clone(), ns))
            .collect()
    };
    let changed = Arc::new(Notify::new());
    let (readers, watch_tasks): (Vec<_>, Vec<_>) = apis
        .into_iter()
        .map(|api| watch_macbuilds(api, Arc::clone(&changed)))
        .unzip();

    let mut lease_changes = lease.state();
    let mut terminate = terminated()?;
    // The first compaction comes one interval after the start, not at it: what recovery just
    // journaled stays readable (`tartan-agent journal`, the e2e checker) for a while.
    let every = shared.config.timing.compaction_interval;
    let mut compaction = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    compaction.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut claimable_since = BTreeMap::new();
    loop {
        let view: Vec<Arc<MacBuild>> = readers.iter().flat_map(|r| r.state()).collect();
        let held_now = held.borrow().clone();
        let next_due = scan(&shared, &view, &lease, &mut claimable_since, held_now.as_ref()).await;
        let rescan_at = tokio::time::Instant::now() + RESCAN;
        let wake_at = next_due.map_or(rescan_at, |due| due.min(rescan_at));
        tokio::select! {
            _ = changed.notified() => {}
            _ = shared.slot_freed.notified() => {}
            // (A keeper that ended changes nothing more: not a reason to scan.)
            Ok(()) = lease_changes.changed() => {}
            _ = tokio::time::sleep_until(wake_at) => {}
            _ = compaction.tick() => {
                if let Err(error) = shared.compact_journal().await {
                    tracing::warn!(target: "journal", %error, "compaction failed; the journal is unchanged and is compacted again later");
                }
                prune_logs(&shared).await;
            }
            _ = &mut terminate => break,
        }
    }
    // Builds keep running in their VMs; the journal says where each stands, and the next start
    // recovers them. The Lease stops being renewed, which tells the controller.
    if shared.machine.resume_after_restart {
        detach(&shared).await;
    }
    tracing::info!("agent stopping; running builds are recovered at the next start");
    for task in &watch_tasks {
        task.abort();
    }
    metrics.abort();
    image_listing.abort();
    lease.stop();
    Ok(())
}

/// Journals `Detach` for every attempt that is booting, running or collecting, then keeps the
/// core locked until the process exits, so no task records anything after it: the VMs and the
/// steps' guest jobs run on, and the next start resumes them (`on_restart = "resume"`).
async fn detach(shared: &Shared) {
    let mut core = shared.core.lock().await;
    let open: Vec<machine::Attempt> = core
        .attempts
        .values()
        .filter(|a| {
            use tartan_api::AttemptState as S;
            matches!(a.state, S::Booting | S::Running | S::Collecting)
        })
        .cloned()
        .collect();
    for mut a in open {
        let now = k8s_openapi::jiff::Timestamp::now();
        let t = match machine::step(&a, machine::Event::Detach, now, &shared.machine) {
            Ok(t) => t,
            Err(refusal) => {
                tracing::error!(attempt = %a.key(), %refusal, "not detached; recovered as found at the next start");
                continue;
            }
        };
        let mut record = a.record(&t, core.journal.next_seq());
        match tokio::task::block_in_place(|| core.journal.append(&mut record)) {
            Ok(_) => {
                tracing::info!(target: "journal", "{record}");
                a.observe(&record);
                core.attempts.insert(a.key(), a);
            }
            Err(error) => {
                tracing::error!(attempt = %a.key(), %error, "detach not journaled; the next start recovers the attempt as found")
            }
        }
    }
    // Held until the process exits: a task finishing a step now must not journal past the detach.
    std::mem::forget(core);
}

/// A reflector over `api`'s MacBuilds, kept up to date by a task that notifies `changed` on
/// every change; the store and the task.
fn watch_macbuilds(
    api: Api<MacBuild>,
    changed: Arc<Notify>,
) -> (reflector::Store<MacBuild>, tokio::task::JoinHandle<()>) {
    let (reader, writer) = reflector::store();
    let stream = reflector(writer, watcher(api, watcher::Config::default()))
        .default_backoff()
        .touched_objects();
    let task = tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            match event {
                Ok(_) => changed.notify_one(),
                Err(error) => tracing::warn!(%error, "MacBuild watch failed; it restarts with backoff"),
            }
        }
    });
    (reader, task)
}

/// Removes step logs past the `[logs]` limits, never those of attempts the journal still has open.
async fn prune_logs(shared: &Shared) {
    let core = shared.core.lock().await;
    let open = core
        .attempts
        .values()
        .filter(|a| a.state != tartan_api::AttemptState::Retired);
    let keep: std::collections::BTreeSet<String> = open.map(|a| a.vm.clone()).collect();
    drop(core);
    let (state, limits) = (shared.config.state_dir.clone(), shared.config.logs.clone());
    let now = std::time::SystemTime::now();
    match tokio::task::spawn_blocking(move || crate::host::logs::prune(&state, &keep, now, &limits)).await {
        Ok(p) => {
            if !p.removed.is_empty() {
                tracing::info!(removed = ?p.removed, freed_bytes = p.freed, "old step logs removed");
            }
            for error in p.errors {
                tracing::warn!(%error, "step logs not pruned; tried again at the next compaction");
            }
        }
        Err(error) => tracing::warn!(%error, "step log pruning task failed; tried again at the next compaction"),
    }
}

/// Releases the slot of every quarantined unknown VM an operator has removed.
async fn resolve_unknown_vms(shared: &Shared) {
    let unknown: Vec<(String, Option<u8>)> = shared
        .core
        .lock()
        .await
        .unknown
        .iter()
        .map(|(vm, slot)| (vm.clone(), *slot))
        .collect();
    for (vm, slot) in unknown {
        let gone = match shared.tart.vm_dir(&vm) {
            Ok(dir) => matches!(std::fs::symlink_metadata(&dir), Err(e) if e.kind() == std::io::ErrorKind::NotFound),
            Err(error) => {
                tracing::warn!(%vm, %error, "cannot locate the quarantined VM's folder");
                false
            }
        };
        if !gone {
            continue;
        }
        let action = RecoveryAction::ResolveUnknownVm { vm: vm.clone(), slot };
        let seq = shared.core.lock().await.journal.next_seq();
        if let Some(record) = action.record(seq, k8s_openapi::jiff::Timestamp::now())
            && let Err(error) = shared.journal_unknown(record).await
        {
            tracing::error!(%vm, %error, "could not journal the unknown VM's removal; its slot stays blocked");
        }
    }
}

/// How often the host's images are listed (`tart list`) for claims and the Lease annotation.
const IMAGE_LISTING: Duration = Duration::from_secs(30);

/// Lists the host's images now and every [`IMAGE_LISTING`]: the set for claiming into `held`, the
/// bounded annotation value into `published`. A failed listing keeps the last list.
async fn list_images(
    tart: Tart,
    held: tokio::sync::watch::Sender<Option<std::collections::BTreeSet<String>>>,
    published: tokio::sync::watch::Sender<Option<String>>,
) {
    loop {
        match tart.list().await {
            Ok(entries) => {
                let images = placement::images_of(&entries, tartan_api::VM_PREFIX);
                published.send_replace(Some(placement::published(&images)));
                held.send_replace(Some(images.into_iter().collect()));
            }
            Err(error) => tracing::warn!(
                %error,
                "listing the host's images (tart list) failed; claims and the Lease keep the last list, it is listed again in {IMAGE_LISTING:?}"
            ),
        }
        tokio::time::sleep(IMAGE_LISTING).await;
    }
}

/// One look at every MacBuild: withdraw what asks for it, claim what matches once this agent's
/// wait for it is over ([`placement::claim_delay`], counted from when it was first seen
/// claimable, in `claimable_since`). Returns when the next waiting build comes due.
async fn scan(
    shared: &Arc<Shared>,
    builds: &[Arc<MacBuild>],
    lease: &LeaseKeeper,
    claimable_since: &mut BTreeMap<String, tokio::time::Instant>,
    held: Option<&std::collections::BTreeSet<String>>,
) -> Option<tokio::time::Instant> {
    let now = tokio::time::Instant::now();
    let timing = placement::ClaimTiming {
        spread: shared.config.timing.claim_spread,
        uncached: shared.config.timing.uncached_claim_delay,
    };
    let mut next_due: Option<tokio::time::Instant> = None;
    let mut still_claimable = std::collections::BTreeSet::new();
    // Claims and unknown-VM resolutions begin with a journal write: none while the journal fails
    // (it retries the disk with backoff here; withdrawals still go out).
    let writable = shared.journal_writable().await;
    if writable {
        resolve_unknown_vms(shared).await;
    }
    // One pass under one lock: withdraw what asks for it, drop what this agent has or had, and
    // what it may not claim.
    let candidates: Vec<&Arc<MacBuild>> = {
        let core = shared.core.lock().await;
        builds
            .iter()
            .filter(|mb| {
                let Some(uid) = mb.metadata.uid.as_deref() else {
                    return false;
                };
                if let Some(handle) = core.active.get(uid) {
                    if let Some(why) = build::withdrawal_of(mb) {
                        handle.cancel(why);
                    }
                    return false;
                }
                !core.has_open_attempt(uid) && !core.finished_here(uid)
            })
            .filter(|mb| claimable(mb, &shared.config.host_labels, &shared.config.namespaces).is_ok())
            .collect()
    };
    // When each build comes due for this agent: first seen claimable, plus its wait.
    let due_of = |mb: &MacBuild| {
        let uid = mb.metadata.uid.as_deref().unwrap_or_default();
        let since = claimable_since.get(uid).copied().unwrap_or(now);
        let holds = placement::holds_image(&mb.spec.image, held);
        since + placement::claim_delay(uid, &shared.config.agent_id, holds, &timing)
    };
    let mut order: Vec<(tokio::time::Instant, &Arc<MacBuild>)> =
        candidates.into_iter().map(|mb| (due_of(mb), mb)).collect();
    // Earliest due first: the queue stays fair (what waited longer comes first), and builds seen
    // together are taken in this agent's own rendezvous order, so free agents facing a backlog go
    // for different builds instead of all for the oldest. Creation time breaks ties.
    order.sort_by(|(da, a), (db, b)| {
        da.cmp(db).then_with(|| {
            a.metadata
                .creation_timestamp
                .as_ref()
                .map(|t| t.0)
                .cmp(&b.metadata.creation_timestamp.as_ref().map(|t| t.0))
        })
    });
    let mut slots_left = true;
    for (due, mb) in order {
        let Some(uid) = mb.metadata.uid.clone() else { continue };
        {
            // Another task may have started it while this scan was not holding the lock.
            let core = shared.core.lock().await;
            if core.active.contains_key(&uid) || core.has_open_attempt(&uid) || core.finished_here(&uid) {
                continue;
            }
        }
        still_claimable.insert(uid.clone());
        // `due` counted from `now` for a build not seen claimable before: the same instant.
        claimable_since.entry(uid.clone()).or_insert(now);
        if due > now {
            next_due = Some(next_due.map_or(due, |n| n.min(due)));
            continue;
        }
        if !slots_left || !writable || !lease.can_claim() {
            continue;
        }
        let slot = shared.core.lock().await.reserve_slot(&uid, shared.config.slots);
        let Some(slot) = slot else {
            // No slot: nothing more is claimed in this round (the waits of the rest still count).
            slots_left = false;
            continue;
        };
        let mb = MacBuild::clone(mb);
        let shared = Arc::clone(shared);
        let cancel = build::register(&shared, &uid).await;
        build::spawn_supervised(shared, BuildRef::of(&mb), cancel, move |shared, cancel| async move {
            let first = crate::cluster::claim::first_attempt_number(&mb);
            let rest = build::claim_and_run(&shared, &mb, first, None, slot, &cancel).await;
            build::follow_retries(shared, BuildRef::of(&mb), rest, cancel).await;
        });
    }
    // A build claimed, finished or gone starts a new wait if it ever becomes claimable again.
    claimable_since.retain(|uid, _| still_claimable.contains(uid));
    next_due
}

/// Resolves on SIGTERM (launchd's stop) or SIGINT.
fn terminated() -> anyhow::Result<std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    Ok(Box::pin(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    }))
}
