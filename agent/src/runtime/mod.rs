//! `tartan-agent run`: the agent's life. Take the state-dir lock, replay the journal, recover,
//! then watch MacBuilds: claim what matches while a slot is free and the Lease is fresh, and
//! withdraw builds whose MacBuild asks for it.
//!
//! An unreachable API never stops a VM: builds already running go on; only new claims wait for
//! the Lease.
//!
//! This module owns the main loop and what only it keeps (the MacBuild view,
//! [`crate::cluster::view`], the Lease watch, when each build became claimable); per-build state
//! is [`core::Builds`]', slot reservations [`slots`]', a build's task [`build`]'s.

pub mod build;
pub mod core;
pub mod metrics;
pub mod recover;
pub mod slots;
pub mod warm_pool;
pub mod watchdog_tally;

use self::core::{Builds, Placed, Shared};
use crate::cluster::claim::claimable;
use crate::cluster::delivery::{Delivery, DeliveryConfig};
use crate::cluster::events::Events;
use crate::cluster::lease::{LeaseConfig, LeaseKeeper};
use crate::cluster::placement;
use crate::cluster::view::{MacBuildView, StrayReads};
use crate::config::Config;
use crate::host::disk::DiskFloor;
use crate::journal::{Journal, JournalOptions};
use crate::lock::StateLock;
use crate::machine;
use crate::record::BuildRef;
use crate::recovery::RecoveryAction;
use anyhow::Context;
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Api;
use kube::runtime::{WatchStreamExt, watcher};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tartan_api::MacBuild;
use tartan_tart::Tart;
use tokio::sync::Notify;

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
    // Each build holds descriptors (journal, deadline file, logs, tart's pipes), and launchd's soft
    // limit is 256 unless the plist says more.
    tartan_serve::raise_and_log_open_files_limit();
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
    // The Lease also carries what other agents' claim waits read (placement::claim_wait).
    let (held_tx, held) = tokio::sync::watch::channel(None);
    let (published_tx, published) = tokio::sync::watch::channel(placement::published_facts(
        &config.host_labels,
        &config.namespaces,
        u32::from(config.slots.min(2)),
    ));
    let tart = Tart::new(&config.tart, config.tart_home.clone());
    // Read once here, so the first Lease and the first scan already know the disk's state.
    let (disk, disk_pressure) = DiskFloor::new(
        config.state_dir.clone(),
        tart.home().map_err(|e| e.to_string()),
        config.disk.min_free_bytes,
    );
    let lease = LeaseKeeper::spawn_publishing(
        lease_client,
        LeaseConfig::from_config(&config),
        published,
        disk_pressure,
    );
    let delivery = Delivery::spawn(client.clone(), DeliveryConfig::from_config(&config));
    let events = Events::spawn(client.clone(), &config.agent_id, config.timing.api_timeout);
    let shared = Arc::new(Shared {
        machine: machine_config(&config),
        builds: Builds::new(journal),
        client: client.clone(),
        tart,
        delivery,
        events,
        api_server,
        recovery_waits: std::sync::Mutex::new(None),
        lease: lease.state(),
        started,
        fatal: tokio::sync::watch::Sender::new(None),
        disk,
        config,
    });

    let image_listing = tokio::spawn(list_images(shared.tart.clone(), held_tx, published_tx.clone()));
    recover::recover(&shared, replay.records).await?;
    let pool = warm_pool::spawn(Arc::clone(&shared), held.clone(), published_tx.clone());
    let metrics = metrics::serve(Arc::clone(&shared), lease.state()).await?;

    let changed = Arc::new(Notify::new());
    let view = MacBuildView::watch(&client, &shared.config.namespaces, &shared.config.agent_id, &changed);
    let (peers, peer_watch) = PeerLeases::watch(
        Api::namespaced(shared.client.clone(), &shared.config.lease_namespace),
        shared.config.agent_id.clone(),
    );

    let mut lease_changes = lease.state();
    let mut terminate = terminated()?;
    let mut fatal = shared.fatal.subscribe();
    // The first compaction comes one interval after the start, not at it: what recovery just
    // journaled stays readable (`tartan-agent journal`, the e2e checker) for a while.
    let every = shared.config.timing.compaction_interval;
    let mut compaction = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    compaction.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut claimable_since = BTreeMap::new();
    let mut strays = StrayReads::new(RESCAN);
    loop {
        // Made before the scan: a slot freed while it runs still wakes the loop after it
        // (`notify_waiters` reaches only the waits that exist when it is called).
        let slot_freed = shared.builds.slot_freed().notified();
        let mut builds = view.builds();
        let tasks = shared.builds.with_tasks().await;
        let api_timeout = shared.config.timing.api_timeout;
        builds.extend(strays.read(&shared.client, api_timeout, &tasks, &builds).await);
        let held_now = held.borrow().clone();
        let peers_now = peers.known();
        let next_due = scan(
            &shared,
            &builds,
            &lease,
            &mut claimable_since,
            held_now.as_ref(),
            peers_now.as_deref(),
        )
        .await;
        publish_free_slots(&shared, &published_tx).await;
        let rescan_at = tokio::time::Instant::now() + RESCAN;
        let wake_at = next_due.map_or(rescan_at, |due| due.min(rescan_at));
        tokio::select! {
            _ = changed.notified() => {}
            _ = slot_freed => {}
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
            Ok(()) = fatal.changed() => break,
        }
    }
    let fault = fatal.borrow().clone();
    // Builds keep running in their VMs; the journal says where each stands, and the next start
    // recovers them. The Lease stops being renewed, which tells the controller.
    if shared.machine.resume_after_restart {
        shared.detach_and_hold().await;
    }
    tracing::info!("agent stopping; running builds are recovered at the next start");
    drop(view);
    peer_watch.abort();
    metrics.abort();
    image_listing.abort();
    pool.abort();
    lease.stop();
    match fault {
        // Non-zero, so that launchd (and whoever reads its log) knows this was no clean stop.
        Some(why) => Err(anyhow::anyhow!(
            "{why}; the agent stops so that launchd starts it again, and recovery at that start deletes the VM of \
             the attempt it interrupted"
        )),
        None => Ok(()),
    }
}

/// Puts the free slots on the Lease's facts (for other agents' claim waits) when they changed.
async fn publish_free_slots(shared: &Shared, published: &tokio::sync::watch::Sender<BTreeMap<String, String>>) {
    let free = shared.builds.claimable_slots(shared.config.slots).await;
    published.send_if_modified(|facts| {
        let value = free.to_string();
        let old = facts.insert(placement::FREE_SLOTS_ANNOTATION.to_string(), value.clone());
        old.as_deref() != Some(value.as_str())
    });
}

/// The agents' Leases (label `tartan.dev/agent`) in the Lease namespace, as the watch last
/// delivered them: what [`placement::claim_wait`] reads about the other agents. `None` until
/// listed, after a watch failure until it delivers again, and while the fleet is larger than
/// [`placement::MAX_WATCHED_PEERS`]: every agent's renewal is an event for every other, and there
/// the claim waits stay as they were.
#[derive(Clone, Default)]
struct PeerLeases {
    known: Arc<std::sync::Mutex<Option<Vec<placement::Peer>>>>,
}

/// How long an agent in a large fleet goes without the Lease watch before it lists again.
const LARGE_FLEET_RECHECK: Duration = Duration::from_secs(60);

impl PeerLeases {
    /// The watch and the task that keeps it.
    fn watch(leases: Api<Lease>, me: String) -> (PeerLeases, tokio::task::JoinHandle<()>) {
        let peers = PeerLeases::default();
        let known = Arc::clone(&peers.known);
        let task = tokio::spawn(async move {
            let set = |v: Option<Vec<placement::Peer>>| *known.lock().unwrap_or_else(|e| e.into_inner()) = v;
            let mut failures = 0u64;
            loop {
                let config = watcher::Config::default().labels(tartan_api::AGENT_LABEL);
                let stream = watcher(leases.clone(), config).default_backoff();
                let mut stream = std::pin::pin!(stream);
                let (mut by_name, mut listing) = (BTreeMap::<String, placement::Peer>::new(), None);
                let mut listed = false;
                while let Some(event) = stream.next().await {
                    let name = |l: &Lease| l.metadata.name.clone().unwrap_or_default();
                    match event {
                        Ok(watcher::Event::Init) => listing = Some(BTreeMap::new()),
                        Ok(watcher::Event::InitApply(l)) => {
                            if let (Some(map), Some(p)) = (listing.as_mut(), placement::peer_of(&l)) {
                                map.insert(name(&l), p);
                            }
                        }
                        Ok(watcher::Event::InitDone) => {
                            by_name = listing.take().unwrap_or_default();
                            listed = true;
                        }
                        Ok(watcher::Event::Apply(l)) => match placement::peer_of(&l) {
                            Some(p) => drop(by_name.insert(name(&l), p)),
                            None => drop(by_name.remove(&name(&l))),
                        },
                        Ok(watcher::Event::Delete(l)) => drop(by_name.remove(&name(&l))),
                        Err(error) => {
                            set(None);
                            failures += 1;
                            // Logged at the first failure and every 100th (the watch retries with
                            // backoff; without list/watch on Leases it fails for good).
                            if failures % 100 == 1 {
                                tracing::warn!(
                                    %error,
                                    failures,
                                    "watching the agents' Leases failed; claims wait their full claim_spread and \
                                     uncached_claim_delay until it works again (it restarts with backoff; the \
                                     agent's Role needs list and watch on leases, docs/upgrading.md)"
                                );
                            }
                            continue;
                        }
                    }
                    // (A resumed watch delivers what it missed first: known again.)
                    if !listed {
                        continue;
                    }
                    let all: Vec<placement::Peer> = by_name.values().cloned().collect();
                    if placement::too_many_peers(&all, &me, Timestamp::now()) {
                        break;
                    }
                    set(Some(all));
                }
                // A large fleet (or a stream that ended): no watch for a while, then list again.
                set(None);
                tracing::debug!(
                    "more than {} other live agents: claims wait as configured; the Leases are listed again in {LARGE_FLEET_RECHECK:?}",
                    placement::MAX_WATCHED_PEERS
                );
                tokio::time::sleep(LARGE_FLEET_RECHECK).await;
            }
        });
        (peers, task)
    }

    /// The agents as their Leases say (this one's included); `None` when not known.
    fn known(&self) -> Option<Vec<placement::Peer>> {
        self.known.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Removes step logs past the `[logs]` limits, never those of attempts the journal still has open.
async fn prune_logs(shared: &Shared) {
    let keep = shared.builds.open_vms().await;
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
    for (vm, slot) in shared.builds.unknown_vms().await {
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
        let seq = shared.builds.next_seq().await;
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
    published: tokio::sync::watch::Sender<BTreeMap<String, String>>,
) {
    loop {
        match tart.list().await {
            Ok(entries) => {
                let images = placement::images_of(&entries, tartan_api::VM_PREFIX);
                let value = placement::published(&images);
                published.send_modify(|facts| {
                    facts.insert(placement::IMAGES_ANNOTATION.to_string(), value);
                });
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

/// Gives the answer owed for a claim that landed late: its attempt's last status again (delivery
/// retries it), and the finalizer's removal, in a task of its own.
fn answer_late_claim(shared: &Arc<Shared>, answer: core::LateClaimAnswer) {
    tracing::warn!(
        build = %answer.build,
        seq = answer.seq,
        "a claim whose answer never came landed after all; telling the MacBuild that nothing was cloned and releasing it"
    );
    shared
        .delivery
        .submit_after_late_claim(&answer.build, answer.status, answer.seq);
    let shared = shared.clone();
    tokio::spawn(async move { build::release_finalizer(&shared, &answer.build).await });
}

/// One look at every MacBuild: withdraw what asks for it, claim what matches once this agent's
/// wait for it is over ([`placement::claim_wait`] given the other agents' Leases `peers`, counted
/// from when it was first seen claimable, in `claimable_since`). Returns when the next waiting
/// build comes due.
async fn scan(
    shared: &Arc<Shared>,
    builds: &[Arc<MacBuild>],
    lease: &LeaseKeeper,
    claimable_since: &mut BTreeMap<String, tokio::time::Instant>,
    held: Option<&std::collections::BTreeSet<String>>,
    peers: Option<&[placement::Peer]>,
) -> Option<tokio::time::Instant> {
    let now = tokio::time::Instant::now();
    let leases_judged_at = peers.map_or_else(k8s_openapi::jiff::Timestamp::now, |peers| {
        placement::liveness_reference(peers, k8s_openapi::jiff::Timestamp::now())
    });
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
    // Read every scan (cached for a moment), so the Lease annotation and the log follow the disk
    // even with nothing to claim.
    shared.disk.check();
    // One pass under one lock: withdraw what asks for it, drop what this agent has or had, and
    // what it may not claim.
    let picked = shared
        .builds
        .withdraw_or_pick_new(builds, &shared.config.agent_id)
        .await;
    for answer in picked.late_answers {
        answer_late_claim(shared, answer);
    }
    let candidates: Vec<&Arc<MacBuild>> = picked
        .new
        .into_iter()
        .filter(|mb| claimable(mb, &shared.config.host_labels, &shared.config.namespaces).is_ok())
        .collect();
    // When each build comes due for this agent: first seen claimable, plus its wait.
    let warm = shared.builds.ready_warm_profiles().await;
    let due_of = |mb: &MacBuild| {
        let uid = mb.metadata.uid.as_deref().unwrap_or_default();
        let since = claimable_since.get(uid).copied().unwrap_or(now);
        let holding = if warm.iter().any(|w| w.serves(&mb.spec)) {
            placement::Holding::Warm
        } else if placement::holds_image(&mb.spec.image, held) {
            placement::Holding::Cached
        } else {
            placement::Holding::Uncached
        };
        let wait =
            placement::claim_wait_holding(mb, &shared.config.agent_id, holding, peers, leases_judged_at, &timing);
        since + wait
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
        // Another task may have started it since the pass above.
        if !shared.builds.is_new(&uid).await {
            continue;
        }
        still_claimable.insert(uid.clone());
        // `due` counted from `now` for a build not seen claimable before: the same instant.
        claimable_since.entry(uid.clone()).or_insert(now);
        if due > now {
            next_due = Some(next_due.map_or(due, |n| n.min(due)));
            continue;
        }
        // A build this agent holds that waits for a slot comes first (`wait_for_slot`).
        if !slots_left || !writable || !lease.can_claim() || shared.builds.held_build_waits() {
            continue;
        }
        if disk_floor_holds_back(shared, mb).await {
            continue;
        }
        let Placed::Reserved(reservation) = shared.builds.place(&uid, shared.config.slots, &mb.spec).await else {
            // No slot (or one a warm VM gives up for this build once deleted): nothing more is
            // claimed in this round (the waits of the rest still count).
            slots_left = false;
            continue;
        };
        let mb = MacBuild::clone(mb);
        let shared = Arc::clone(shared);
        let cancel = build::register(&shared, &uid).await;
        build::spawn_supervised(shared, BuildRef::of(&mb), cancel, move |shared, cancel| async move {
            let first = crate::cluster::claim::first_attempt_number(&mb);
            let mut task = build::BuildTask::new(cancel);
            let rest = build::claim_and_run(&shared, &mb, first, None, reservation, &mut task).await;
            build::follow_retries(shared, BuildRef::of(&mb), rest, task).await;
        });
    }
    // A build claimed, finished or gone starts a new wait if it ever becomes claimable again.
    claimable_since.retain(|uid, _| still_claimable.contains(uid));
    shared.builds.retain_waiting(&still_claimable).await;
    shared.disk.retain_waiting(&still_claimable);
    next_due
}

/// The disk floor's gate before a claim: true (claim nothing) while the state dir's or tart's
/// filesystem has less free space than `[disk] min_free_gib`. A build this agent would take now
/// (a slot is free) gets one Warning Event saying so per pressure; running builds are not touched.
async fn disk_floor_holds_back(shared: &Shared, mb: &MacBuild) -> bool {
    let Some(pressure) = shared.disk.check().pressure else {
        return false;
    };
    let uid = mb.metadata.uid.as_deref().unwrap_or_default();
    let slot_free = shared.builds.has_free_slot(shared.config.slots).await;
    if slot_free && shared.disk.first_wait(uid) {
        let build = BuildRef::of(mb);
        tracing::info!(build = %build, "not claimed: {}", pressure.describe());
        shared.events.disk_pressure(&build, &shared.config.agent_id, &pressure);
    }
    true
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
