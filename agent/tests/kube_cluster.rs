//! The agent's Kubernetes side against the API emulator, over real HTTP: Lease, claim, finalizer,
//! status delivery and Events.

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, WatchEvent, WatchParams};
use serde_json::json;
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tartan_agent::cluster::claim::{self, ClaimOutcome, first_claim_patch};
use tartan_agent::cluster::delivery::{Delivered, Delivery, DeliveryConfig, Fence, deliver_once};
use tartan_agent::cluster::events::Events;
use tartan_agent::cluster::lease::{LeaseConfig, LeaseKeeper, LeaseState, lease_name};
use tartan_agent::cluster::view::MacBuildView;
use tartan_agent::config::Config;
use tartan_agent::record::{RECORD_VERSION, Record};
use tartan_api::{AGENT_LABEL, AttemptState, Claim, FINALIZER, FINISHED_LABEL, Phase, Reason};
use tartan_testkit::{Availability, DenyRule, EmulatorHandle, PredicateOp, Target};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

mod cluster_common;
use cluster_common::*;

/// Waits (at most `limit`) until `fact` holds, checking it every 20 ms.
async fn eventually<F, Fut>(what: &str, limit: Duration, mut fact: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    while !fact().await {
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn wait_state(
    rx: &mut watch::Receiver<LeaseState>,
    what: &str,
    limit: Duration,
    pred: impl FnMut(&LeaseState) -> bool,
) -> LeaseState {
    tokio::time::timeout(limit, rx.wait_for(pred))
        .await
        .unwrap_or_else(|_| panic!("timed out after {limit:?} waiting for: {what}"))
        .expect("lease keeper alive")
        .clone()
}

fn short_lease(agent: &str) -> LeaseConfig {
    LeaseConfig {
        agent_id: agent.into(),
        namespace: "default".into(),
        renew_every: Duration::from_millis(100),
        duration: Duration::from_secs(1),
        api_timeout: Duration::from_millis(80),
    }
}

fn quick_delivery() -> DeliveryConfig {
    DeliveryConfig {
        api_timeout: API_TIMEOUT,
        retry_initial: Duration::from_millis(30),
        retry_max: Duration::from_millis(200),
        concurrency: 8,
    }
}

// ---------------------------------------------------------------------------------------------
// Lease

#[tokio::test]
async fn lease_is_created_and_renewed_with_the_controllers_conventions() {
    let emu = emulator().await;
    let keeper = LeaseKeeper::spawn(emu.client(), short_lease("mac-a"));
    let mut rx = keeper.state();
    let first = wait_state(&mut rx, "first renewal", Duration::from_secs(5), |s| s.renewals >= 1).await;
    assert!(first.can_claim(Instant::now()));
    let leases: Api<Lease> = Api::namespaced(emu.client(), "default");
    let lease = leases.get("tartan-agent-mac-a").await.unwrap();
    assert_eq!(lease.metadata.labels.as_ref().unwrap()[AGENT_LABEL], "mac-a");
    let spec = lease.spec.unwrap();
    assert_eq!(spec.holder_identity.as_deref(), Some("mac-a"));
    assert_eq!(spec.lease_duration_seconds, Some(1));
    let acquired = spec.acquire_time.unwrap().0;
    let renewed = spec.renew_time.unwrap().0;

    wait_state(&mut rx, "three more renewals", Duration::from_secs(5), |s| {
        s.renewals >= 4
    })
    .await;
    let later = leases.get("tartan-agent-mac-a").await.unwrap().spec.unwrap();
    assert!(later.renew_time.unwrap().0 > renewed, "renewTime moves on");
    assert_eq!(later.acquire_time.unwrap().0, acquired, "acquireTime is kept");
    assert!(keeper.can_claim());
    keeper.stop();
}

#[tokio::test]
async fn lease_with_the_default_timings_renews_every_5s_for_20s() {
    let emu = emulator().await;
    let config = Config::from_toml(
        std::path::Path::new("agent.toml"),
        "agent_id = \"mac-defaults\"",
        "host",
        Some(std::path::Path::new("/h")),
    )
    .unwrap();
    let cfg = LeaseConfig::from_config(&config);
    assert_eq!(
        (cfg.renew_every, cfg.duration),
        (Duration::from_secs(5), Duration::from_secs(20))
    );
    let keeper = LeaseKeeper::spawn(emu.client(), cfg);
    let mut rx = keeper.state();
    let s1 = wait_state(&mut rx, "first renewal", Duration::from_secs(3), |s| s.renewals >= 1).await;
    let t1 = s1.last_renewed.unwrap();
    assert_eq!(s1.expires_at(), Some(t1 + Duration::from_secs(20)));
    let leases: Api<Lease> = Api::namespaced(emu.client(), "default");
    let spec = leases.get("tartan-agent-mac-defaults").await.unwrap().spec.unwrap();
    assert_eq!(spec.lease_duration_seconds, Some(20));
    let s2 = wait_state(&mut rx, "second renewal", Duration::from_secs(8), |s| s.renewals >= 2).await;
    let period = s2.last_renewed.unwrap() - t1;
    assert!(
        period >= Duration::from_millis(4900) && period <= Duration::from_millis(5500),
        "renewed after {period:?}"
    );
    keeper.stop();
}

#[tokio::test]
async fn a_foreign_write_gives_409_then_the_lease_is_read_again_and_still_ours() {
    let emu = emulator().await;
    let keeper = LeaseKeeper::spawn(emu.client(), short_lease("mac-b"));
    let mut rx = keeper.state();
    wait_state(&mut rx, "first renewal", Duration::from_secs(5), |s| s.renewals >= 1).await;
    // Someone (say, kubectl label) touches the Lease: its resourceVersion moves on.
    let leases: Api<Lease> = Api::namespaced(emu.client(), "default");
    leases
        .patch(
            "tartan-agent-mac-b",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"touched": "yes"}}})),
        )
        .await
        .unwrap();
    let after = wait_state(&mut rx, "a 409 and a renewal after it", Duration::from_secs(5), |s| {
        s.conflicts >= 1
    })
    .await;
    let renewals = after.renewals;
    let s = wait_state(&mut rx, "renewals go on", Duration::from_secs(5), |s| {
        s.renewals > renewals
    })
    .await;
    assert_eq!(s.held_by_other, None);
    assert!(s.can_claim(Instant::now()));
    let lease = leases.get("tartan-agent-mac-b").await.unwrap();
    assert_eq!(
        lease.metadata.labels.as_ref().unwrap()["touched"],
        "yes",
        "merge kept the label"
    );
    keeper.stop();
}

#[tokio::test]
async fn a_lease_held_by_someone_else_stops_claiming_until_it_is_ours_again() {
    let emu = emulator().await;
    let keeper = LeaseKeeper::spawn(emu.client(), short_lease("mac-c"));
    let mut rx = keeper.state();
    wait_state(&mut rx, "first renewal", Duration::from_secs(5), |s| s.renewals >= 1).await;
    let leases: Api<Lease> = Api::namespaced(emu.client(), "default");
    let intrude = |holder: &'static str| {
        let leases = leases.clone();
        async move {
            leases
                .patch(
                    "tartan-agent-mac-c",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"holderIdentity": holder}})),
                )
                .await
                .unwrap();
        }
    };
    intrude("intruder").await;
    let s = wait_state(&mut rx, "the other holder noticed", Duration::from_secs(5), |s| {
        s.held_by_other.is_some()
    })
    .await;
    assert_eq!(s.held_by_other.as_deref(), Some("intruder"));
    assert!(!s.can_claim(Instant::now()), "not ours: no claiming at once");
    // The agent keeps looking but never writes over another holder.
    let renewals = s.renewals;
    let count = |method: &'static str| {
        emu.requests()
            .iter()
            .filter(|r| r.starts_with(method) && r.contains("/leases/tartan-agent-mac-c"))
            .count()
    };
    let (gets, patches) = (count("GET "), count("PATCH "));
    eventually("two more reads of the Lease", Duration::from_secs(5), || async {
        count("GET ") >= gets + 2
    })
    .await;
    assert_eq!(count("PATCH "), patches, "no write over another holder");
    let lease = leases.get("tartan-agent-mac-c").await.unwrap();
    assert_eq!(lease.spec.unwrap().holder_identity.as_deref(), Some("intruder"));
    assert_eq!(rx.borrow().renewals, renewals);

    intrude("mac-c").await;
    let s = wait_state(&mut rx, "ours again", Duration::from_secs(5), |s| s.renewals > renewals).await;
    assert!(s.can_claim(Instant::now()));
    keeper.stop();
}

#[tokio::test]
async fn renewals_failing_for_the_lease_duration_stop_claiming_on_the_monotonic_clock() {
    let emu = emulator().await;
    let keeper = LeaseKeeper::spawn(emu.client(), short_lease("mac-d"));
    let mut rx = keeper.state();
    wait_state(&mut rx, "first renewal", Duration::from_secs(5), |s| s.renewals >= 1).await;
    emu.set_availability(Availability::Unavailable);
    let failing = wait_state(&mut rx, "a failed renewal", Duration::from_secs(5), |s| {
        s.last_error.is_some()
    })
    .await;
    let last_ok = failing.last_renewed.unwrap();
    assert!(failing.can_claim(Instant::now()), "one failure is not expiry");
    // The state changes on every failed try, so this re-checks the clock every period.
    let expired = wait_state(&mut rx, "self-expiry", Duration::from_secs(5), |s| {
        !s.can_claim(Instant::now())
    })
    .await;
    assert_eq!(expired.last_renewed, Some(last_ok), "no renewal succeeded meanwhile");
    assert!(Instant::now() - last_ok >= Duration::from_secs(1));

    emu.set_availability(Availability::Up);
    let back = wait_state(&mut rx, "renewed again", Duration::from_secs(5), |s| {
        s.can_claim(Instant::now())
    })
    .await;
    assert!(back.last_renewed.unwrap() > last_ok);
    assert_eq!(back.last_error, None);
    keeper.stop();
}

// ---------------------------------------------------------------------------------------------
// Claim and finalizer

#[tokio::test]
async fn two_agents_race_for_one_macbuild_and_exactly_one_wins() {
    let emu = emulator().await;
    let mb = create_build(&emu, "race").await;
    let host = BTreeMap::from([("xcode".to_string(), "16".to_string())]);
    assert_eq!(claim::claimable(&mb, &host, &[]), Ok(()));
    // Both read the same resourceVersion, then claim at once.
    let (client_a, client_b) = (emu.client(), emu.client());
    let (a, b) = tokio::join!(
        claim::claim(&client_a, API_TIMEOUT, &mb, "mac-a", 1),
        claim::claim(&client_b, API_TIMEOUT, &mb, "mac-b", 1),
    );
    let outcomes = [("mac-a", a.unwrap()), ("mac-b", b.unwrap())];
    let winners: Vec<&str> = outcomes
        .iter()
        .filter(|(_, o)| matches!(o, ClaimOutcome::Won { .. }))
        .map(|(a, _)| *a)
        .collect();
    assert_eq!(winners.len(), 1, "{outcomes:?}");
    let loser = outcomes.iter().find(|(a, _)| *a != winners[0]).unwrap();
    assert!(matches!(&loser.1, ClaimOutcome::Lost { .. }), "{:?}", loser.1);

    let now = get(&emu, "race").await;
    let status = now.status.as_ref().unwrap();
    assert_eq!(
        status.claim,
        Some(Claim {
            holder: winners[0].into(),
            attempt: "race#1".into(),
            epoch: 1
        })
    );
    assert_eq!(status.phase, Some(Phase::Pending));
    assert_eq!(now.metadata.finalizers, Some(vec![FINALIZER.to_string()]));
    assert_eq!(now.metadata.labels.as_ref().unwrap()[AGENT_LABEL], winners[0]);
    // The loser, now reading the claimed build, is not even allowed to try.
    assert!(claim::claimable(&now, &host, &[]).is_err());
    match claim::claim(&emu.client(), API_TIMEOUT, &now, loser.0, 1)
        .await
        .unwrap()
    {
        ClaimOutcome::Lost { reason } => assert!(reason.contains("Claimed"), "{reason}"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_claim_on_a_read_made_stale_by_another_write_is_made_again_on_a_fresh_read() {
    let emu = emulator().await;
    let stale = create_build(&emu, "stale").await;
    // Someone touches the build after our read; it stays unclaimed. Giving up here journaled the
    // attempt as lost, and an agent never claims an attempt twice: had every agent read the
    // build before that write, nobody would ever have claimed it.
    builds(&emu)
        .patch(
            "stale",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"x": "y"}}})),
        )
        .await
        .unwrap();
    let (c, _) = won(&emu, &stale, "mac-a", 1).await;
    assert_eq!(c.holder, "mac-a");
    let now = get(&emu, "stale").await;
    assert_eq!(
        now.status.and_then(|s| s.claim).map(|c| c.holder).as_deref(),
        Some("mac-a")
    );
    assert_eq!(now.metadata.finalizers, Some(vec![FINALIZER.to_string()]));
}

#[tokio::test]
async fn a_claim_on_a_read_from_before_another_agents_claim_is_lost_without_writing_again() {
    let emu = emulator().await;
    let stale = create_build(&emu, "taken").await;
    won(&emu, &stale, "mac-b", 1).await;
    let writes_before = status_writes(&emu, "taken");
    match claim::claim(&emu.client(), API_TIMEOUT, &stale, "mac-a", 1)
        .await
        .unwrap()
    {
        ClaimOutcome::Lost { reason } => {
            assert!(reason.contains("test failed") && reason.contains("mac-b"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    // One losing write, then only the read that showed mac-b's claim.
    assert_eq!(status_writes(&emu, "taken") - writes_before, 1);
    let now = get(&emu, "taken").await;
    assert_eq!(
        now.status.and_then(|s| s.claim).map(|c| c.holder).as_deref(),
        Some("mac-b")
    );
}

/// How many status writes the emulator answered for MacBuild `name`.
fn status_writes(emu: &EmulatorHandle, name: &str) -> usize {
    let path = format!("/macbuilds/{name}/status");
    emu.answers()
        .iter()
        .filter(|a| a.method == "PATCH" && a.uri.split('?').next().is_some_and(|p| p.ends_with(&path)))
        .count()
}

#[tokio::test]
async fn a_crash_between_claim_and_finalizer_is_healed_by_claiming_again() {
    let emu = emulator().await;
    let mb = create_build(&emu, "healed").await;
    // The first write landed, then the agent died before adding the finalizer.
    let c = claim::claim_for(&mb, "mac-a", 1);
    builds(&emu)
        .patch_status(
            "healed",
            &PatchParams::default(),
            &Patch::Json::<()>(first_claim_patch(&mb, &c)),
        )
        .await
        .unwrap();
    let half = get(&emu, "healed").await;
    assert_eq!(half.metadata.finalizers, None);
    let (again, after) = won(&emu, &half, "mac-a", 1).await;
    assert_eq!(again, c);
    assert_eq!(after.metadata.finalizers, Some(vec![FINALIZER.to_string()]));
    // And from the original (pre-claim) read too: our own claim is recognised, not "lost".
    let (_, again) = won(&emu, &mb, "mac-a", 1).await;
    assert_eq!(again.metadata.finalizers, Some(vec![FINALIZER.to_string()]));
}

/// An agent that journaled `Requested`, claimed and added its finalizer, then restarted (or was
/// paused) resumes the admission from its recovery read, which shows all of that. Meanwhile its
/// Lease expired, an operator handed the build on and mac-b claimed it (the same attempt id: the
/// status listed no attempt yet). The old read must not count as a win: mac-a would clone a
/// second VM for a build mac-b runs. Before the fix `claim` returned `Won` without asking the API.
#[tokio::test]
async fn a_claim_resumed_on_a_stale_read_of_our_own_claim_is_lost_once_the_build_was_handed_on() {
    let emu = emulator().await;
    let mb = create_build(&emu, "resumed").await;
    let (_, stale) = won(&emu, &mb, "mac-a", 1).await;
    let reset: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/status/claim/holder", "value": "mac-a"},
        {"op": "remove", "path": "/status/claim"},
    ]))
    .unwrap();
    let reset = builds(&emu)
        .patch_status("resumed", &PatchParams::default(), &Patch::Json::<()>(reset))
        .await
        .unwrap();
    won(&emu, &reset, "mac-b", 1).await;
    match claim::claim(&emu.client(), API_TIMEOUT, &stale, "mac-a", 1)
        .await
        .unwrap()
    {
        ClaimOutcome::Lost { reason } => assert!(reason.contains("mac-b"), "{reason}"),
        won => panic!("mac-a won a build mac-b holds: {won:?}"),
    }
    let now = get(&emu, "resumed").await;
    assert_eq!(
        now.status.and_then(|s| s.claim).map(|c| c.holder).as_deref(),
        Some("mac-b")
    );
    // Still held by mac-a: the confirmed claim wins again, without a second claim write.
    let mb = create_build(&emu, "kept").await;
    let (c, held) = won(&emu, &mb, "mac-a", 1).await;
    let writes = status_writes(&emu, "kept");
    let (again, _) = won(&emu, &held, "mac-a", 1).await;
    assert_eq!((again, status_writes(&emu, "kept")), (c, writes));
}

#[tokio::test]
async fn the_finalizer_holds_deletion_until_released() {
    let emu = emulator().await;
    let mb = create_build(&emu, "fin").await;
    let (_, mb) = won(&emu, &mb, "mac-a", 1).await;
    builds(&emu).delete("fin", &DeleteParams::default()).await.unwrap();
    let deleting = get(&emu, "fin").await;
    assert!(deleting.metadata.deletion_timestamp.is_some(), "held by the finalizer");
    claim::release(&emu.client(), API_TIMEOUT, &build_ref(&mb), "mac-a")
        .await
        .unwrap();
    eventually("MacBuild gone after release", Duration::from_secs(5), || async {
        builds(&emu).get_opt("fin").await.unwrap().is_none()
    })
    .await;
    // Releasing again is a no-op.
    claim::release(&emu.client(), API_TIMEOUT, &build_ref(&mb), "mac-a")
        .await
        .unwrap();
}

#[tokio::test]
async fn release_leaves_the_finalizer_of_a_build_handed_on_to_another_holder() {
    let emu = emulator().await;
    let mb = create_build(&emu, "handed-on").await;
    let (_, mb) = won(&emu, &mb, "mac-a", 1).await;
    // An operator hands the build on (mac-a unreachable): the claim is removed, mac-b claims it,
    // and the finalizer already there now keeps mac-b's VM.
    let reset: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/status/claim/holder", "value": "mac-a"},
        {"op": "remove", "path": "/status/claim"},
    ]))
    .unwrap();
    let reset = builds(&emu)
        .patch_status("handed-on", &PatchParams::default(), &Patch::Json::<()>(reset))
        .await
        .unwrap();
    let (_, by_b) = won(&emu, &reset, "mac-b", 1).await;
    assert_eq!(by_b.metadata.finalizers, Some(vec![FINALIZER.to_string()]));
    // mac-a comes back, deletes its own VM and releases: the finalizer stays for mac-b.
    claim::release(&emu.client(), API_TIMEOUT, &build_ref(&mb), "mac-a")
        .await
        .unwrap();
    assert_eq!(
        get(&emu, "handed-on").await.metadata.finalizers,
        Some(vec![FINALIZER.to_string()]),
        "mac-b's build keeps its finalizer"
    );
    claim::release(&emu.client(), API_TIMEOUT, &build_ref(&mb), "mac-b")
        .await
        .unwrap();
    assert_eq!(get(&emu, "handed-on").await.metadata.finalizers, None);
}

#[tokio::test]
async fn release_removes_only_our_finalizer() {
    let emu = emulator().await;
    create_build(&emu, "others").await;
    builds(&emu)
        .patch(
            "others",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": ["example.com/keep"]}})),
        )
        .await
        .unwrap();
    let mb = builds(&emu).get("others").await.unwrap();
    let (_, mb) = won(&emu, &mb, "mac-a", 1).await;
    assert_eq!(
        mb.metadata.finalizers,
        Some(vec!["example.com/keep".to_string(), FINALIZER.to_string()])
    );
    claim::release(&emu.client(), API_TIMEOUT, &build_ref(&mb), "mac-a")
        .await
        .unwrap();
    assert_eq!(
        get(&emu, "others").await.metadata.finalizers,
        Some(vec!["example.com/keep".to_string()])
    );
}

// ---------------------------------------------------------------------------------------------
// Status delivery

#[tokio::test]
async fn a_stale_attempts_status_write_is_fenced_out() {
    let emu = emulator().await;
    let mb = create_build(&emu, "retry").await;
    let (c1, mb1) = won(&emu, &mb, "mac-a", 1).await;
    let build = build_ref(&mb1);
    let running = claimed_status(&c1, Phase::Running, "attempt 1 runs");
    assert_eq!(
        deliver_once(&emu.client(), API_TIMEOUT, &build, &running, 10, &mut None)
            .await
            .unwrap(),
        Delivered::Written
    );
    // Attempt 1 was interrupted; the same agent claims attempt 2.
    let (c2, _) = won(&emu, &get(&emu, "retry").await, "mac-a", 2).await;
    assert_eq!((c2.attempt.as_str(), c2.epoch), ("retry#2", 2));
    // A late write of attempt 1 is refused by its test and changes nothing.
    let late = claimed_status(&c1, Phase::Succeeded, "attempt 1 (stale) says done");
    let before = get(&emu, "retry").await;
    match deliver_once(&emu.client(), API_TIMEOUT, &build, &late, 11, &mut None)
        .await
        .unwrap()
    {
        Delivered::FencedOut { now } => assert_eq!(now, Some(c2.clone())),
        other => panic!("{other:?}"),
    }
    assert_eq!(get(&emu, "retry").await.status, before.status);

    // Through the queue: reported, not retried, and later snapshots of attempt 1 are ignored.
    let delivery = Delivery::spawn(emu.client(), quick_delivery());
    let mut progress = delivery.progress(&build);
    delivery.submit(&build, late.clone(), 12);
    let p = tokio::time::timeout(Duration::from_secs(5), progress.wait_for(|p| p.fenced_out.is_some()))
        .await
        .unwrap()
        .unwrap()
        .clone();
    assert_eq!(p.fenced_out, Some(("retry#1".to_string(), Some(c2.clone()))));
    assert_eq!((p.delivered, p.pending, p.failed_tries), (None, None, 0));
    delivery.submit(&build, late, 13);
    assert_eq!(progress.borrow().pending, None, "stale attempt not queued again");
    // Attempt 2's writes go through.
    delivery.submit(&build, claimed_status(&c2, Phase::Running, "attempt 2 runs"), 14);
    tokio::time::timeout(Duration::from_secs(5), progress.wait_for(|p| p.delivered == Some(14)))
        .await
        .unwrap()
        .unwrap();
    let status = get(&emu, "retry").await.status.unwrap();
    assert_eq!((status.journal_seq, status.claim), (Some(14), Some(c2)));
}

/// Seed 81043, `chaos-2928`: attempt 1 interrupted by an agent restart, its retry journaled, the
/// CustomRun cancelled before the retry's claim was written; the retry ended "nothing cloned", and
/// its end was fenced out ("attempt #2 is stale") as the MacBuild still showed our claim of #1: it
/// said "Pending" for ever.
#[tokio::test]
async fn a_retry_that_ends_before_its_claim_is_written_delivers_its_end_under_our_claim_it_follows() {
    let emu = emulator().await;
    let mb = create_build(&emu, "unclaimed-retry").await;
    let (c1, mb1) = won(&emu, &mb, "mac-a", 1).await;
    let build = build_ref(&mb1);
    let pending = claimed_status(&c1, Phase::Pending, "attempt 1 interrupted; a retry follows");
    let mut fence = None;
    assert_eq!(
        deliver_once(&emu.client(), API_TIMEOUT, &build, &pending, 622, &mut fence)
            .await
            .unwrap(),
        Delivered::Written
    );
    let c2 = Claim {
        holder: "mac-a".into(),
        attempt: "unclaimed-retry#2".into(),
        epoch: c1.epoch + 1,
    };
    let ended = claimed_status(
        &c2,
        Phase::Cancelled,
        "cancel requested before admission; nothing cloned",
    );
    // On the fence the worker keeps (its last write's), and on a fresh read.
    for mut fence in [fence.clone(), None] {
        let before = get(&emu, "unclaimed-retry").await.status.unwrap();
        assert_eq!(
            deliver_once(&emu.client(), API_TIMEOUT, &build, &ended, 624, &mut fence)
                .await
                .unwrap(),
            Delivered::Written
        );
        let after = get(&emu, "unclaimed-retry").await.status.unwrap();
        assert_eq!(
            (after.phase, after.claim.as_ref(), after.journal_seq),
            (Some(Phase::Cancelled), Some(&c2), Some(624))
        );
        // Back to attempt 1's status for the second round.
        builds(&emu)
            .patch_status(
                "unclaimed-retry",
                &PatchParams::default(),
                &Patch::Merge(json!({"status": before})),
            )
            .await
            .unwrap();
    }
    // Not when the claim shown is another agent's, or ours two attempts back.
    let c3 = Claim {
        attempt: "unclaimed-retry#3".into(),
        ..c2.clone()
    };
    let third = claimed_status(&c3, Phase::Cancelled, "attempt 3");
    match deliver_once(&emu.client(), API_TIMEOUT, &build, &third, 700, &mut None)
        .await
        .unwrap()
    {
        Delivered::FencedOut { now } => assert_eq!(now, Some(c1.clone())),
        other => panic!("{other:?}"),
    }
    let theirs = Claim {
        holder: "mac-b".into(),
        ..c2.clone()
    };
    match deliver_once(
        &emu.client(),
        API_TIMEOUT,
        &build,
        &claimed_status(&theirs, Phase::Cancelled, "not ours"),
        701,
        &mut None,
    )
    .await
    .unwrap()
    {
        Delivered::FencedOut { now } => assert_eq!(now, Some(c1)),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn deliveries_of_one_build_arrive_in_order_and_never_go_back() {
    let emu = emulator().await;
    let mb = create_build(&emu, "order").await;
    let (c, mb) = won(&emu, &mb, "mac-a", 1).await;
    let build = build_ref(&mb);
    // Watch every version of the object the API stores.
    let stream = builds(&emu)
        .watch(
            &WatchParams::default().fields("metadata.name=order"),
            mb.metadata.resource_version.as_deref().unwrap(),
        )
        .await
        .unwrap();
    let seen = tokio::spawn(async move {
        let mut seqs = Vec::new();
        let mut stream = std::pin::pin!(stream);
        while let Some(ev) = stream.next().await {
            if let Ok(WatchEvent::Modified(m)) = ev
                && let Some(seq) = m.status.and_then(|s| s.journal_seq)
            {
                seqs.push(seq);
                if seq == 30 {
                    break;
                }
            }
        }
        seqs
    });
    let delivery = Delivery::spawn(emu.client(), quick_delivery());
    let phases = [
        Phase::Admitted,
        Phase::Booting,
        Phase::Running,
        Phase::Collecting,
        Phase::Retiring,
    ];
    for (i, phase) in phases.iter().enumerate() {
        delivery.submit(&build, claimed_status(&c, *phase, "step"), 26 + i as u64);
    }
    let seqs = tokio::time::timeout(Duration::from_secs(10), seen)
        .await
        .unwrap()
        .unwrap();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "journalSeq went back: {seqs:?}");
    assert_eq!(seqs.last(), Some(&30));
    assert_eq!(delivery.delivered(&build), Some(30));
    let status = get(&emu, "order").await.status.unwrap();
    assert_eq!((status.phase, status.journal_seq), (Some(Phase::Retiring), Some(30)));
    // An older snapshot submitted late is never sent.
    let requests = emu.requests().len();
    delivery.submit(&build, claimed_status(&c, Phase::Running, "old"), 28);
    assert_eq!(delivery.progress(&build).borrow().pending, None);
    assert_eq!(get(&emu, "order").await.status.unwrap().journal_seq, Some(30));
    assert_eq!(emu.requests().len(), requests + 1, "only our own read above");
}

#[tokio::test]
async fn a_denied_terminal_status_is_retried_until_the_policy_is_lifted_while_other_builds_proceed() {
    let emu = emulator().await;
    let a = create_build(&emu, "denied").await;
    let b = create_build(&emu, "other").await;
    let (ca, a) = won(&emu, &a, "mac-a", 1).await;
    let (cb, b) = won(&emu, &b, "mac-a", 1).await;
    let (ra, rb) = (build_ref(&a), build_ref(&b));
    emu.add_deny_rule(
        DenyRule::new("mac-ci-deny-terminal-status")
            .resource("tartan.dev", "macbuilds")
            .subresource("status")
            .when(
                Target::Object,
                "status.phase",
                PredicateOp::In,
                &[json!("Succeeded"), json!("Failed")],
            ),
    );
    let delivery = Delivery::spawn(emu.client(), quick_delivery());
    let mut pa = delivery.progress(&ra);
    let mut pb = delivery.progress(&rb);
    delivery.submit(&ra, claimed_status(&ca, Phase::Collecting, "collecting"), 218);
    tokio::time::timeout(Duration::from_secs(5), pa.wait_for(|p| p.delivered == Some(218)))
        .await
        .unwrap()
        .unwrap();
    let mut done = claimed_status(&ca, Phase::Succeeded, "2/2 tests passed");
    done.outcome = Some(tartan_api::Outcome::Succeeded);
    delivery.submit(&ra, done, 219);
    let p = tokio::time::timeout(Duration::from_secs(5), pa.wait_for(|p| p.failed_tries >= 3))
        .await
        .unwrap()
        .unwrap()
        .clone();
    assert!(
        p.last_error.as_deref().unwrap().contains("mac-ci-deny-terminal-status"),
        "{p:?}"
    );
    assert_eq!(
        (p.delivered, p.pending, p.fenced_out.as_ref()),
        (Some(218), Some(219), None)
    );
    // Meanwhile another build's deliveries go through.
    delivery.submit(&rb, claimed_status(&cb, Phase::Running, "running"), 300);
    tokio::time::timeout(Duration::from_secs(5), pb.wait_for(|p| p.delivered == Some(300)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(get(&emu, "denied").await.status.unwrap().phase, Some(Phase::Collecting));

    emu.clear_deny_rules();
    let p = tokio::time::timeout(Duration::from_secs(5), pa.wait_for(|p| p.delivered == Some(219)))
        .await
        .unwrap()
        .unwrap()
        .clone();
    assert_eq!((p.pending, p.last_error), (None, None));
    let status = get(&emu, "denied").await.status.unwrap();
    assert_eq!((status.phase, status.journal_seq), (Some(Phase::Succeeded), Some(219)));
}

#[tokio::test]
async fn a_forbidden_write_is_retried_and_a_gone_build_stops_delivery() {
    let emu = emulator().await;
    let mb = create_build(&emu, "forbidden").await;
    let (c, mb) = won(&emu, &mb, "mac-a", 1).await;
    let build = build_ref(&mb);
    emu.add_deny_rule(
        DenyRule::new("no-status")
            .resource("tartan.dev", "macbuilds")
            .subresource("status")
            .forbidden(),
    );
    let snapshot = claimed_status(&c, Phase::Running, "running");
    let err = deliver_once(&emu.client(), API_TIMEOUT, &build, &snapshot, 5, &mut None)
        .await
        .unwrap_err();
    assert!(err.to_string().starts_with("refused:"), "{err}");
    emu.clear_deny_rules();
    // The MacBuild goes away (finalizer released, then deleted).
    claim::release(&emu.client(), API_TIMEOUT, &build, "mac-a")
        .await
        .unwrap();
    builds(&emu)
        .delete("forbidden", &DeleteParams::default())
        .await
        .unwrap();
    eventually("MacBuild deleted", Duration::from_secs(5), || async {
        builds(&emu).get_opt("forbidden").await.unwrap().is_none()
    })
    .await;
    let delivery = Delivery::spawn(emu.client(), quick_delivery());
    let mut p = delivery.progress(&build);
    delivery.submit(&build, snapshot, 6);
    tokio::time::timeout(Duration::from_secs(5), p.wait_for(|p| p.gone))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(p.borrow().delivered, None);
}

/// A status write whose answer was lost (the agent timed out) but that the API server applies
/// late, after the next write of the same build landed, must not take the MacBuild back: the
/// terminal status stays, or the pipeline never hears the end.
#[tokio::test]
async fn a_timed_out_status_write_applied_late_never_overwrites_a_newer_status() {
    let emu = emulator().await;
    let mb = create_build(&emu, "late").await;
    let (c, mb) = won(&emu, &mb, "mac-a", 1).await;
    let build = build_ref(&mb);
    let delivery = Delivery::spawn(
        emu.client(),
        DeliveryConfig {
            api_timeout: Duration::from_millis(300),
            ..quick_delivery()
        },
    );
    let mut progress = delivery.progress(&build);
    let within = Duration::from_secs(10);
    delivery.submit(&build, claimed_status(&c, Phase::Collecting, "collecting"), 29);
    tokio::time::timeout(within, progress.wait_for(|p| p.delivered == Some(29)))
        .await
        .unwrap()
        .unwrap();
    // The Retiring write is held past the agent's timeout, then applied anyway.
    let hold = Duration::from_millis(1500);
    let held_from = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    emu.hold_writes(tartan_testkit::HeldWrites::status_of(
        "macbuilds",
        "ci",
        "late",
        hold,
        1,
    ));
    delivery.submit(&build, claimed_status(&c, Phase::Retiring, "retiring"), 30);
    tokio::time::timeout(within, progress.wait_for(|p| p.failed_tries >= 1))
        .await
        .unwrap()
        .unwrap();
    let mut done = claimed_status(&c, Phase::Succeeded, "2/2 tests passed");
    done.outcome = Some(tartan_api::Outcome::Succeeded);
    delivery.submit(&build, done, 31);
    tokio::time::timeout(within, progress.wait_for(|p| p.delivered == Some(31)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(get(&emu, "late").await.status.unwrap().journal_seq, Some(31));
    // The held write has been answered (to nobody) once a status write is answered after its hold.
    let held_until = (held_from + hold).as_millis() as u64;
    eventually("the held write answered", within, || async {
        emu.answers()
            .iter()
            .any(|a| a.method == "PATCH" && a.uri.contains("/macbuilds/late/status") && a.at_ms >= held_until)
    })
    .await;
    let status = get(&emu, "late").await.status.unwrap();
    assert_eq!(
        (status.phase, status.journal_seq),
        (Some(Phase::Succeeded), Some(31)),
        "the late write of record 30 took the MacBuild back"
    );
    let late: Vec<u16> = emu
        .answers()
        .iter()
        .filter(|a| a.method == "PATCH" && a.uri.contains("/macbuilds/late/status") && a.at_ms >= held_until)
        .map(|a| a.code)
        .collect();
    assert_eq!(late, [422], "the late write failed its journalSeq test");
}

/// A timed-out write that the API server applied before the next one: the next write's fence
/// test fails, the fresh read shows the older record, and the newer snapshot is written over it.
#[tokio::test]
async fn a_write_after_a_timed_out_one_that_landed_is_written_again_on_the_fresh_read() {
    let emu = emulator().await;
    let mb = create_build(&emu, "landed").await;
    let (c, mb) = won(&emu, &mb, "mac-a", 1).await;
    let build = build_ref(&mb);
    let client = emu.client();
    let timeout = Duration::from_millis(300);
    let mut fence = None;
    let collecting = claimed_status(&c, Phase::Collecting, "collecting");
    let written = deliver_once(&client, timeout, &build, &collecting, 29, &mut fence).await;
    assert_eq!(written.unwrap(), Delivered::Written);
    assert_eq!(fence, Some(Fence::JournalSeq(29)));
    emu.hold_writes(tartan_testkit::HeldWrites::status_of(
        "macbuilds",
        "ci",
        "landed",
        Duration::from_millis(600),
        1,
    ));
    let retiring = claimed_status(&c, Phase::Retiring, "retiring");
    let lost = deliver_once(&client, timeout, &build, &retiring, 30, &mut fence).await;
    assert!(lost.unwrap_err().to_string().starts_with("failed: no answer"));
    assert_eq!(
        fence,
        Some(Fence::JournalSeq(29)),
        "a write without answer teaches nothing"
    );
    eventually(
        "record 30 applied after its timeout",
        Duration::from_secs(10),
        || async { get(&emu, "landed").await.status.unwrap().journal_seq == Some(30) },
    )
    .await;
    let mut done = claimed_status(&c, Phase::Succeeded, "2/2 tests passed");
    done.outcome = Some(tartan_api::Outcome::Succeeded);
    let written = deliver_once(&client, timeout, &build, &done, 31, &mut fence).await;
    assert_eq!(written.unwrap(), Delivered::Written);
    assert_eq!(fence, Some(Fence::JournalSeq(31)));
    let status = get(&emu, "landed").await.status.unwrap();
    assert_eq!((status.phase, status.journal_seq), (Some(Phase::Succeeded), Some(31)));
    let codes: Vec<u16> = emu
        .answers()
        .iter()
        .filter(|a| a.method == "PATCH" && a.uri.contains("/macbuilds/landed/status"))
        .map(|a| a.code)
        .collect();
    // The claim, 29, the held 30, then 31 refused on the fence 29 and written again on 30.
    assert_eq!(codes, [200, 200, 200, 422, 200]);
}

/// What the Lease went through while a burst of 200 status writes met a server that serves one
/// request at a time, 25 ms each (5 s of work).
struct LeaseInABurst {
    /// The most requests any Lease request found ahead of it at the server.
    most_ahead: usize,
    /// The longest gap between renewals, the renewal rounds that failed, how long the burst took:
    /// figures to print, as they depend on the machine's load.
    gap: Duration,
    failures: u64,
    took: Duration,
}

async fn lease_during_a_burst(concurrency: usize) -> LeaseInABurst {
    let emu = emulator().await;
    let mut burst = Vec::new();
    for i in 0..200 {
        let mb = create_build(&emu, &format!("burst-{i}")).await;
        let (claim, mb) = won(&emu, &mb, "mac-burst", 1).await;
        burst.push((build_ref(&mb), claimed_status(&claim, Phase::Succeeded, "done")));
    }
    // The Lease renews every 1.5 s with requests of at most 1 s, on a client of its own.
    let lease = LeaseKeeper::spawn(
        emu.client(),
        LeaseConfig {
            agent_id: "mac-burst".into(),
            namespace: "default".into(),
            renew_every: Duration::from_millis(1500),
            duration: Duration::from_secs(6),
            api_timeout: Duration::from_secs(1),
        },
    );
    let mut state = lease.state();
    wait_state(&mut state, "first renewal", Duration::from_secs(10), |s| {
        s.renewals >= 1
    })
    .await;
    emu.set_busy(Duration::from_millis(25));
    let delivery = Delivery::spawn(
        emu.client(),
        DeliveryConfig {
            api_timeout: Duration::from_secs(30),
            concurrency,
            ..quick_delivery()
        },
    );
    let started = Instant::now();
    for (build, status) in &burst {
        delivery.submit(build, status.clone(), 10);
    }
    let mut last = state.borrow().last_renewed.expect("renewed once");
    let (mut gap, mut failures) = (Duration::ZERO, 0u64);
    let deadline = started + Duration::from_secs(60);
    let mut took = None;
    while took.is_none() {
        assert!(Instant::now() < deadline, "200 statuses not delivered within 60 s");
        let changed = tokio::time::timeout(Duration::from_millis(50), state.changed()).await;
        if matches!(changed, Ok(Ok(()))) {
            let s = state.borrow_and_update().clone();
            if let Some(at) = s.last_renewed.filter(|at| *at > last) {
                gap = gap.max(at - last);
                last = at;
            } else if s.last_error.is_some() {
                failures += 1;
            }
        }
        if burst.iter().all(|(b, _)| delivery.delivered(b) == Some(10)) {
            took = Some(started.elapsed());
        }
    }
    // The gap still open when the burst ended counts too.
    gap = gap.max(Instant::now() - last);
    emu.set_busy(Duration::ZERO);
    lease.stop();
    let lease_requests: Vec<_> = emu
        .busy_queue()
        .into_iter()
        .filter(|q| q.request.ends_with(&format!("/leases/{}", lease_name("mac-burst"))))
        .collect();
    assert!(!lease_requests.is_empty(), "no Lease request met the busy server");
    LeaseInABurst {
        most_ahead: lease_requests.iter().map(|q| q.ahead).max().unwrap_or(0),
        gap,
        failures,
        took: took.expect("set when done"),
    }
}

/// A redelivery burst at restart must not starve the agent's own Lease: with status writes capped
/// at 8 in flight, a renewal waits behind at most 8 of them; uncapped (the old behaviour: one
/// write per MacBuild, all at once), it waits behind the whole burst. Checked by counting who was
/// ahead of each Lease request at the server, not by timing renewals, which a loaded machine
/// delays whatever the cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_status_burst_on_a_slow_api_never_starves_the_lease() {
    let capped = lease_during_a_burst(8).await;
    println!(
        "capped at 8: burst delivered in {:?}, at most {} requests ahead of a Lease request, longest gap between renewals {:?}, {} failed rounds",
        capped.took, capped.most_ahead, capped.gap, capped.failures
    );
    assert!(
        capped.most_ahead <= 8,
        "a Lease request waited behind {} requests with status writes capped at 8",
        capped.most_ahead
    );
    let uncapped = lease_during_a_burst(256).await;
    println!(
        "uncapped: burst delivered in {:?}, at most {} requests ahead of a Lease request, longest gap between renewals {:?}, {} failed rounds",
        uncapped.took, uncapped.most_ahead, uncapped.gap, uncapped.failures
    );
    assert!(
        uncapped.most_ahead > 40,
        "an uncapped burst put only {} requests ahead of a Lease request: the test no longer shows the fault",
        uncapped.most_ahead
    );
}

// ---------------------------------------------------------------------------------------------
// Events

#[tokio::test]
async fn each_transition_becomes_an_event_on_the_macbuild() {
    use k8s_openapi::api::events::v1::Event;
    let emu = emulator().await;
    let mb = create_build(&emu, "described").await;
    let build = build_ref(&mb);
    let events = Events::spawn(emu.client(), "mac-a", API_TIMEOUT);
    let record = |seq: u64, from: AttemptState, to: AttemptState, reason: Reason, detail: &str| Record {
        version: RECORD_VERSION,
        seq,
        time: Timestamp::now(),
        build: Some(build.clone()),
        attempt: Some(1),
        vm: Some("mb-ci-described-1".into()),
        from: Some(from),
        to,
        reason: Some(reason),
        detail: detail.into(),
        outcome: None,
        slot: Some(0),
        deadline: None,
        max_attempts: None,
        step: None,
        generation: None,
        status: None,
        warm: None,
    };
    events.transition(&record(
        120,
        AttemptState::Booting,
        AttemptState::Running,
        Reason::GuestReady,
        "tart exec ready after 13.91s",
    ));
    events.transition(&record(
        122,
        AttemptState::Retiring,
        AttemptState::Retired,
        Reason::VMDeleted,
        "stopped and deleted in 6.03s",
    ));
    let api: Api<Event> = Api::namespaced(emu.client(), "ci");
    eventually("two events", Duration::from_secs(5), || async {
        api.list(&Default::default()).await.unwrap().items.len() >= 2
    })
    .await;
    let mut notes: Vec<(String, String)> = api
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|e| {
            let regarding = e.regarding.unwrap();
            assert_eq!(regarding.name.as_deref(), Some("described"));
            assert_eq!(regarding.uid.as_deref(), Some(build.uid.as_str()));
            assert_eq!(e.reporting_instance.as_deref(), Some("mac-a"));
            (e.reason.unwrap(), e.note.unwrap())
        })
        .collect();
    notes.sort();
    assert_eq!(
        notes,
        [
            (
                "GuestReady".to_string(),
                "#120 a1 Booting -> Running (GuestReady) tart exec ready after 13.91s".to_string()
            ),
            (
                "VMDeleted".to_string(),
                "#122 a1 Retiring -> Retired (VMDeleted) stopped and deleted in 6.03s".to_string()
            ),
        ]
    );
}

/// Sets `labels` (`None`: removes the label) on MacBuild `name` by a merge patch.
async fn label(emu: &EmulatorHandle, name: &str, labels: serde_json::Value) {
    builds(emu)
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": labels}})),
        )
        .await
        .expect("MacBuild labelled");
}

/// The names of the MacBuilds in `view`, sorted.
fn names_in(view: &MacBuildView) -> Vec<String> {
    let mut names: Vec<String> = view.builds().iter().filter_map(|mb| mb.metadata.name.clone()).collect();
    names.sort();
    names
}

#[tokio::test]
async fn the_view_holds_unfinished_builds_and_only_this_agents_finished_ones() {
    let emu = emulator().await;
    for name in ["queued", "mine-finished", "theirs-finished", "unclaimed-finished"] {
        create_build(&emu, name).await;
    }
    label(
        &emu,
        "mine-finished",
        json!({FINISHED_LABEL: "true", AGENT_LABEL: "mac-a"}),
    )
    .await;
    label(
        &emu,
        "theirs-finished",
        json!({FINISHED_LABEL: "true", AGENT_LABEL: "mac-b"}),
    )
    .await;
    label(&emu, "unclaimed-finished", json!({FINISHED_LABEL: "true"})).await;
    let changed = Arc::new(Notify::new());
    let view = MacBuildView::watch(&emu.client(), &["ci".to_string()], "mac-a", &changed);
    let wait = Duration::from_secs(10);
    let expect = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
    let want = expect(&["mine-finished", "queued"]);
    eventually("the view lists the unfinished and own finished builds", wait, || {
        let got = names_in(&view) == want;
        async move { got }
    })
    .await;
    // A build leaving the unfinished watch leaves the view; one handed to this agent enters it.
    label(&emu, "queued", json!({FINISHED_LABEL: "true", AGENT_LABEL: "mac-b"})).await;
    label(&emu, "theirs-finished", json!({AGENT_LABEL: "mac-a"})).await;
    let want = expect(&["mine-finished", "theirs-finished"]);
    eventually("the view follows the labels", wait, || {
        let got = names_in(&view) == want;
        async move { got }
    })
    .await;
}
