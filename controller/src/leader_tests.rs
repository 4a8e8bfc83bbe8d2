use super::*;
use k8s_openapi::jiff::SignedDuration;
use proptest::prelude::*;

fn cfg() -> ElectionConfig {
    ElectionConfig {
        namespace: "tartan-system".into(),
        name: "tartan-controller".into(),
        identity: "ctl-a".into(),
        lease: Duration::from_secs(15),
        renew_every: Duration::from_secs(5),
        retry_every: Duration::from_secs(2),
        margin: Duration::from_secs(5),
        api_timeout: Duration::from_secs(4),
    }
}

fn lease(holder: Option<&str>, rv: &str, secs: Option<i32>) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some("tartan-controller".into()),
            resource_version: Some(rv.into()),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: holder.map(str::to_string),
            lease_duration_seconds: secs,
            lease_transitions: Some(2),
            ..Default::default()
        }),
    }
}

fn at(t0: Stamp, mono_ms: u64, wall_ms: i64) -> Stamp {
    Stamp {
        mono: t0.mono + Duration::from_millis(mono_ms),
        wall: t0.wall + SignedDuration::from_millis(wall_ms),
    }
}

#[test]
fn defaults_validate_and_bad_settings_are_named() {
    assert_eq!(cfg().validate(), Ok(()));
    assert_eq!(cfg().write_window(), Duration::from_secs(10));
    let mut c = cfg();
    c.margin = Duration::from_secs(15);
    assert!(c.validate().unwrap_err().to_string().contains("--leader-margin"));
    c.margin = Duration::ZERO;
    assert!(c.validate().unwrap_err().to_string().contains("--leader-margin"));
    let mut c = cfg();
    c.renew_every = Duration::from_secs(10);
    assert!(c.validate().unwrap_err().to_string().contains("--leader-renew-every"));
    let mut c = cfg();
    c.retry_every = Duration::from_secs(6);
    assert!(c.validate().unwrap_err().to_string().contains("--leader-retry-every"));
    let mut c = cfg();
    c.identity.clear();
    assert!(c.validate().unwrap_err().to_string().contains("identity"));
}

#[test]
fn lease_seconds_round_up() {
    let mut c = cfg();
    c.lease = Duration::from_millis(3500);
    assert_eq!(c.lease_seconds(), 4);
    c.lease = Duration::from_millis(300);
    assert_eq!(c.lease_seconds(), 1);
    c.lease = Duration::MAX;
    assert_eq!(c.lease_seconds(), i32::MAX);
}

#[test]
fn identity_is_the_pod_name_else_host_and_pid() {
    assert_eq!(
        identity(Some("tartan-controller-7d9-x2"), "node1", 7),
        "tartan-controller-7d9-x2"
    );
    assert_eq!(identity(None, "node1", 7), "node1-7");
    assert_eq!(identity(Some(""), "node1", 7), "node1-7");
}

#[test]
fn may_write_until_the_window_on_both_clocks() {
    let t0 = Stamp::now();
    let w = cfg().write_window();
    assert!(may_write(t0, w, t0));
    assert!(may_write(t0, w, at(t0, 9_999, 9_999)));
    assert!(!may_write(t0, w, at(t0, 10_000, 10_000)));
    // SIGSTOP or a paused VM for a minute: both clocks ran (or only the wall one): stop.
    assert!(!may_write(t0, w, at(t0, 60_000, 60_000)));
    assert!(!may_write(t0, w, at(t0, 100, 60_000)));
    // The wall clock stepped back: the monotonic end holds.
    assert!(may_write(t0, w, at(t0, 9_000, -3_600_000)));
    assert!(!may_write(t0, w, at(t0, 10_000, -3_600_000)));
}

#[test]
fn observation_restarts_on_any_change_of_the_record() {
    let t0 = Instant::now();
    let later = t0 + Duration::from_secs(3);
    let o1 = observe(None, &lease(Some("ctl-b"), "10", Some(15)), Duration::from_secs(7), t0);
    assert_eq!(o1.since, t0);
    assert_eq!(o1.lease, Duration::from_secs(15));
    assert_eq!(o1.holder.as_deref(), Some("ctl-b"));
    // Same record: the count goes on.
    let o2 = observe(
        Some(&o1),
        &lease(Some("ctl-b"), "10", Some(15)),
        Duration::from_secs(7),
        later,
    );
    assert_eq!(o2.since, t0);
    // Renewed (new resourceVersion): the count restarts.
    let o3 = observe(
        Some(&o2),
        &lease(Some("ctl-b"), "11", Some(15)),
        Duration::from_secs(7),
        later,
    );
    assert_eq!(o3.since, later);
    // A stated duration shorter than ours (edited by hand): ours.
    let short = observe(None, &lease(Some("ctl-b"), "12", Some(1)), Duration::from_secs(7), t0);
    assert_eq!(short.lease, Duration::from_secs(7));
    // No stated duration (or nonsense): ours.
    let o4 = observe(None, &lease(Some("ctl-b"), "12", None), Duration::from_secs(7), t0);
    assert_eq!(o4.lease, Duration::from_secs(7));
    let o5 = observe(None, &lease(Some("ctl-b"), "12", Some(-3)), Duration::from_secs(7), t0);
    assert_eq!(o5.lease, Duration::from_secs(7));
    // An empty holder is nobody; a missing resourceVersion never counts as "unchanged".
    let free = observe(None, &lease(Some(""), "", Some(15)), Duration::from_secs(7), t0);
    assert_eq!(free.holder, None);
    assert!(free.released, "no holder and no renewTime: released");
    let mut cleared = lease(None, "13", Some(15));
    cleared.spec.as_mut().unwrap().renew_time = Some(MicroTime("2026-12-01T22:00:00Z".parse().unwrap()));
    assert!(!observe(None, &cleared, Duration::from_secs(7), t0).released);
    let again = observe(
        Some(&free),
        &lease(Some(""), "", Some(15)),
        Duration::from_secs(7),
        later,
    );
    assert_eq!(again.since, later);
}

#[test]
fn takeover_only_when_free_ours_or_unrenewed_for_its_duration() {
    let t0 = Instant::now();
    let obs = |holder: Option<&str>| Observation {
        resource_version: "10".into(),
        holder: holder.map(str::to_string),
        released: holder.is_none(),
        lease: Duration::from_secs(15),
        since: t0,
    };
    assert_eq!(
        takeover(&obs(None), "ctl-a", false, t0),
        Takeover::Now(TakeoverReason::Free)
    );
    assert_eq!(
        takeover(&obs(Some("ctl-a")), "ctl-a", true, t0),
        Takeover::Now(TakeoverReason::Ours)
    );
    assert_eq!(
        takeover(&obs(Some("ctl-b")), "ctl-a", false, t0 + Duration::from_millis(14_999)),
        Takeover::Wait {
            holder: Some("ctl-b".into()),
            not_before: t0 + Duration::from_secs(15)
        }
    );
    assert_eq!(
        takeover(&obs(Some("ctl-b")), "ctl-a", false, t0 + Duration::from_secs(15)),
        Takeover::Now(TakeoverReason::Expired)
    );
    // A record naming us that this process did not write (a hand edit, a previous container's)
    // is waited out like anyone else's.
    assert_eq!(
        takeover(&obs(Some("ctl-a")), "ctl-a", false, t0 + Duration::from_millis(14_999)),
        Takeover::Wait {
            holder: Some("ctl-a".into()),
            not_before: t0 + Duration::from_secs(15)
        }
    );
    assert_eq!(
        takeover(&obs(Some("ctl-a")), "ctl-a", false, t0 + Duration::from_secs(15)),
        Takeover::Now(TakeoverReason::Expired)
    );
    // A holder cleared by hand (its renewTime kept) is not a release: waited out, unless we lead.
    let cleared = Observation {
        released: false,
        ..obs(None)
    };
    assert_eq!(
        takeover(&cleared, "ctl-a", false, t0 + Duration::from_millis(14_999)),
        Takeover::Wait {
            holder: None,
            not_before: t0 + Duration::from_secs(15)
        }
    );
    assert_eq!(
        takeover(&cleared, "ctl-a", true, t0),
        Takeover::Now(TakeoverReason::Free)
    );
    let mut forever = obs(Some("ctl-b"));
    forever.lease = Duration::MAX;
    assert!(matches!(
        takeover(&forever, "ctl-a", false, t0 + Duration::from_secs(86_400)),
        Takeover::Wait { .. }
    ));
}

#[test]
fn claimed_counts_a_transition_only_when_taking_it_from_someone() {
    let now: Timestamp = "2026-12-01T22:00:00.123456Z".parse().unwrap();
    let mine = claimed(&lease(Some("ctl-a"), "10", Some(15)), &cfg(), now);
    let spec = mine.spec.as_ref().unwrap();
    assert_eq!(
        mine.metadata.resource_version.as_deref(),
        Some("10"),
        "the replace is fenced"
    );
    assert_eq!(spec.lease_transitions, Some(2));
    assert_eq!(spec.acquire_time, None);
    assert_eq!(spec.renew_time, Some(MicroTime(now)));
    let taken = claimed(&lease(Some("ctl-b"), "11", Some(15)), &cfg(), now);
    let spec = taken.spec.as_ref().unwrap();
    assert_eq!(spec.holder_identity.as_deref(), Some("ctl-a"));
    assert_eq!(spec.lease_transitions, Some(3));
    assert_eq!(spec.acquire_time, Some(MicroTime(now)));
    assert_eq!(spec.lease_duration_seconds, Some(15));
    let fresh = new_lease(&cfg(), now);
    assert_eq!(fresh.metadata.namespace.as_deref(), Some("tartan-system"));
    assert_eq!(fresh.spec.as_ref().unwrap().holder_identity.as_deref(), Some("ctl-a"));
    let gone = released(&taken);
    assert_eq!(gone.spec.as_ref().unwrap().holder_identity, None);
    assert_eq!(gone.metadata.resource_version.as_deref(), Some("11"));
}

#[test]
fn the_gate_opens_on_renewal_closes_at_the_window_and_never_moves_back() {
    let m = Arc::new(Metrics::default());
    let gate = Gate::new(Duration::from_secs(10), m.clone());
    let t0 = Stamp::now();
    assert!(!gate.may_write_at(t0), "closed until the first renewal");
    gate.renewed(t0);
    assert!(gate.may_write_at(at(t0, 9_999, 9_999)));
    assert_eq!(gate.deadline(), Some(t0.mono + Duration::from_secs(10)));
    gate.renewed(at(t0, 5_000, 5_000));
    // A slower, older request succeeding afterwards does not shorten the window.
    gate.renewed(t0);
    assert!(gate.may_write_at(at(t0, 14_999, 14_999)));
    gate.close();
    assert!(!gate.may_write_at(at(t0, 5_001, 5_001)));
    assert!(gate.check(&http::Method::PATCH, "/apis/x").is_err());
    assert_eq!(m.refused_writes.get(), 1);
    assert!(Gate::always_open(m.clone()).may_write_at(at(Stamp::now(), 10u64.pow(12), 10i64.pow(12))));
}

proptest! {
    /// The safety property: for any timing settings, any moment the old leader's last renewal was
    /// sent, any delay until the standby first saw that record, and any wall-clock steps of either
    /// side, the standby's takeover comes after the old leader's gate closed, with `margin` to spare.
    #[test]
    fn the_old_leader_stops_writing_margin_before_the_standby_may_take_over(
        lease_ms in 2_000u64..60_000,
        margin_pct in 1u64..90,
        observe_delay_ms in 0u64..30_000,
        probe_ms in 0u64..200_000,
        old_wall_step_ms in -3_600_000i64..3_600_000,
    ) {
        let margin = Duration::from_millis(lease_ms * margin_pct / 100).max(Duration::from_millis(1));
        let lease_d = Duration::from_millis(lease_ms);
        let window = lease_d - margin;
        let t0 = Stamp::now(); // the old leader sent its last successful renewal
        let observed = t0.mono + Duration::from_millis(observe_delay_ms); // the standby saw that record
        let obs = Observation {
            resource_version: "7".into(),
            holder: Some("old".into()),
            released: false,
            lease: lease_d,
            since: observed,
        };
        let probe = t0.mono + Duration::from_millis(probe_ms);
        let standby_may_take = matches!(takeover(&obs, "new", false, probe), Takeover::Now(_));
        // The old leader's clocks at the same instant, with its wall clock stepped arbitrarily.
        let old_now = Stamp { mono: probe, wall: t0.wall + SignedDuration::from_millis(probe_ms as i64 + old_wall_step_ms) };
        if standby_may_take {
            prop_assert!(!may_write(t0, window, old_now));
            // And already `margin` earlier (takeover implies probe >= t0 + lease > t0 + margin).
            let earlier = Stamp { mono: probe - margin, wall: old_now.wall };
            prop_assert!(!may_write(t0, window, earlier));
        }
    }

    /// Exhaustive over rounds: a leader whose renewals fail from some round on has its gate
    /// closed from exactly `window` after its last success, whatever the round pattern.
    #[test]
    fn failing_renewals_close_the_gate_window_after_the_last_success(
        successes in proptest::collection::vec(any::<bool>(), 1..40),
        renew_ms in 500u64..5_000,
    ) {
        let m = Arc::new(Metrics::default());
        let window = Duration::from_millis(renew_ms * 2);
        let gate = Gate::new(window, m);
        let t0 = Stamp::now();
        let mut last: Option<u64> = None;
        for (i, ok) in successes.iter().enumerate() {
            let t = i as u64 * renew_ms;
            if *ok {
                gate.renewed(at(t0, t, t as i64));
                last = Some(t);
            }
            let now = at(t0, t + renew_ms / 2, (t + renew_ms / 2) as i64);
            let expected = last.is_some_and(|l| t + renew_ms / 2 < l + renew_ms * 2);
            prop_assert_eq!(gate.may_write_at(now), expected);
        }
    }
}

/// The layer refuses a write when the gate is closed without calling the inner service, and lets
/// reads through.
#[tokio::test]
async fn the_layer_refuses_writes_but_not_reads_while_closed() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tower_layer::Layer as _;
    use tower_service::Service as _;

    #[derive(Clone)]
    struct Count(Arc<AtomicUsize>);
    impl tower_service::Service<http::Request<()>> for Count {
        type Response = &'static str;
        type Error = BoxError;
        type Future = BoxFuture<'static, Result<&'static str, BoxError>>;
        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
            Poll::Ready(Ok(()))
        }
        fn call(&mut self, _: http::Request<()>) -> Self::Future {
            self.0.fetch_add(1, Ordering::SeqCst);
            Box::pin(async { Ok("sent") })
        }
    }
    let sent = Arc::new(AtomicUsize::new(0));
    let m = Arc::new(Metrics::default());
    let gate = Arc::new(Gate::new(Duration::from_secs(10), m.clone()));
    let mut svc = GateLayer(gate.clone()).layer(Count(sent.clone()));
    let req = |method: http::Method| {
        http::Request::builder()
            .method(method)
            .uri("/apis/tekton.dev/v1beta1/namespaces/ci/customruns/build-1/status")
            .body(())
            .unwrap()
    };
    for method in [
        http::Method::PATCH,
        http::Method::PUT,
        http::Method::POST,
        http::Method::DELETE,
    ] {
        let err = svc.call(req(method.clone())).await.unwrap_err().to_string();
        assert!(
            err.contains(&format!("refused write {method} /apis/tekton.dev")),
            "{err}"
        );
    }
    assert_eq!(sent.load(Ordering::SeqCst), 0);
    assert_eq!(m.refused_writes.get(), 4);
    assert_eq!(svc.call(req(http::Method::GET)).await.unwrap(), "sent");
    gate.renewed(Stamp::now());
    assert_eq!(svc.call(req(http::Method::PATCH)).await.unwrap(), "sent");
    assert_eq!(sent.load(Ordering::SeqCst), 2);
}
