//! Adversary 19: attacks on the delivery's new authority (`claim_to_test`): a status write of
//! attempt N lands on this holder's claim of attempt N-1 and moves the claim on to N.
//!
//! Emulator-backed (real HTTP, real JSON-patch tests) unless the name says `pure`.

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Patch, PatchParams};
use serde_json::json;
use std::collections::BTreeMap;
use tartan_agent::cluster::claim::{self, ClaimOutcome, next_claim_patch};
use tartan_agent::cluster::delivery::{Delivered, Fence, claim_to_test, deliver_once, status_patch};

use tartan_agent::machine::{Attempt, AttemptKey, Config, Deleted, Event, NextAttempt, Transition, request, step};
use tartan_agent::record::{BuildRef, Record};
use tartan_agent::recovery::{AgentId, BuildView, ClaimView, ClusterView, RecoveryAction, plan};
use tartan_api::{AttemptState, Claim, MacBuildStatus, Phase};
use tartan_testkit::EmulatorHandle;

mod cluster_common;
use cluster_common::*;

// ---------------------------------------------------------------------------------------------
// Helpers of these attacks

fn next(c: &Claim, n: u32) -> Claim {
    let (name, _) = tartan_api::parse_attempt_id(&c.attempt).unwrap();
    Claim {
        holder: c.holder.clone(),
        attempt: tartan_api::attempt_id(name, n),
        epoch: c.epoch + 1,
    }
}

/// Attempt 1 of `name` claimed by mac-a and interrupted ("Pending, a retry follows" at seq 10);
/// returns (c1, c2 = the retry's claim, the build).
async fn interrupted(emu: &EmulatorHandle, name: &str) -> (Claim, Claim, BuildRef) {
    let mb = create_build(emu, name).await;
    let (c1, mb1) = won(emu, &mb, "mac-a", 1).await;
    let build = build_ref(&mb1);
    let pending = claimed_status(&c1, Phase::Pending, "attempt 1 interrupted; a retry follows");
    assert_eq!(
        deliver_once(&emu.client(), API_TIMEOUT, &build, &pending, 10, &mut None)
            .await
            .unwrap(),
        Delivered::Written
    );
    let c2 = next(&c1, 2);
    (c1, c2, build)
}

/// A raw JSON patch on the status subresource: `Ok` if it applied, `Err(code)` otherwise.
async fn raw_status_patch(emu: &EmulatorHandle, name: &str, patch: json_patch::Patch) -> Result<(), Option<u16>> {
    builds(emu)
        .patch_status(name, &PatchParams::default(), &Patch::Json::<()>(patch))
        .await
        .map(|_| ())
        .map_err(|e| match e {
            kube::Error::Api(s) => Some(s.code),
            _ => None,
        })
}

// ---------------------------------------------------------------------------------------------
// A1: the retry's own claim write, answered late, lands after its end moved the claim on.

#[tokio::test]
async fn a1_late_claim_write_of_the_retry_after_its_end_moved_the_claim_changes_nothing() {
    let emu = emulator().await;
    let (c1, c2, build) = interrupted(&emu, "late-claim").await;
    let uid = build.uid.clone();
    // The claim write the retry sent (testing our claim of #1), held back in transit.
    let late_claim = next_claim_patch(&uid, &c1, &c2);
    // The retry is cancelled before its claim is answered: its end lands under our claim of #1.
    let ended = claimed_status(
        &c2,
        Phase::Cancelled,
        "cancel requested before admission; nothing cloned",
    );
    assert_eq!(
        deliver_once(&emu.client(), API_TIMEOUT, &build, &ended, 12, &mut None)
            .await
            .unwrap(),
        Delivered::Written
    );
    let before = get(&emu, "late-claim").await.status.unwrap();
    assert_eq!(
        (before.phase, before.claim.as_ref()),
        (Some(Phase::Cancelled), Some(&c2))
    );
    // Now the held-back claim write arrives: its test on #1 fails, the end stays.
    assert_eq!(raw_status_patch(&emu, "late-claim", late_claim).await, Err(Some(422)));
    let after = get(&emu, "late-claim").await.status.unwrap();
    assert_eq!(
        after, before,
        "a late claim write took the Cancelled end back to Pending"
    );
}

/// A1b (latent): the claim path for a retry, run against a MacBuild whose claim the retry's own
/// terminal write moved on, "wins" the build although its status says it ended. In today's
/// runtime the retry's task is inside `claim_with_retries` until it returns, so its end cannot be
/// journaled meanwhile; this documents that `claim()` itself does not refuse a terminal build for
/// a retry (a first claim does: `open_for_first_claim`).
#[tokio::test]
async fn a1b_a_retrys_claim_on_a_build_its_own_end_already_closed_is_not_won() {
    let emu = emulator().await;
    let (_c1, c2, build) = interrupted(&emu, "closed-retry").await;
    let ended = claimed_status(
        &c2,
        Phase::Cancelled,
        "cancel requested before admission; nothing cloned",
    );
    assert_eq!(
        deliver_once(&emu.client(), API_TIMEOUT, &build, &ended, 12, &mut None)
            .await
            .unwrap(),
        Delivered::Written
    );
    let mb = get(&emu, "closed-retry").await;
    let outcome = claim::claim(&emu.client(), API_TIMEOUT, &mb, "mac-a", 2).await.unwrap();
    assert!(
        matches!(outcome, ClaimOutcome::Lost { .. }),
        "a claim for a retry whose end the MacBuild shows (Cancelled) was won: {outcome:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// A2: attempt 1's own late writes after the claim moved to 2.

#[tokio::test]
async fn a2_the_previous_attempts_late_writes_after_the_move_change_nothing() {
    let emu = emulator().await;
    let (c1, c2, build) = interrupted(&emu, "prev-late").await;
    // A write of attempt 1 built on the fence it knew (seq 10), held back in transit.
    let stale1 = claimed_status(&c1, Phase::Failed, "attempt 1 (late) says failed");
    let late1 = status_patch(&build.uid, &stale1, 11, &Fence::JournalSeq(10)).unwrap();
    let ended = claimed_status(&c2, Phase::Cancelled, "attempt 2 cancelled before admission");
    assert_eq!(
        deliver_once(&emu.client(), API_TIMEOUT, &build, &ended, 12, &mut None)
            .await
            .unwrap(),
        Delivered::Written
    );
    let before = get(&emu, "prev-late").await.status.unwrap();
    assert_eq!(raw_status_patch(&emu, "prev-late", late1).await, Err(Some(422)));
    // On a fresh read too (recovery's redelivery of attempt 1's record): fenced out.
    match deliver_once(&emu.client(), API_TIMEOUT, &build, &stale1, 13, &mut None)
        .await
        .unwrap()
    {
        Delivered::FencedOut { now } => assert_eq!(now, Some(c2.clone())),
        other => panic!("attempt 1's write after the move: {other:?}"),
    }
    // On a fence it keeps (the worker's, from its own last write): still fenced out.
    match deliver_once(
        &emu.client(),
        API_TIMEOUT,
        &build,
        &stale1,
        14,
        &mut Some(Fence::JournalSeq(12)),
    )
    .await
    .unwrap()
    {
        Delivered::FencedOut { now } => assert_eq!(now, Some(c2.clone())),
        other => panic!("attempt 1's write on a kept fence: {other:?}"),
    }
    assert_eq!(get(&emu, "prev-late").await.status.unwrap(), before);
}

// ---------------------------------------------------------------------------------------------
// A3: a duplicated (answer lost, applied later) write of the retry itself.

#[tokio::test]
async fn a3_a_duplicate_of_the_moving_write_applied_after_a_newer_one_changes_nothing() {
    let emu = emulator().await;
    let (c1, c2, build) = interrupted(&emu, "dup").await;
    // The retry's first write, as deliver_once builds it on a fresh read: tests #1 and seq 10.
    let first = claimed_status(&c2, Phase::Pending, "attempt 2 requested");
    let mut moving = status_patch(&build.uid, &first, 11, &Fence::JournalSeq(10)).unwrap();
    // (status_patch tests the snapshot's claim; the write that moves tests ours of #1 instead)
    moving.0[2] = json_patch::PatchOperation::Test(json_patch::TestOperation {
        path: json_patch::jsonptr::PointerBuf::from_tokens(["status", "claim", "attempt"]),
        value: json!(c1.attempt),
    });
    assert_eq!(raw_status_patch(&emu, "dup", moving.clone()).await, Ok(()));
    assert_eq!(get(&emu, "dup").await.status.unwrap().claim, Some(c2.clone()));
    // Its end, on the fence of the first write.
    let ended = claimed_status(&c2, Phase::Cancelled, "attempt 2 cancelled");
    assert_eq!(
        deliver_once(
            &emu.client(),
            API_TIMEOUT,
            &build,
            &ended,
            12,
            &mut Some(Fence::JournalSeq(11))
        )
        .await
        .unwrap(),
        Delivered::Written
    );
    let before = get(&emu, "dup").await.status.unwrap();
    // The first write applied a second time (its first answer lost): refused.
    assert_eq!(raw_status_patch(&emu, "dup", moving).await, Err(Some(422)));
    assert_eq!(get(&emu, "dup").await.status.unwrap(), before);
    assert_eq!(before.phase, Some(Phase::Cancelled));
}

// ---------------------------------------------------------------------------------------------
// A4: the build handed on (claim holder reset) after our attempt 1; another agent claims it.

#[tokio::test]
async fn a4_after_a_hand_over_our_retrys_end_never_lands_on_nobodys_or_anothers_claim() {
    let emu = emulator().await;
    let (c1, c2, build) = interrupted(&emu, "handed").await;
    // An operator hands the build on: the claim removed (the CRD refuses an empty holder),
    // attempt 1 listed so that the next first claim is attempt 2.
    let hand_over: json_patch::Patch = serde_json::from_value(json!([
        {"op": "remove", "path": "/status/claim"},
        {"op": "add", "path": "/status/attempts", "value": [
            {"number": 1, "id": c1.attempt, "vm": "mb-a1", "host": "mac-a"}
        ]},
    ]))
    .unwrap();
    assert_eq!(raw_status_patch(&emu, "handed", hand_over).await, Ok(()));
    let ended = claimed_status(&c2, Phase::Cancelled, "attempt 2 (mac-a) cancelled");
    // Nobody holds it: our retry's end is stale, not "moved on".
    for fence in [None, Some(Fence::JournalSeq(10))] {
        let mut fence = fence;
        match deliver_once(&emu.client(), API_TIMEOUT, &build, &ended, 12, &mut fence)
            .await
            .unwrap()
        {
            Delivered::FencedOut { .. } => {}
            other => panic!("retry's end on a reset claim: {other:?}"),
        }
    }
    // mac-b first-claims it: attempt 2, the same attempt id as our retry.
    let (b2, _) = won(&emu, &get(&emu, "handed").await, "mac-b", 2).await;
    assert_eq!(b2.attempt, c2.attempt);
    let before = get(&emu, "handed").await.status.unwrap();
    for fence in [None, Some(Fence::JournalSeq(10))] {
        let mut fence = fence;
        match deliver_once(&emu.client(), API_TIMEOUT, &build, &ended, 13, &mut fence)
            .await
            .unwrap()
        {
            Delivered::FencedOut { now } => assert_eq!(now, Some(b2.clone())),
            other => panic!("retry's end on mac-b's claim: {other:?}"),
        }
    }
    assert_eq!(get(&emu, "handed").await.status.unwrap(), before);
}

// ---------------------------------------------------------------------------------------------
// A5: the authority only covers "the attempt before is ours and a retry follows it".

/// Latent: the MacBuild shows our attempt 1 *ended* (Succeeded). No retry can follow a success,
/// so any write of an attempt 2 is a bug elsewhere, but the new authority takes it and replaces
/// the terminal Succeeded with attempt 2's status. (The retry claim path shares the gap:
/// `next_claim_patch` tests holder and attempt only.)
#[tokio::test]
async fn a5_a_write_of_the_next_attempt_does_not_replace_a_terminal_end_of_the_attempt_before() {
    let emu = emulator().await;
    let mb = create_build(&emu, "ended").await;
    let (c1, mb1) = won(&emu, &mb, "mac-a", 1).await;
    let build = build_ref(&mb1);
    let done = claimed_status(&c1, Phase::Succeeded, "attempt 1 passed");
    assert_eq!(
        deliver_once(&emu.client(), API_TIMEOUT, &build, &done, 10, &mut None)
            .await
            .unwrap(),
        Delivered::Written
    );
    let c2 = next(&c1, 2);
    let phantom = claimed_status(&c2, Phase::Cancelled, "attempt 2 cancelled");
    let got = deliver_once(&emu.client(), API_TIMEOUT, &build, &phantom, 11, &mut None)
        .await
        .unwrap();
    let status = get(&emu, "ended").await.status.unwrap();
    assert_eq!(
        (status.phase, status.claim.as_ref()),
        (Some(Phase::Succeeded), Some(&c1)),
        "a terminal Succeeded was replaced by a next attempt's write ({got:?})"
    );
}

// ---------------------------------------------------------------------------------------------
// A6 (pure): attempt ids with odd names.

#[test]
fn a6_pure_odd_attempt_ids_move_only_from_the_exact_attempt_before() {
    let c = |h: &str, a: &str| Claim {
        holder: h.into(),
        attempt: a.into(),
        epoch: 1,
    };
    // The MacBuild showing claim `c`, a retry pending.
    let shown = |c: Claim| MacBuildStatus {
        phase: Some(Phase::Pending),
        claim: Some(c),
        ..Default::default()
    };
    // A name with '#': "b#1" build, attempt 2 is "b#1#2"; the one before is "b#1#1".
    assert_eq!(
        claim_to_test(Some(&shown(c("a", "b#1#1"))), &c("a", "b#1#2")),
        Some(c("a", "b#1#1"))
    );
    // Not build "b"'s attempt 1 (a different name), nor "b#1" read as a name "b", attempt 1.
    assert_eq!(claim_to_test(Some(&shown(c("a", "b#1"))), &c("a", "b#1#2")), None);
    assert_eq!(claim_to_test(Some(&shown(c("a", "b"))), &c("a", "b#1")), None);
    // Non-canonical numbers never name "the one before".
    for odd in ["b#02", "b#+2", "b#2 ", "b#", "#2", "b#4294967296", "b#0"] {
        assert_eq!(claim_to_test(Some(&shown(c("a", "b#1"))), &c("a", odd)), None, "{odd}");
    }
    // Overflow: attempt u32::MAX follows u32::MAX - 1 only.
    let max = format!("b#{}", u32::MAX);
    let before_max = format!("b#{}", u32::MAX - 1);
    assert_eq!(
        claim_to_test(Some(&shown(c("a", &before_max))), &c("a", &max)),
        Some(c("a", &before_max))
    );
    // Holder compared exactly (no trimming, no case folding).
    for h in ["A", "a ", " a", ""] {
        assert_eq!(claim_to_test(Some(&shown(c(h, "b#1"))), &c("a", "b#2")), None, "{h:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// R1 (pure): recovery after a restart, the retry's end journaled but not yet delivered.

const ME: &str = "mac-a";

fn ts(s: &str) -> Timestamp {
    s.parse().unwrap()
}
fn secs(n: i64) -> SignedDuration {
    SignedDuration::from_secs(n)
}
fn rbuild() -> BuildRef {
    BuildRef {
        namespace: "ci".into(),
        name: "chaos-2928".into(),
        uid: "u-2928".into(),
    }
}

struct Journal {
    recs: Vec<Record>,
    seq: u64,
    views: BTreeMap<u32, Attempt>,
}

impl Journal {
    fn push(&mut self, n: u32, t: &Transition) {
        let a = self.views.get_mut(&n).unwrap();
        let r = a.record(t, self.seq);
        self.seq += 1;
        a.observe(&r);
        self.recs.push(r);
    }
    fn request(&mut self, n: u32, retry: Option<NextAttempt>, at: Timestamp) -> &mut Self {
        let a = Attempt::new(rbuild(), n, format!("mb-ci-chaos-2928-a{n}"), 2);
        let t = request(&a, retry.as_ref(), at);
        self.views.insert(n, a);
        self.push(n, &t);
        self
    }
    fn go(&mut self, n: u32, ev: Event, at: Timestamp) -> &mut Self {
        let t = step(&self.views[&n], ev, at, &Config::default()).unwrap();
        self.push(n, &t);
        self
    }
}

#[test]
fn r1_pure_a_restart_before_the_unclaimed_retrys_end_landed_delivers_it_and_releases_the_build() {
    let t0 = ts("2026-10-05T02:26:06Z");
    let mut j = Journal {
        recs: vec![],
        seq: 600,
        views: BTreeMap::new(),
    };
    j.request(1, None, t0)
        .go(
            1,
            Event::Admit {
                slot: 0,
                slots: 1,
                timeout: secs(1800),
            },
            t0 + secs(1),
        )
        .go(1, Event::Boot, t0 + secs(2))
        .go(1, Event::AgentRestarted { killed: 0 }, t0 + secs(60))
        .go(
            1,
            Event::VmDeleted {
                how: Deleted::AtAgentStart,
            },
            t0 + secs(61),
        );
    let a1 = j.views[&1].clone();
    assert_eq!(a1.state, AttemptState::Retired);
    let a1_last = j.seq - 1;
    let deadline = a1.deadline.unwrap();
    j.request(
        2,
        Some(NextAttempt {
            build: rbuild(),
            attempt: 2,
            deadline,
        }),
        t0 + secs(62),
    )
    .go(2, Event::CancelRequested { at_start: None }, t0 + secs(63));
    assert_eq!(j.views[&2].state, AttemptState::Retired);
    let a2_end = j.seq - 1;
    // The agent restarts before the retry's end was delivered: the MacBuild still shows our
    // claim of attempt 1 (the retry's claim was never written), with our finalizer and the
    // cancel, at a1's last record, or (adversary 20) at an earlier one: a1's own end was not
    // delivered either. Either way only the retry's end is redelivered, once.
    for shown_seq in [a1_last, a1_last - 2] {
        let cluster = ClusterView {
            builds: vec![BuildView {
                namespace: "ci".into(),
                name: "chaos-2928".into(),
                uid: "u-2928".into(),
                owner_deleted: false,
                deletion_requested: false,
                cancel_requested: true,
                claim: Some(ClaimView {
                    holder: ME.into(),
                    attempt: 1,
                }),
                journal_seq: Some(shown_seq),
                max_attempts: Some(2),
                timeout_seconds: 1800,
                has_finalizer: true,
                generation: Some(1),
            }],
            assumed: false,
        };
        let p = plan(
            &j.recs,
            &[],
            &cluster,
            &AgentId(ME.into()),
            t0 + secs(120),
            &Config::default(),
        );
        let key2 = AttemptKey {
            build: rbuild(),
            attempt: 2,
        };
        assert!(
            p.contains(&RecoveryAction::RedeliverStatus {
                attempt: key2,
                seq: a2_end
            }),
            "the retry's journaled end (record {a2_end}) is not redelivered after a restart (MacBuild at {shown_seq}); plan: {p:?}"
        );
        assert!(
            p.contains(&RecoveryAction::RemoveFinalizer { build: rbuild() }),
            "our finalizer is left on the ended build (MacBuild at {shown_seq}); plan: {p:?}"
        );
        let redeliveries = p
            .iter()
            .filter(|a| matches!(a, RecoveryAction::RedeliverStatus { .. }))
            .count();
        assert_eq!(
            redeliveries, 1,
            "more than one redelivery for one build (MacBuild at {shown_seq}); plan: {p:?}"
        );
    }
}
