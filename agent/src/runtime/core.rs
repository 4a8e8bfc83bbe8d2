//! The agent's shared state: the journal, what it says about every attempt, and the slot table.
//!
//! One rule holds everything together: a transition is journaled (synced) before anyone acts on
//! it, and only then is the cluster told. [`Shared::journal`] is that one place.

use crate::cluster::delivery::DeliveryHandle;
use crate::cluster::events::Events;
use crate::config::Config;
use crate::host::CancelHandle;
use crate::journal::Journal;
use crate::machine::{self, Attempt, AttemptKey, SlotHolder, Transition, attempt_holders, decide_retry, free_slot};
use crate::record::{BuildRef, Record};
use crate::status::{Reporter, next_status, snapshot_is_journaled};
use std::collections::{BTreeMap, BTreeSet};
use tartan_api::{AttemptState, BuildResults, MacBuildStatus, Outcome, Reason};
use tartan_tart::Tart;
use tokio::sync::{Mutex, Notify};

/// Everything behind the one lock.
pub struct Core {
    pub journal: Journal,
    /// Every attempt the journal knows, as of its last record.
    pub attempts: BTreeMap<AttemptKey, Attempt>,
    /// The last status snapshot of each build (by uid), the base of the next one.
    pub statuses: BTreeMap<String, MacBuildStatus>,
    /// The claim epoch this agent holds on each build (by uid).
    pub epochs: BTreeMap<String, u64>,
    /// Quarantined VMs with the prefix and no attempt: they block a slot until an operator
    /// removes them (vm → slot, if one was recorded).
    pub unknown: BTreeMap<String, Option<u8>>,
    /// Slots promised to a build before its `Admitted` record (a claim in flight, or the next
    /// attempt of an interrupted build), by uid.
    pub reserved: BTreeMap<String, u8>,
    /// Builds with a task on this agent (by uid), and how to withdraw them.
    pub active: BTreeMap<String, CancelHandle>,
    /// `status.journalSeq` each MacBuild showed at agent start (by uid): what earlier runs of
    /// the agent delivered.
    pub delivered_before: BTreeMap<String, u64>,
    /// Builds finished here whose records compaction dropped (by uid): the journal no longer
    /// names them, and they must still never be claimed again.
    pub compacted: BTreeSet<String>,
    /// Finished builds whose finalizer could not be removed (by uid): compaction keeps their
    /// records, so that the next agent start removes it.
    pub finalizer_owed: BTreeSet<String>,
}

impl Core {
    /// A core over `journal` with nothing known yet: recovery fills it in.
    pub fn new(journal: Journal) -> Core {
        Core {
            journal,
            attempts: BTreeMap::new(),
            statuses: BTreeMap::new(),
            epochs: BTreeMap::new(),
            unknown: BTreeMap::new(),
            reserved: BTreeMap::new(),
            active: BTreeMap::new(),
            delivered_before: BTreeMap::new(),
            compacted: Default::default(),
            finalizer_owed: Default::default(),
        }
    }

    /// Who holds a slot now: open attempts, quarantined unknown VMs and reservations.
    pub fn slot_holders(&self) -> Vec<SlotHolder> {
        let mut holders = attempt_holders(self.attempts.values());
        holders.extend(
            self.unknown
                .values()
                .map(|slot| slot.map_or(SlotHolder::Unnumbered, SlotHolder::Slot)),
        );
        holders.extend(self.reserved.values().map(|&s| SlotHolder::Slot(s)));
        holders
    }

    /// Reserves a free slot for `uid` (or returns the one it already has).
    pub fn reserve_slot(&mut self, uid: &str, slots: u8) -> Option<u8> {
        if let Some(&slot) = self.reserved.get(uid) {
            return Some(slot);
        }
        let slot = free_slot(slots, &self.slot_holders())?;
        self.reserved.insert(uid.to_string(), slot);
        Some(slot)
    }

    /// The attempt of `build` with the highest number, if any.
    pub fn latest_attempt(&self, uid: &str) -> Option<&Attempt> {
        self.attempts
            .values()
            .filter(|a| a.build.uid == uid)
            .max_by_key(|a| a.number)
    }

    /// Whether the journal says this agent finished `uid`: its last attempt is retired with an
    /// outcome (a lost claim has none) and no task follows it. Such a build is only ever
    /// redelivered, never claimed, admitted or cloned again, whatever a cached MacBuild says.
    pub fn finished_here(&self, uid: &str) -> bool {
        self.compacted.contains(uid)
            || self
                .latest_attempt(uid)
                .is_some_and(|a| a.state == AttemptState::Retired && a.outcome.is_some())
    }

    /// Whether this agent still has anything to do for `uid` (an attempt not yet retired).
    pub fn has_open_attempt(&self, uid: &str) -> bool {
        self.attempts
            .values()
            .any(|a| a.build.uid == uid && a.state != AttemptState::Retired)
    }
}

/// What every task of the agent shares.
pub struct Shared {
    pub config: Config,
    pub machine: machine::Config,
    pub core: Mutex<Core>,
    pub client: kube::Client,
    pub tart: Tart,
    pub delivery: DeliveryHandle,
    pub events: Events,
    /// Signalled whenever a slot may have become free.
    pub slot_freed: Notify,
    /// The API server's URL, for log lines.
    pub api_server: String,
    /// Why recovery still waits for the cluster (it could not be read at start), if it does.
    pub recovery_waits: std::sync::Mutex<Option<String>>,
    /// The Lease keeper's state: a resumed attempt waits for a live Lease before it goes on.
    pub lease: tokio::sync::watch::Receiver<crate::cluster::lease::LeaseState>,
    /// When this agent process started (resume records say how long re-attaching took).
    pub started: std::time::Instant,
}

impl Shared {
    /// Journals `t` for `attempt` (synced), records the status snapshot it implies, then hands the
    /// snapshot to status delivery and the record to Events. Returns the record; on `Err` nothing
    /// of `t` may be performed (the journal failed closed).
    pub async fn journal(
        &self,
        attempt: &Attempt,
        t: &Transition,
        results: Option<&BuildResults>,
        generation: Option<i64>,
        logs: Option<&str>,
    ) -> Result<Record, String> {
        let uid = attempt.build.uid.clone();
        let mut core = self.core.lock().await;
        let seq = core.journal.next_seq();
        let mut record = attempt.record(t, seq);
        let mut after = attempt.clone();
        after.observe(&record);
        let retry_follows =
            after.outcome == Some(Outcome::Interrupted) && decide_retry(&after, t.at, &self.machine).is_ok();
        let epoch = core
            .epochs
            .get(&uid)
            .copied()
            .or_else(|| core.statuses.get(&uid).and_then(|s| s.claim.as_ref()).map(|c| c.epoch))
            .unwrap_or(1);
        let previous = core.statuses.get(&uid).cloned().unwrap_or_default();
        let snapshot = next_status(
            &previous,
            &after,
            &record,
            &Reporter {
                holder: &self.config.agent_id,
                epoch,
                results,
                retry_follows,
                generation,
                logs,
            },
        );
        if snapshot_is_journaled(&record) {
            record.status = Some(serde_json::to_value(&snapshot).map_err(|e| format!("encoding status: {e}"))?);
        }
        let written = tokio::task::block_in_place(|| core.journal.append(&mut record))
            .map_err(|e| format!("{e}; the transition is not recorded and nothing of it is done"))?;
        // The journal numbers a record with its `next_seq` (a failed append's number is reused).
        debug_assert_eq!(written, seq, "the journal numbered the record unexpectedly");
        tracing::info!(target: "journal", "{record}");
        core.attempts.insert(after.key(), after.clone());
        core.statuses.insert(uid.clone(), snapshot.clone());
        match record.to {
            AttemptState::Admitted => {
                core.reserved.remove(&uid);
            }
            // The slot passes straight to the next attempt, ahead of any other build.
            AttemptState::Retired if retry_follows => {
                if let Some(slot) = record.slot {
                    core.reserved.insert(uid.clone(), slot);
                }
            }
            AttemptState::Retired => {
                core.reserved.remove(&uid);
            }
            _ => {}
        }
        drop(core);
        if deliverable(&record, &after) {
            self.delivery.submit(&attempt.build, snapshot, seq);
        }
        self.events.transition(&record);
        if record.to == AttemptState::Retired {
            self.slot_freed.notify_waiters();
        }
        Ok(record)
    }

    /// Whether the journal can be written (while it fails, this probes the disk with the
    /// journal's own backoff; see [`Journal::writable`]).
    pub async fn journal_writable(&self) -> bool {
        let mut core = self.core.lock().await;
        tokio::task::block_in_place(|| core.journal.writable())
    }

    /// Journals a record without an attempt (an unknown VM's quarantine or resolution).
    pub async fn journal_unknown(&self, mut record: Record) -> Result<u64, String> {
        let mut core = self.core.lock().await;
        let seq = tokio::task::block_in_place(|| core.journal.append(&mut record)).map_err(|e| e.to_string())?;
        tracing::info!(target: "journal", "{record}");
        if let Some(vm) = &record.vm {
            if record.to == AttemptState::Quarantined {
                core.unknown.insert(vm.clone(), record.slot);
            } else {
                core.unknown.remove(vm);
            }
        }
        drop(core);
        self.slot_freed.notify_waiters();
        Ok(seq)
    }

    /// Compacts the journal: drops the records of builds this agent has finished (every attempt
    /// retired, no task left) whose last record reached the cluster (or needs not: the claim was
    /// lost, or the MacBuild is gone), and of unknown VMs that were resolved. Returns how many
    /// builds were dropped.
    pub async fn compact_journal(&self) -> Result<usize, String> {
        let mut core = self.core.lock().await;
        let mut last: BTreeMap<String, (&Attempt, u64)> = BTreeMap::new();
        for a in core.attempts.values() {
            let seq = a.last_seq.unwrap_or(0);
            let entry = last.entry(a.build.uid.clone()).or_insert((a, seq));
            if a.number > entry.0.number {
                entry.0 = a;
            }
            entry.1 = entry.1.max(seq);
        }
        let done: BTreeSet<String> = last
            .iter()
            .filter(|(uid, (latest, seq))| {
                let settled = !core.active.contains_key(*uid)
                    && !core.reserved.contains_key(*uid)
                    && !core.has_open_attempt(uid)
                    && !core.finalizer_owed.contains(*uid);
                let nothing_owed = latest.build_gone
                    || latest.reason == Some(Reason::ClaimLost)
                    || self.delivery.delivered(&latest.build).is_some_and(|d| d >= *seq)
                    || core.delivered_before.get(*uid).is_some_and(|d| d >= seq)
                    || self.delivery.progress(&latest.build).borrow().gone;
                settled && nothing_owed
            })
            .map(|(uid, _)| uid.clone())
            .collect();
        if done.is_empty() {
            return Ok(0);
        }
        let unknown: BTreeSet<String> = core.unknown.keys().cloned().collect();
        let compaction = tokio::task::block_in_place(|| {
            core.journal.compact(|r| match &r.build {
                Some(b) => !done.contains(&b.uid),
                None => r.vm.as_ref().is_some_and(|vm| unknown.contains(vm)),
            })
        })
        .map_err(|e| e.to_string())?;
        let builds: Vec<BuildRef> = core
            .attempts
            .values()
            .filter(|a| done.contains(&a.build.uid))
            .map(|a| a.build.clone())
            .collect();
        let finished: Vec<String> = done.iter().filter(|uid| core.finished_here(uid)).cloned().collect();
        core.compacted.extend(finished);
        core.attempts.retain(|k, _| !done.contains(&k.build.uid));
        core.statuses.retain(|uid, _| !done.contains(uid));
        core.epochs.retain(|uid, _| !done.contains(uid));
        drop(core);
        for b in &builds {
            self.delivery.forget(b);
        }
        tracing::info!(
            target: "journal",
            kept = compaction.kept,
            dropped = compaction.dropped,
            builds = done.len(),
            "journal compacted"
        );
        Ok(done.len())
    }
}

/// Whether a record's status goes to the cluster: not before the claim (a `Requested` record),
/// not for a claim another agent won, and not to a MacBuild that is gone.
fn deliverable(record: &Record, attempt: &Attempt) -> bool {
    record.to != AttemptState::Requested && record.reason != Some(Reason::ClaimLost) && !attempt.build_gone
}
