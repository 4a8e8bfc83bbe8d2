//! Two controller replicas under leader election (`--leader-elect`, one Lease): the leader dies or
//! freezes mid-build, the standby takes over within the lease duration, the CustomRun ends
//! correctly, and a frozen old leader that wakes up writes nothing.

use k8s_openapi::api::coordination::v1::Lease;
use std::time::{Duration, Instant};
use tartan_e2e::invariants::result;
use tartan_e2e::{AgentOptions, ControllerOptions, LeaderOptions, Stack, wait_for, wait_for_async};

fn transitions(lease: &Lease) -> i32 {
    lease.spec.as_ref().and_then(|s| s.lease_transitions).unwrap_or(0)
}

/// Two replicas, `ctl-a` leading (started first and seen holding the Lease), `ctl-b` standing by;
/// one agent; `build-1` running its (gated) build step.
async fn two_replicas_mid_build(s: &mut Stack, leader: &LeaderOptions) -> Lease {
    s.add_agent("agent-a", AgentOptions::default());
    s.start_replica("ctl-a", ControllerOptions::default(), leader);
    s.wait_leader("ctl-a", Duration::from_secs(30)).await;
    // Named in the Lease is not leading yet: a replica that creates the Lease waits its own new
    // record out like anyone's. Started before that, ctl-b waits out the same record and the two
    // race for it (ctl-b, started 0.1 s after, won once in CI: its poll came first after the 4 s).
    wait_for("ctl-a to lead", Duration::from_secs(30), || {
        let got = s.replica_http("ctl-a", "/readyz");
        (got == (200, "ok: leading\n".to_string()))
            .then_some(())
            .ok_or(format!("{got:?}"))
    })
    .await;
    let lease = s.wait_leader("ctl-a", Duration::from_secs(5)).await;
    s.start_replica("ctl-b", ControllerOptions::default(), leader);
    wait_for("ctl-b to stand by", Duration::from_secs(30), || {
        s.replica_log("ctl-b")
            .contains("standing by: ctl-a leads")
            .then_some(())
            .ok_or("not yet".to_string())
    })
    .await;
    // Readiness and metrics say who leads; a standby is Ready (it must not stall a rollout)
    // once its start-up checks passed (503 "starting" until then).
    for (id, body) in [("ctl-a", "ok: leading\n"), ("ctl-b", "ok: standing by; ctl-a leads\n")] {
        wait_for(
            &format!("{id}'s /readyz to answer 200 {body:?}"),
            Duration::from_secs(30),
            || {
                let got = s.replica_http(id, "/readyz");
                (got == (200, body.to_string())).then_some(()).ok_or(format!("{got:?}"))
            },
        )
        .await;
    }
    for (id, leading) in [("ctl-a", 1), ("ctl-b", 0)] {
        let (status, metrics) = s.replica_http(id, "/metrics");
        assert_eq!(status, 200);
        let line = format!("tartan_controller_leader{{identity=\"{id}\"}} {leading}");
        assert!(metrics.contains(&line), "{id}: no {line:?} in\n{metrics}");
    }
    s.start_agent("agent-a").await;
    s.create_run("build-1", &s.build_params(true), None).await;
    wait_for("the build step to start", Duration::from_secs(60), || {
        (s.builds_started() == 1)
            .then_some(())
            .ok_or(format!("{} started", s.builds_started()))
    })
    .await;
    assert!(
        !s.replica_log("ctl-b").contains("acquired the leader Lease"),
        "the standby never led while the leader was alive:\n{}",
        s.replica_log("ctl-b")
    );
    lease
}

// scenario: failover-killed
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_killed_mid_build_standby_takes_over() {
    leader_killed("failover-killed", LeaderOptions::default()).await;
}

/// The same on the source's timings (lease 15 s): the failover time an operator sees.
// scenario: failover-killed-source slow
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_killed_on_source_timings() {
    leader_killed("failover-killed-source", LeaderOptions::source_defaults()).await;
}

async fn leader_killed(name: &str, leader: LeaderOptions) {
    let mut s = Stack::new(name).await;
    let before = two_replicas_mid_build(&mut s, &leader).await;

    s.kill_replica("ctl-a");
    let killed = Instant::now();
    let lease = s.wait_leader("ctl-b", Duration::from_secs(30)).await;
    let failover = killed.elapsed();
    eprintln!(
        "[e2e] FAILOVER (kill -9 of the leader): ctl-b holds the leader Lease {:.2}s after the kill \
         (lease {:?}, renew every {:?}, standby polls every {:?}, margin {:?})",
        failover.as_secs_f64(),
        leader.lease,
        leader.renew_every,
        leader.retry_every,
        leader.margin
    );
    assert_eq!(transitions(&lease), transitions(&before) + 1, "one takeover");
    // One second of slack for the harness's own polling and a loaded machine.
    assert!(
        failover < leader.failover_bound() + Duration::from_secs(1),
        "failover took {failover:?}, more than {:?}",
        leader.failover_bound()
    );

    s.open_gate();
    let run = s
        .wait_run("build-1", "True", "TestsPassed", Duration::from_secs(60))
        .await;
    assert_eq!(result(&run, "attempt"), Some("build-1#1"));
    assert_eq!(s.builds_started(), 1, "the build ran once");

    // A rollout: a new replica stands by, the leader gets SIGTERM and hands the Lease over at
    // once (released), not after a lease duration.
    s.start_replica("ctl-c", ControllerOptions::default(), &leader);
    wait_for("ctl-c to stand by", Duration::from_secs(30), || {
        s.replica_log("ctl-c")
            .contains("standing by: ctl-b leads")
            .then_some(())
            .ok_or("not yet".to_string())
    })
    .await;
    let terminated = Instant::now();
    s.terminate_replica("ctl-b");
    s.wait_leader("ctl-c", Duration::from_secs(30)).await;
    let handover = terminated.elapsed();
    eprintln!(
        "[e2e] HANDOVER (SIGTERM of the leader): ctl-c holds the leader Lease {:.2}s after the SIGTERM",
        handover.as_secs_f64()
    );
    assert!(s.replica_log("ctl-b").contains("released the leader Lease"));
    assert!(
        handover < leader.lease,
        "not released: waited out the lease ({handover:?})"
    );
    s.finish().await;
}

// scenario: failover-frozen
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_leader_is_fenced_and_writes_nothing_after_thaw() {
    let mut s = Stack::new("failover-frozen").await;
    let leader = LeaderOptions::default();
    two_replicas_mid_build(&mut s, &leader).await;

    s.freeze_replica("ctl-a");
    let frozen = Instant::now();
    s.wait_leader("ctl-b", Duration::from_secs(30)).await;
    eprintln!(
        "[e2e] FAILOVER (SIGSTOP of the leader): ctl-b holds the leader Lease {:.2}s after the freeze",
        frozen.elapsed().as_secs_f64()
    );
    // Work the frozen replica's watches will deliver when it wakes: a new run to create a
    // MacBuild for, and the running build finishing (a status to write).
    s.create_run("build-2", &s.build_params(false), None).await;
    s.open_gate();
    s.wait_run("build-1", "True", "TestsPassed", Duration::from_secs(60))
        .await;

    let mark = s.api_requests().map(|r| r.len());
    let log_mark = s.replica_log("ctl-a").len();
    let thawed = k8s_openapi::jiff::Timestamp::now();
    s.thaw_replica("ctl-a");
    wait_for("the thawed ctl-a to stand by", Duration::from_secs(30), || {
        let log = s.replica_log("ctl-a");
        (log.contains("lost the leader Lease") && log.contains("standing by"))
            .then_some(())
            .ok_or("not yet".to_string())
    })
    .await;
    // Standing by means working as a standby: its reconcilers stopped, and it reads the Lease
    // again (on the emulator, seen in the request log as a GET by ctl-a), so it could take over
    // if ctl-b died.
    wait_for(
        "the thawed ctl-a to stop its reconcilers and read the Lease again",
        Duration::from_secs(30),
        || {
            let log = s.replica_log("ctl-a");
            if !log[log_mark..].contains("leadership lost: reconcilers stopped") {
                return Err("no \"leadership lost: reconcilers stopped\" in its log yet".to_string());
            }
            match (mark, s.api_requests()) {
                (Some(mark), Some(requests)) => requests[mark.min(requests.len())..]
                    .iter()
                    .any(|r| r.starts_with("GET ") && r.contains("/leases/tartan-controller") && r.ends_with("(ctl-a)"))
                    .then_some(())
                    .ok_or("no Lease read by ctl-a since the thaw yet".to_string()),
                _ => Ok(()),
            }
        },
    )
    .await;
    let run2 = s
        .wait_run("build-2", "True", "TestsPassed", Duration::from_secs(60))
        .await;
    assert_eq!(result(&run2, "attempt"), Some("build-2#1"));
    let lease = s.wait_leader("ctl-b", Duration::from_secs(5)).await;

    let log_a = s.replica_log("ctl-a");
    let since_thaw = &log_a[log_mark..];
    let refused = since_thaw.lines().filter(|l| l.contains("refused write")).count();
    eprintln!("[e2e] thawed ctl-a refused {refused} write(s) at its write gate");
    let after_thaw = since_thaw
        .lines()
        .filter(|l| l.contains("created MacBuild") || l.contains("acquired the leader Lease"))
        .collect::<Vec<_>>();
    assert!(
        after_thaw.is_empty(),
        "ctl-a acted as leader after the thaw: {after_thaw:#?}"
    );
    assert_eq!(
        lease.spec.as_ref().and_then(|s| s.holder_identity.as_deref()),
        Some("ctl-b")
    );

    // From the API: no write by ctl-a since the thaw (its reads were waited for above).
    match (mark, s.api_requests()) {
        (Some(mark), Some(requests)) => {
            let since = &requests[mark.min(requests.len())..];
            let by_a: Vec<&String> = since.iter().filter(|r| r.ends_with("(ctl-a)")).collect();
            let writes_by_a: Vec<&&String> = by_a.iter().filter(|r| !r.starts_with("GET ")).collect();
            eprintln!(
                "[e2e] emulator request log since the thaw: {} request(s), {} by ctl-a, of which {} writes",
                since.len(),
                by_a.len(),
                writes_by_a.len()
            );
            assert!(writes_by_a.is_empty(), "ctl-a wrote after the thaw: {writes_by_a:#?}");
        }
        _ => {
            // A real API server keeps no request log here: Events name the replica that wrote
            // them (reportingInstance); none may come from ctl-a after the thaw.
            let events: kube::Api<k8s_openapi::api::events::v1::Event> = kube::Api::namespaced(s.client.clone(), &s.ns);
            let list = events.list(&Default::default()).await.expect("listing Events");
            let from_a: Vec<_> = list
                .items
                .iter()
                .filter(|e| e.reporting_instance.as_deref() == Some("ctl-a"))
                .filter(|e| e.event_time.as_ref().is_some_and(|t| t.0 > thawed))
                .map(|e| e.note.clone().unwrap_or_default())
                .collect();
            let from_b = list
                .items
                .iter()
                .filter(|e| e.reporting_instance.as_deref() == Some("ctl-b"))
                .count();
            eprintln!(
                "[e2e] Events since the thaw: {} from ctl-a, {from_b} from ctl-b in all",
                from_a.len()
            );
            assert!(from_b > 0, "the new leader's Events are there");
            assert!(from_a.is_empty(), "ctl-a published Events after the thaw: {from_a:#?}");
        }
    }
    s.finish().await;
}

/// A chaos run's failover strike while the API is down (fleet seed 64007 struck one during "API
/// refuses connections", and reading the leader Lease panicked the whole runner): the strike kills
/// nobody and says why; once the API is back, the same strike kills the leader.
// scenario: failover-strike-api-down
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_strike_while_the_api_is_down_kills_nobody() {
    use tartan_e2e::chaos::controllers::Controllers;
    let mut s = Stack::new("failover-strike-api-down").await;
    let mut controllers = Controllers::new(ControllerOptions::default(), 2);
    controllers.start(&mut s);
    let leader = wait_for_async(
        "a replica to hold the leader Lease",
        Duration::from_secs(60),
        || async {
            s.leader_lease()
                .await?
                .and_then(|l| l.spec?.holder_identity)
                .ok_or("no holder yet".to_string())
        },
    )
    .await;

    s.api_down().await;
    let refused = controllers.kill_leader(&mut s).await;
    s.api_up().await;
    let why = refused.expect_err("a strike while the API is down kills nobody");
    assert!(
        why.contains("reading the leader Lease") && why.contains("nobody killed"),
        "{why}"
    );
    assert!(
        s.replica_started(&leader),
        "{leader} was killed although the strike was refused"
    );

    let killed = controllers
        .kill_leader(&mut s)
        .await
        .expect("the strike once the API is back");
    assert_eq!(killed, leader);
    assert!(!s.replica_started(&leader), "{leader} still runs after the strike");
    s.finish().await;
}
