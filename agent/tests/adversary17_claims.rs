//! Adversary round 17: a claim whose answer never came (`Requested -> Retired (ClaimUnconfirmed)`).
//!
//! Part 1 drives the scan's pass (`Builds::withdraw_or_pick_new`) over a real journal in a temp
//! dir: which late answers it owes, to whom, how often, and which builds it still picks. Part 2
//! runs status delivery against the API emulator: the unconfirmed claim's status is fenced out
//! while the claim has not landed, written once it lands (`submit_after_late_claim`), and never
//! over another holder's claim.
//!
//! `Shared::compact_journal` needs a whole `Shared` and is not attacked here (see the round's
//! report).

mod cluster_common;

use cluster_common::{builds, create_build, emulator, get};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use tartan_agent::cluster::claim::{self, first_claim_patch};
use tartan_agent::cluster::delivery::{Delivery, DeliveryConfig};
use tartan_agent::journal::{Journal, JournalOptions};
use tartan_agent::lock::StateLock;
use tartan_agent::machine::Attempt;
use tartan_agent::record::BuildRef;
use tartan_agent::recovery::Replay;
use tartan_agent::runtime::core::Builds;
use tartan_api::{
    AttemptRecord, AttemptState, Claim, MacBuild, MacBuildSpec, MacBuildStatus, Outcome, Phase, Reason, attempt_id,
};
use tartan_testkit::EmulatorHandle;

const ME: &str = "agent-a";

// ---------------------------------------------------------------------------------------------
// Part 1: the scan's pass over a real journal.

fn new_builds() -> (Builds, StateLock, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let lock = StateLock::acquire(dir.path()).unwrap();
    let (journal, _) = Journal::open(&lock, JournalOptions::default()).unwrap();
    (Builds::new(journal), lock, dir)
}

fn bref(name: &str, uid: &str) -> BuildRef {
    BuildRef {
        namespace: "ci".into(),
        name: name.into(),
        uid: uid.into(),
    }
}

/// Attempt `number` of `b`, retired at journal record `seq` for `reason`.
fn retired(b: &BuildRef, number: u32, seq: u64, reason: Reason) -> Attempt {
    let mut a = Attempt::new(b.clone(), number, format!("mb-ci-{}-a{number}", b.name), 3);
    a.state = AttemptState::Retired;
    a.reason = Some(reason);
    a.last_seq = Some(seq);
    a.last_time = Some(Timestamp::now());
    a
}

async fn load(builds: &Builds, attempts: Vec<Attempt>) {
    let replay = Replay {
        attempts,
        unknown: vec![],
        warm: vec![],
    };
    builds.load_replay(&replay, &[]).await;
}

fn claim_of(holder: &str, attempt: &str, epoch: u64) -> Claim {
    Claim {
        holder: holder.into(),
        attempt: attempt.into(),
        epoch,
    }
}

/// The status the unconfirmed attempt's record carries: never admitted, nothing cloned.
fn answer_snapshot(b: &BuildRef, number: u32) -> MacBuildStatus {
    MacBuildStatus {
        claim: Some(claim_of(ME, &attempt_id(&b.name, number), u64::from(number))),
        phase: Some(Phase::Failed),
        message: Some("claim not confirmed; nothing cloned".into()),
        attempts: vec![record(b, number, ME)],
        ..Default::default()
    }
}

fn record(b: &BuildRef, number: u32, host: &str) -> AttemptRecord {
    AttemptRecord {
        number,
        id: attempt_id(&b.name, number),
        vm: format!("mb-ci-{}-a{number}", b.name),
        host: host.into(),
        outcome: None,
        reason: None,
        started_at: None,
        finished_at: None,
        message: None,
    }
}

/// The MacBuild `b` as the scan sees it.
fn shown(b: &BuildRef, status: Option<MacBuildStatus>) -> Arc<MacBuild> {
    let mut mb = MacBuild::new(&b.name, MacBuildSpec::new("img", vec![]));
    mb.metadata.namespace = Some(b.namespace.clone());
    mb.metadata.uid = Some(b.uid.clone());
    mb.status = status;
    Arc::new(mb)
}

/// The claim `claim` landed on `b` (over whatever `journal_seq` an earlier writer left).
fn landed(b: &BuildRef, claim: Option<Claim>, journal_seq: Option<u64>, attempts: Vec<AttemptRecord>) -> Arc<MacBuild> {
    shown(
        b,
        Some(MacBuildStatus {
            claim,
            phase: Some(Phase::Pending),
            journal_seq,
            attempts,
            ..Default::default()
        }),
    )
}

/// A journal with attempt 2 of `b` retired `ClaimUnconfirmed` at record 7 (attempt 1 ran on
/// another host), and the snapshot it recorded.
async fn unconfirmed_a2(b: &BuildRef) -> (Builds, StateLock, tempfile::TempDir, MacBuildStatus) {
    let (builds, lock, dir) = new_builds();
    load(&builds, vec![retired(b, 2, 7, Reason::ClaimUnconfirmed)]).await;
    let snapshot = answer_snapshot(b, 2);
    builds.claim_made(&b.uid, 2, Some(snapshot.clone())).await;
    (builds, lock, dir, snapshot)
}

/// How many late answers one scan pass gives for `mbs`, as seen by `me`.
async fn late_answers(builds: &Builds, mbs: &[Arc<MacBuild>], me: &str) -> usize {
    builds.withdraw_or_pick_new(mbs, me).await.late_answers.len()
}

/// The uids one scan pass picks as new.
async fn picked_new(builds: &Builds, mbs: &[Arc<MacBuild>], me: &str) -> Vec<String> {
    let picked = builds.withdraw_or_pick_new(mbs, me).await;
    picked
        .new
        .iter()
        .map(|mb| mb.metadata.uid.clone().unwrap_or_default())
        .collect()
}

/// The answer is owed exactly when the MacBuild shows this agent's own claim on the very attempt
/// it journaled `ClaimUnconfirmed`, for that uid, and not yet that record's status; it is given
/// once, with that record's status and seq. Look-alike holders, other attempts of the same
/// build, a same-named build of another uid, a claim removed or emptied, a status already
/// delivered and a claim that was lost (not unconfirmed) owe nothing.
#[tokio::test]
async fn late_answer_owed_only_for_our_own_claim_on_that_attempt_and_uid_and_only_once() {
    let b = bref("b", "uid-b");
    let a1_elsewhere = || vec![record(&b, 1, "agent-b")];
    let mine = |attempt: &str| Some(claim_of(ME, attempt, 3));

    // Owed: our claim on b#2 shows, and no status of ours (journalSeq of nobody yet).
    let (builds, _l, _d, snapshot) = unconfirmed_a2(&b).await;
    let mb = landed(&b, mine("b#2"), None, a1_elsewhere());
    let picked = builds.withdraw_or_pick_new(std::slice::from_ref(&mb), ME).await;
    assert_eq!(picked.late_answers.len(), 1, "the landed claim is answered");
    let answer = &picked.late_answers[0];
    assert_eq!(answer.build, b);
    assert_eq!(answer.seq, 7, "the unconfirmed record's seq");
    assert_eq!(answer.status, snapshot, "that record's status, never admitted");
    assert!(picked.new.is_empty(), "its next claim (a2) is journaled: not picked");
    assert_eq!(
        late_answers(&builds, std::slice::from_ref(&mb), ME).await,
        0,
        "given once per process"
    );

    let cases: Vec<(&str, Arc<MacBuild>, &str)> = vec![
        (
            "holder is a longer id",
            landed(&b, Some(claim_of("agent-a2", "b#2", 3)), None, a1_elsewhere()),
            ME,
        ),
        (
            "holder is a prefix",
            landed(&b, Some(claim_of("agent-", "b#2", 3)), None, a1_elsewhere()),
            ME,
        ),
        (
            "holder differs in case",
            landed(&b, Some(claim_of("AGENT-A", "b#2", 3)), None, a1_elsewhere()),
            ME,
        ),
        (
            "holder empty",
            landed(&b, Some(claim_of("", "b#2", 3)), None, a1_elsewhere()),
            ME,
        ),
        (
            "our claim on an older attempt",
            landed(&b, mine("b#1"), None, a1_elsewhere()),
            ME,
        ),
        (
            "our claim on a later attempt",
            landed(&b, mine("b#3"), None, a1_elsewhere()),
            ME,
        ),
        (
            "attempt spelled with a zero",
            landed(&b, mine("b#02"), None, a1_elsewhere()),
            ME,
        ),
        (
            "attempt of another build name",
            landed(&b, mine("c#2"), None, a1_elsewhere()),
            ME,
        ),
        ("empty attempt", landed(&b, mine(""), None, a1_elsewhere()), ME),
        ("no claim (reset)", landed(&b, None, None, a1_elsewhere()), ME),
        ("no status at all", shown(&b, None), ME),
        (
            "our status already delivered",
            landed(&b, mine("b#2"), Some(7), a1_elsewhere()),
            ME,
        ),
    ];
    for (what, mb, me) in cases {
        let (builds, _l, _d, _) = unconfirmed_a2(&b).await;
        assert_eq!(late_answers(&builds, &[mb], me).await, 0, "{what}: nothing owed");
    }

    // A same-named build of another uid shows our claim on b#2: not this journal's attempt.
    let (builds, _l, _d, _) = unconfirmed_a2(&b).await;
    let other = bref("b", "uid-b-new");
    assert_eq!(
        late_answers(&builds, &[landed(&other, mine("b#2"), None, a1_elsewhere())], ME).await,
        0,
        "another uid under the same name"
    );
    // The owed answer is still given for the real one afterwards (the look-alike spent nothing).
    assert_eq!(
        late_answers(&builds, &[landed(&b, mine("b#2"), None, a1_elsewhere())], ME).await,
        1
    );

    // A claim lost (another agent answered) owes nothing, even if our claim shows.
    let (builds, _l, _d) = new_builds();
    load(&builds, vec![retired(&b, 2, 7, Reason::ClaimLost)]).await;
    builds.claim_made(&b.uid, 2, Some(answer_snapshot(&b, 2))).await;
    assert_eq!(
        late_answers(&builds, &[landed(&b, mine("b#2"), None, a1_elsewhere())], ME).await,
        0,
        "a lost claim"
    );
}

/// The build was handed on: attempt 1 ran on agent-b, whose last status left `journalSeq` 900
/// (agent-b's own record numbering), then the claim was reset. This agent's claim on b#2 got no
/// answer (`ClaimUnconfirmed` at this agent's record 7), its status was fenced out for want of the
/// claim, and the claim then landed: the MacBuild shows our claim, phase Pending, and agent-b's
/// `journalSeq` 900 (a claim patch does not touch `journalSeq`). The answer is owed: nobody else
/// will ever answer for this claim.
#[tokio::test]
async fn late_answer_owed_even_when_an_earlier_holder_left_a_higher_journal_seq() {
    let b = bref("b", "uid-b");
    let (builds, _l, _d, _) = unconfirmed_a2(&b).await;
    let mut a1 = record(&b, 1, "agent-b");
    a1.started_at = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Timestamp::now()));
    a1.outcome = Some(Outcome::Failed);
    let mb = landed(&b, Some(claim_of(ME, "b#2", 2)), Some(900), vec![a1]);
    let picked = builds.withdraw_or_pick_new(std::slice::from_ref(&mb), ME).await;
    assert_eq!(
        picked.late_answers.len(),
        1,
        "our claim on b#2 landed and shows agent-b's journalSeq 900, not our record 7: the answer \
         is owed, or the MacBuild stays claimed by us, Pending, with nobody to answer"
    );
}

/// What the scan picks once the journal has an unconfirmed attempt: never a build whose next
/// claim is that attempt again (however the MacBuild lists its attempts: out of order,
/// duplicated, at the number's edge), always one whose next claim is new (a longer history, or a
/// same-named build of another uid).
#[tokio::test]
async fn the_scan_never_picks_a_build_to_claim_a_journaled_attempt_again_whatever_the_list() {
    let b = bref("b", "uid-b");
    let listed = |numbers: &[u32]| {
        landed(
            &b,
            None,
            None,
            numbers.iter().map(|&n| record(&b, n, "agent-b")).collect(),
        )
    };
    let cases: Vec<(&str, Arc<MacBuild>, bool)> = vec![
        ("lists a1: next is a2, journaled", listed(&[1]), false),
        ("lists a1 twice", listed(&[1, 1]), false),
        ("lists a0 and a1 out of order", listed(&[1, 0]), false),
        ("lists a1 and a2 out of order: next a3", listed(&[2, 1]), true),
        ("lists a2 only: next a3", listed(&[2]), true),
        ("lists a1 then a2 twice: next a3", listed(&[1, 2, 2]), true),
    ];
    for (what, mb, want) in cases {
        let (builds, _l, _d, _) = unconfirmed_a2(&b).await;
        assert_eq!(!picked_new(&builds, &[mb], ME).await.is_empty(), want, "{what}");
    }

    // The number's edge: the journal has a u32::MAX, the MacBuild lists it (next saturates at
    // u32::MAX, never wraps to a fresh-looking 0 or 1).
    let (builds, _l, _d) = new_builds();
    load(&builds, vec![retired(&b, u32::MAX, 9, Reason::ClaimUnconfirmed)]).await;
    assert!(
        picked_new(&builds, &[listed(&[u32::MAX])], ME).await.is_empty(),
        "a u32::MAX attempt is not claimed again"
    );

    // A long history (10,000 attempts listed, shuffled by reversing): next a10001, picked.
    let (builds, _l, _d, _) = unconfirmed_a2(&b).await;
    let long: Vec<u32> = (1..=10_000).rev().collect();
    assert_eq!(
        picked_new(&builds, &[listed(&long)], ME).await,
        ["uid-b"],
        "a10001 is new"
    );

    // A same-named build of another uid with no attempts: its a1 is not the journal's (uid-b's a1
    // is unconfirmed too).
    let (builds, _l, _d) = new_builds();
    load(&builds, vec![retired(&b, 1, 3, Reason::ClaimUnconfirmed)]).await;
    let fresh = shown(&bref("b", "uid-b-new"), None);
    let same = shown(&b, None);
    assert_eq!(
        picked_new(&builds, &[fresh, same], ME).await,
        ["uid-b-new"],
        "only the build whose a1 was never claimed here"
    );
}

// ---------------------------------------------------------------------------------------------
// Part 2: delivery of the unconfirmed claim's status, against the API emulator.

async fn patch_status(emu: &EmulatorHandle, name: &str, patch: serde_json::Value) {
    let patch: json_patch::Patch = serde_json::from_value(patch).unwrap();
    builds(emu)
        .patch_status(name, &PatchParams::default(), &Patch::Json::<()>(patch))
        .await
        .expect("status patched");
}

fn quick_delivery() -> DeliveryConfig {
    DeliveryConfig {
        api_timeout: Duration::from_millis(400),
        retry_initial: Duration::from_millis(30),
        retry_max: Duration::from_millis(200),
        concurrency: 4,
    }
}

/// Waits (at most 10 s) until `fact` holds, checking every 20 ms.
async fn eventually<F, Fut>(what: &str, mut fact: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !fact().await {
        assert!(tokio::time::Instant::now() < deadline, "{what}: not within 10 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The real sequence: the claim write is held past the claim's timeout (no answer), the
/// unconfirmed status goes out at once and is fenced out (no claim yet), the held claim lands;
/// a plain resubmission stays refused (the verdict holds), the late answer is written.
#[tokio::test]
async fn a_held_claim_that_lands_after_its_status_was_fenced_out_is_answered_by_the_late_submit() {
    let emu = emulator().await;
    let mb = create_build(&emu, "held").await;
    let build = BuildRef::of(&mb);
    emu.hold_writes(tartan_testkit::HeldWrites::status_of(
        "macbuilds",
        "ci",
        "held",
        Duration::from_millis(1500),
        1,
    ));
    let no_answer = claim::claim(&emu.client(), Duration::from_millis(300), &mb, ME, 1).await;
    assert!(no_answer.is_err(), "the held claim got no answer: {no_answer:?}");

    let delivery = Delivery::spawn(emu.client(), quick_delivery());
    let mut progress = delivery.progress(&build);
    let snapshot = answer_snapshot(&build, 1);
    delivery.submit(&build, snapshot.clone(), 7);
    tokio::time::timeout(Duration::from_secs(10), progress.wait_for(|p| p.fenced_out.is_some()))
        .await
        .expect("fenced out in time")
        .unwrap();
    let verdict = progress.borrow().fenced_out.clone();
    // If the held write had landed before the read, this test proves nothing: it must not have.
    assert_eq!(
        verdict,
        Some(("held#1".to_string(), None)),
        "refused for want of the claim, none shown yet"
    );

    eventually("the held claim lands", || async {
        get(&emu, "held")
            .await
            .status
            .and_then(|s| s.claim)
            .is_some_and(|c| c.holder == ME && c.attempt == "held#1")
    })
    .await;
    // A plain submission of that attempt's status is still refused (the verdict stands).
    delivery.submit(&build, snapshot.clone(), 7);
    assert_eq!(
        progress.borrow().pending,
        None,
        "a stale attempt's status is not queued"
    );
    // The late answer withdraws the verdict and writes it.
    delivery.submit_after_late_claim(&build, snapshot.clone(), 7);
    tokio::time::timeout(Duration::from_secs(10), progress.wait_for(|p| p.delivered == Some(7)))
        .await
        .expect("the late answer is delivered")
        .unwrap();
    let status = get(&emu, "held").await.status.unwrap();
    assert_eq!(status.journal_seq, Some(7));
    assert_eq!(status.phase, Some(Phase::Failed));
    assert_eq!(status.claim.map(|c| c.holder).as_deref(), Some(ME));
}

/// The claim landed, but before the late answer went out the operator handed the build to
/// agent-b, which claimed it and wrote its status: the late answer is fenced out with agent-b's
/// claim shown, and agent-b's status is untouched.
#[tokio::test]
async fn a_late_answer_never_writes_over_the_holder_the_build_was_handed_to_since() {
    let emu = emulator().await;
    let mb = create_build(&emu, "handed").await;
    let build = BuildRef::of(&mb);
    let delivery = Delivery::spawn(emu.client(), quick_delivery());
    let mut progress = delivery.progress(&build);
    let snapshot = answer_snapshot(&build, 1);
    delivery.submit(&build, snapshot.clone(), 7);
    tokio::time::timeout(Duration::from_secs(10), progress.wait_for(|p| p.fenced_out.is_some()))
        .await
        .expect("fenced out in time")
        .unwrap();
    // Our claim lands (as the held write would), then is reset, and agent-b claims and reports.
    let ours = claim_of(ME, "handed#1", 1);
    let p = serde_json::to_value(first_claim_patch(&get(&emu, "handed").await, &ours)).unwrap();
    patch_status(&emu, "handed", p).await;
    patch_status(
        &emu,
        "handed",
        json!([
            {"op": "test", "path": "/status/claim/holder", "value": ME},
            {"op": "remove", "path": "/status/claim"},
        ]),
    )
    .await;
    patch_status(
        &emu,
        "handed",
        json!([
            {"op": "add", "path": "/status/claim", "value": {"holder": "agent-b", "attempt": "handed#2", "epoch": 2}},
            {"op": "add", "path": "/status/journalSeq", "value": 3},
            {"op": "add", "path": "/status/phase", "value": "Running"},
            {"op": "add", "path": "/status/message", "value": "agent-b runs it"},
        ]),
    )
    .await;
    let before = get(&emu, "handed").await.status;
    delivery.submit_after_late_claim(&build, snapshot, 7);
    tokio::time::timeout(
        Duration::from_secs(10),
        progress.wait_for(|p| {
            p.fenced_out
                .as_ref()
                .is_some_and(|(_, now)| now.as_ref().is_some_and(|c| c.holder == "agent-b"))
        }),
    )
    .await
    .expect("fenced out on agent-b's claim")
    .unwrap();
    assert_eq!(progress.borrow().delivered, None);
    assert_eq!(get(&emu, "handed").await.status, before, "agent-b's status untouched");
}

// ---------------------------------------------------------------------------------------------
// Part 3: what an agent's status says of an admitted attempt (evidence for the controller's
// `nothing_admitted`, see controller/src/adversary17_tests.rs).

/// After a restart, the status base of a build whose `Admitted` record never reached the cluster
/// is the cluster's (the claim only): the records that follow list the admitted, booting attempt
/// without `startedAt` (only an `Admitted` record stamps it). Only `status.deadline` then tells
/// that it was admitted, and the next holder's status overwrites that field with its own attempt's
/// (none before its admission). So a MacBuild can list another host's admitted attempt with no
/// sign of its admission once handed on.
#[test]
fn an_admitted_attempt_recovered_from_the_claim_only_status_is_listed_without_started_at() {
    use tartan_agent::machine::{self, Event};
    use tartan_agent::status::{Reporter, next_status};
    let b = bref("b", "uid-b");
    let cfg = machine::Config::default();
    let now = Timestamp::now();
    let mut a = Attempt::new(b.clone(), 1, "mb-ci-b-a1", 2);
    a.state = AttemptState::Admitted;
    a.slot = Some(0);
    a.deadline = Some(now + k8s_openapi::jiff::SignedDuration::from_secs(600));
    a.last_seq = Some(4);
    let t = machine::step(&a, Event::Boot, now, &cfg).expect("Admitted -> Booting");
    let r = a.record(&t, 5);
    a.observe(&r);
    // What the cluster showed at the restart: our claim, nothing else.
    let cluster = MacBuildStatus {
        claim: Some(claim_of(ME, "b#1", 1)),
        phase: Some(Phase::Pending),
        ..Default::default()
    };
    let who = Reporter {
        holder: ME,
        epoch: 1,
        results: None,
        retry_follows: false,
        generation: None,
        logs: None,
    };
    let s = next_status(&cluster, &a, &r, &who);
    assert_eq!(s.phase, Some(Phase::Booting), "the VM is being booted");
    assert_eq!(s.attempts.len(), 1);
    assert_eq!(
        s.attempts[0].started_at, None,
        "no admission time for an admitted attempt"
    );
    assert!(s.deadline.is_some(), "only the deadline says it was admitted");
}
