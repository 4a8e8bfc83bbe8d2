//! Slot reservations: a slot promised to a build before an attempt of it holds the slot in the
//! journal. This module owns the book of reservations and the [`SlotReservation`] handle.
//!
//! Three kinds of holder share the host's `min(slots, 2)` slots (`machine::free_slot` picks among
//! what none of them holds):
//! - an attempt, from its `Admitted` record until its `Retired` one (`AttemptState::holds_slot`).
//!   `Retiring` and `Quarantined` keep the slot, and an attempt is retired only once its VM's
//!   deletion is confirmed (`VmDeleted`, `VmGone`): a slot is reused only after that. This kind
//!   is the journal's; [`super::core::Builds`] keeps it.
//! - a quarantined unknown VM, also journaled and kept there.
//! - a reservation, here: taken by the scan before a claim or by a retry waiting for a slot, and
//!   handed on by an attempt retired with a retry owed to that retry (the slot never passes
//!   through "free" on the way, so no other build takes it in between).
//!
//! A reservation is owned by one value, the build task's [`SlotReservation`], and released when
//! that value is dropped, whatever path drops it (an early return, an error, a panic unwinding the
//! task). It ends without being released only by [`SlotReservation::admitted`], when the attempt
//! admitted into the slot holds it in the journal. Both moves between kinds (admitted, handed to
//! a retry) happen under [`super::core::Builds`]' lock together with the journal's change, so the
//! slot is never held by neither.
//!
//! The book has a std mutex of its own, held for a few map operations and never across an await,
//! so that `Drop` can release a slot anywhere. Lock order: `Builds`' lock, then the book's.

use crate::machine::{Adoption, SlotHolder};
use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::Notify;

/// A reservation: the build, the slot, and the warm VM the build is to adopt in that slot.
type Entry = (String, u8, Option<Adoption>);

/// The reservations in force, and the signal for whoever waits for a slot.
#[derive(Default)]
pub struct SlotBook {
    held: Mutex<Held>,
    freed: Notify,
}

#[derive(Default)]
struct Held {
    /// Reservation number → what it reserves.
    by_number: BTreeMap<u64, Entry>,
    next_number: u64,
    /// Builds this agent already holds (a claim recovered at start, a retry of its own) waiting
    /// for a slot, each with how many of its waits are under way: see [`SlotBook::waiting_held`].
    held_waiting: BTreeMap<String, usize>,
}

/// A held build's wait for a slot ([`SlotBook::waiting_held`]), until dropped.
pub struct HeldWait {
    book: Arc<SlotBook>,
    uid: String,
}

impl Drop for HeldWait {
    fn drop(&mut self) {
        let mut held = self.book.held();
        if let Some(n) = held.held_waiting.get_mut(&self.uid) {
            *n -= 1;
            if *n == 0 {
                held.held_waiting.remove(&self.uid);
            }
        }
    }
}

impl SlotBook {
    pub fn new() -> Arc<SlotBook> {
        Arc::new(SlotBook::default())
    }

    fn held(&self) -> MutexGuard<'_, Held> {
        // A panic while holding this lock leaves the map whole (each change is one insert or
        // remove): going on with it is right.
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The reserved slots, one holder per reservation.
    pub fn holders(&self) -> Vec<SlotHolder> {
        self.held()
            .by_number
            .values()
            .map(|(_, s, _)| SlotHolder::Slot(*s))
            .collect()
    }

    /// Whether build `uid` has a slot reserved.
    pub fn holds(&self, uid: &str) -> bool {
        self.held().by_number.values().any(|(u, _, _)| u == uid)
    }

    /// The warm VMs reserved for a build to adopt: no other build takes them, and the pool
    /// neither evicts nor expires them.
    pub fn adopting(&self) -> std::collections::BTreeSet<String> {
        self.held()
            .by_number
            .values()
            .filter_map(|(_, _, a)| a.as_ref().map(|a| a.vm.clone()))
            .collect()
    }

    /// Marks build `uid`, which this agent already holds, as waiting for a slot until the guard
    /// is dropped: while any such build waits, no new build is claimed, so a freed slot goes to
    /// it. Otherwise a host with a queue to claim from could keep taking every freed slot for new
    /// builds while a claim it holds waits until its deadline (seen at 50 hosts: 15 minutes).
    pub fn waiting_held(self: &Arc<Self>, uid: &str) -> HeldWait {
        *self.held().held_waiting.entry(uid.to_string()).or_default() += 1;
        HeldWait {
            book: Arc::clone(self),
            uid: uid.to_string(),
        }
    }

    /// Whether a build this agent holds waits for a slot ([`SlotBook::waiting_held`]).
    pub fn held_build_waits(&self) -> bool {
        !self.held().held_waiting.is_empty()
    }

    /// How many reservations are in force.
    pub fn len(&self) -> usize {
        self.held().by_number.len()
    }

    /// Whether no reservation is in force.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Signalled whenever a slot may have become free (a reservation released, an attempt
    /// retired, an unknown VM resolved).
    pub fn freed(&self) -> &Notify {
        &self.freed
    }

    /// Wakes whoever waits for a slot.
    pub fn notify_freed(&self) {
        self.freed.notify_waiters();
    }

    /// Records a reservation of `slot` for `uid`. The caller has found `slot` free under
    /// [`super::core::Builds`]' lock ([`super::core::Builds::reserve`]), or takes it over from the
    /// attempt retiring out of it in the same locked step ([`SlotBook::hand_to_retry`]).
    pub(super) fn reserve_free(self: &Arc<Self>, uid: &str, slot: u8) -> SlotReservation {
        self.reserve(uid, slot, None)
    }

    /// Records a reservation of the slot of the ready warm VM of `adoption` for `uid` to adopt
    /// it (found ready and not reserved under [`super::core::Builds`]' lock). Until the
    /// reservation ends the VM keeps its slot in the pool's books; this reservation stands for
    /// it (it is not counted twice).
    pub(super) fn reserve_adopting(self: &Arc<Self>, uid: &str, slot: u8, adoption: Adoption) -> SlotReservation {
        self.reserve(uid, slot, Some(adoption))
    }

    fn reserve(self: &Arc<Self>, uid: &str, slot: u8, adoption: Option<Adoption>) -> SlotReservation {
        let mut held = self.held();
        let number = held.next_number;
        held.next_number += 1;
        held.by_number.insert(number, (uid.to_string(), slot, adoption.clone()));
        SlotReservation {
            book: Arc::clone(self),
            number,
            uid: uid.to_string(),
            slot,
            adoption,
            wake_on_release: true,
        }
    }

    /// The slot of an attempt retired with a retry owed passes straight to that retry: called
    /// under [`super::core::Builds`]' lock in the step that journals the `Retired` record.
    pub(super) fn hand_to_retry(self: &Arc<Self>, uid: &str, slot: u8) -> SlotReservation {
        self.reserve_free(uid, slot)
    }
}

/// One build's claim on one slot until an attempt of it holds the slot in the journal. Released
/// (the slot free again, waiters woken) when dropped; [`SlotReservation::admitted`] ends it
/// without freeing the slot. There is no other way to end it, and no way to end it twice.
#[must_use = "a reservation dropped at once frees its slot at once"]
pub struct SlotReservation {
    book: Arc<SlotBook>,
    number: u64,
    uid: String,
    slot: u8,
    /// The warm VM the build adopts in this slot, if any.
    adoption: Option<Adoption>,
    wake_on_release: bool,
}

impl SlotReservation {
    /// The slot reserved.
    pub fn slot(&self) -> u8 {
        self.slot
    }

    /// The build it is reserved for.
    pub fn uid(&self) -> &str {
        &self.uid
    }

    /// The warm VM the build is to adopt in this slot, if any.
    pub fn adoption(&self) -> Option<&Adoption> {
        self.adoption.as_ref()
    }

    /// The attempt admitted into this slot holds it now, as journaled: the reservation ends and
    /// the slot stays taken (no waiter is woken). Called under [`super::core::Builds`]' lock,
    /// after the attempt's `Admitted` state is recorded there.
    pub(super) fn admitted(mut self) {
        self.wake_on_release = false;
    }
}

impl Drop for SlotReservation {
    fn drop(&mut self) {
        let removed = self.book.held().by_number.remove(&self.number).is_some();
        debug_assert!(
            removed,
            "reservation {} of slot {} released twice",
            self.number, self.slot
        );
        if removed && self.wake_on_release {
            self.book.notify_freed();
        }
    }
}

impl fmt::Debug for SlotReservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "slot {} reserved for {} (#{})", self.slot, self.uid, self.number)
    }
}

impl PartialEq for SlotReservation {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.book, &other.book) && self.number == other.number
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;

    #[test]
    fn a_held_build_waits_until_its_last_wait_ends() {
        let book = SlotBook::new();
        assert!(!book.held_build_waits());
        let first = book.waiting_held("a");
        let second = book.waiting_held("a");
        let other = book.waiting_held("b");
        assert!(book.held_build_waits());
        drop(first);
        drop(other);
        assert!(book.held_build_waits(), "a's second wait is still under way");
        drop(second);
        assert!(!book.held_build_waits());
    }

    #[test]
    fn a_dropped_reservation_frees_its_slot_and_wakes_waiters() {
        let book = SlotBook::new();
        let r = book.reserve_free("a", 1);
        assert_eq!(book.holders(), vec![SlotHolder::Slot(1)]);
        assert!(book.holds("a"));
        let mut woken = std::pin::pin!(book.freed().notified());
        woken.as_mut().enable();
        drop(r);
        assert!(book.is_empty());
        assert!(!book.holds("a"));
        assert!(woken.now_or_never().is_some(), "a waiter for a slot is woken");
    }

    #[test]
    fn an_admitted_reservation_ends_without_waking_anyone() {
        let book = SlotBook::new();
        let r = book.reserve_free("a", 0);
        let mut woken = std::pin::pin!(book.freed().notified());
        woken.as_mut().enable();
        r.admitted();
        assert!(
            book.is_empty(),
            "the reservation is gone: the attempt holds the slot now"
        );
        assert!(woken.now_or_never().is_none(), "no slot became free");
    }

    #[test]
    fn releasing_one_reservation_leaves_the_others_of_the_same_build() {
        // Released by its own number, not by build: a reservation handed to a retry survives the
        // release of an older one of the same build.
        let book = SlotBook::new();
        let old = book.reserve_free("a", 0);
        let handed = book.hand_to_retry("a", 1);
        drop(old);
        assert_eq!(book.holders(), vec![SlotHolder::Slot(1)]);
        assert!(book.holds("a"));
        assert_eq!(handed.slot(), 1);
        assert_eq!(format!("{handed:?}"), "slot 1 reserved for a (#1)");
    }
}
