//! The leader elector against the testkit's Kubernetes API emulator (real HTTP): what a replica
//! does when the API goes away under it and comes back.

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use std::time::Instant;
use tartan_api::lease_clock::Stamp;
use tartan_controller::leader::{ElectionConfig, Elector, Gate, Role};
use tartan_controller::metrics::Metrics;
use tartan_controller::run::RunArgs;
use tartan_testkit::{DenyRule, Options};

fn config(identity: &str) -> ElectionConfig {
    ElectionConfig {
        namespace: "default".into(),
        name: "tartan-controller".into(),
        identity: identity.into(),
        lease: Duration::from_secs(2),
        // Failed rounds at 0.4, 0.65 and 0.9 s after the last renewal, then a wake-up at the
        // window's end (1 s): the step down happens on that wake-up, not in a round.
        renew_every: Duration::from_millis(400),
        retry_every: Duration::from_millis(250),
        margin: Duration::from_secs(1),
        api_timeout: Duration::from_millis(200),
    }
}

/// The flags of `tartan-controller run` for one replica electing with `cfg`'s timings.
fn run_args(cfg: &ElectionConfig, api_timeout: Duration, kubeconfig: Option<std::path::PathBuf>) -> RunArgs {
    RunArgs {
        kubeconfig,
        namespaces: vec!["default".into()],
        default_timeout: Duration::from_secs(3600),
        grace: Duration::from_secs(2),
        lease_duration: Duration::from_secs(20),
        finished_label_after: Duration::from_secs(30),
        agent_lease_namespace: None,
        api_timeout,
        metrics_address: "127.0.0.1:0".parse().expect("an address"),
        http_max_connections: tartan_serve::DEFAULT_MAX_CONNECTIONS,
        http_idle_timeout: tartan_serve::DEFAULT_IDLE_TIMEOUT,
        instance: cfg.identity.clone(),
        leader_elect: true,
        leader_lease_namespace: Some(cfg.namespace.clone()),
        leader_lease_name: cfg.name.clone(),
        leader_identity: Some(cfg.identity.clone()),
        leader_lease: cfg.lease,
        leader_renew_every: cfg.renew_every,
        leader_retry_every: cfg.retry_every,
        leader_margin: cfg.margin,
        concurrency: 16,
    }
}

/// An elector for `cfg` on `emu`, once it leads the free Lease: the elector, its gate and its
/// role channel.
async fn leading(
    emu: &tartan_testkit::EmulatorHandle,
    cfg: &ElectionConfig,
) -> (Elector, Arc<Gate>, tokio::sync::watch::Receiver<Role>) {
    let metrics = Arc::new(Metrics::default());
    let gate = Arc::new(Gate::new(cfg.write_window(), metrics.clone()));
    let elector = Elector::spawn(emu.client(), cfg.clone(), gate.clone(), metrics);
    let mut role = elector.role();
    role_becomes(&mut role, true, "taking the free Lease").await;
    (elector, gate, role)
}

async fn role_becomes(role: &mut tokio::sync::watch::Receiver<Role>, leader: bool, what: &str) {
    let reached = tokio::time::timeout(
        Duration::from_secs(10),
        role.wait_for(|r| matches!(r, Role::Leader { .. }) == leader),
    )
    .await;
    assert!(reached.is_ok(), "{what}: not within 10 s");
}

/// Runs `scenario` on a runtime of its own and fails if it has not ended within `limit`: a
/// deadlocked role channel blocks every reader's thread, so an in-runtime timeout would never fire.
fn bounded(limit: Duration, scenario: impl Future<Output = ()> + Send + 'static) {
    let (done, ended) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a tokio runtime");
        runtime.block_on(scenario);
        let _ = done.send(());
    });
    match ended.recv_timeout(limit) {
        Ok(()) => {}
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => panic!("the scenario failed (see its panic above)"),
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("the scenario did not end within {limit:?}: the elector is stuck")
        }
    }
}

/// A leader whose renewals fail until its write window has passed (refused, like an API outage or a
/// frozen process that wakes past its window) steps down, closes its gate, and leads again once the API answers. The step
/// down happens on the elector's wake-up at the window's end; it used to deadlock there on the
/// role channel's own read lock, leaving the replica unable to ever lead again.
#[test]
fn a_leader_cut_off_past_its_window_steps_down_and_leads_again_when_the_api_returns() {
    bounded(Duration::from_secs(30), cut_off_past_the_window());
}

async fn cut_off_past_the_window() {
    let emu = tartan_testkit::start(Options::default())
        .await
        .expect("emulator starts");
    let (elector, gate, mut role) = leading(&emu, &config("ctl-a")).await;
    assert!(gate.may_write_at(Stamp::now()));

    // Renewals refused at once (an admission policy; a 503 would be retried by kube's client until
    // the round's timeout): the elector sleeps to its window's end between failed rounds, and
    // steps down when it wakes there.
    emu.add_deny_rule(
        DenyRule::new("freeze-the-leader-lease")
            .operations(&["UPDATE"])
            .resource("coordination.k8s.io", "leases"),
    );
    role_becomes(&mut role, false, "stepping down once its renewals fail past the window").await;
    assert!(!gate.may_write_at(Stamp::now()), "the gate closed with the step down");

    emu.clear_deny_rules();
    // Still the holder on record: it takes its own Lease back at the next round.
    role_becomes(&mut role, true, "leading again once the API answers").await;
    assert!(gate.may_write_at(Stamp::now()));
    tokio::time::timeout(Duration::from_secs(5), elector.shutdown())
        .await
        .expect("the elector shuts down (releasing the Lease) within 5 s");
}

/// Two electors on one emulator, and a sampler that records whether both gates were ever open at
/// the same instant (the one thing leader election must never allow).
struct Pair {
    a: Elector,
    a_gate: Arc<Gate>,
    b: Elector,
    b_gate: Arc<Gate>,
    both_open: Arc<std::sync::atomic::AtomicBool>,
    sampler: tokio::task::JoinHandle<()>,
}

/// `ctl-a` renews slowly (every 2 s of a 3 s window), `ctl-b` polls every 100 ms: whatever lets the
/// standby in early does so long before the leader's next round would notice.
fn slow_leader_fast_standby(identity: &str) -> ElectionConfig {
    ElectionConfig {
        lease: Duration::from_secs(4),
        margin: Duration::from_secs(1),
        renew_every: Duration::from_secs(2),
        retry_every: Duration::from_millis(100),
        api_timeout: Duration::from_millis(500),
        ..config(identity)
    }
}

/// Starts `ctl-a`, waits until it leads, then starts `ctl-b` and waits until it stands by.
async fn a_leads_b_stands_by(emu: &tartan_testkit::EmulatorHandle) -> Pair {
    let metrics = Arc::new(Metrics::default());
    let (ca, cb) = (slow_leader_fast_standby("ctl-a"), slow_leader_fast_standby("ctl-b"));
    let a_gate = Arc::new(Gate::new(ca.write_window(), metrics.clone()));
    let b_gate = Arc::new(Gate::new(cb.write_window(), metrics.clone()));
    let a = Elector::spawn(emu.client(), ca, a_gate.clone(), metrics.clone());
    role_becomes(&mut a.role(), true, "ctl-a taking the free Lease").await;
    let b = Elector::spawn(emu.client(), cb, b_gate.clone(), metrics);
    let mut b_role = b.role();
    let standing_by = tokio::time::timeout(
        Duration::from_secs(10),
        b_role.wait_for(|r| {
            *r == Role::Standby {
                holder: Some("ctl-a".into()),
            }
        }),
    )
    .await;
    assert!(standing_by.is_ok(), "ctl-b did not see ctl-a lead within 10 s");
    let both_open = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = tokio::spawn({
        let (a_gate, b_gate, both_open) = (a_gate.clone(), b_gate.clone(), both_open.clone());
        async move {
            loop {
                let now = Stamp::now();
                if a_gate.may_write_at(now) && b_gate.may_write_at(now) {
                    both_open.store(true, std::sync::atomic::Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    });
    Pair {
        a,
        a_gate,
        b,
        b_gate,
        both_open,
        sampler,
    }
}

/// Waits until `ctl-a` has just renewed (its gate's renewal stamp moved), so that its next round
/// is a whole renewal period away.
async fn just_renewed(gate: &Gate) {
    let before = gate.renewed_at();
    tartan_testkit::wait_for("ctl-a renewing its Lease", Duration::from_secs(5), || {
        (gate.renewed_at() != before).then_some(())
    })
    .await;
}

impl Pair {
    /// `ctl-a` still leads, `ctl-b` stands by, and the two gates were never open together.
    async fn no_overlap_and_a_leads(self, what: &str) {
        self.sampler.abort();
        assert!(
            !self.both_open.load(std::sync::atomic::Ordering::SeqCst),
            "{what}: both replicas' write gates were open at the same time"
        );
        assert!(
            matches!(*self.a.role().borrow(), Role::Leader { .. }),
            "{what}: ctl-a leads"
        );
        assert!(!self.b_gate.may_write_at(Stamp::now()), "{what}: ctl-b does not write");
        let _ = tokio::time::timeout(Duration::from_secs(5), self.a.shutdown()).await;
        let _ = tokio::time::timeout(Duration::from_secs(5), self.b.shutdown()).await;
    }

    /// `ctl-b` leads within 10 s, and the two gates were never open together.
    async fn b_took_over_alone(self, what: &str) {
        role_becomes(&mut self.b.role(), true, what).await;
        assert!(!self.a_gate.may_write_at(Stamp::now()), "{what}: ctl-a still writes");
        self.sampler.abort();
        assert!(
            !self.both_open.load(std::sync::atomic::Ordering::SeqCst),
            "{what}: both replicas' write gates were open at the same time"
        );
        assert!(self.b_gate.may_write_at(Stamp::now()));
        let _ = tokio::time::timeout(Duration::from_secs(5), self.a.shutdown()).await;
        let _ = tokio::time::timeout(Duration::from_secs(5), self.b.shutdown()).await;
    }
}

/// Edits the leader Lease by hand (`kubectl edit`): `edit` changes its spec, written with the
/// resourceVersion just read.
async fn hand_edit(emu: &tartan_testkit::EmulatorHandle, edit: impl FnOnce(&mut LeaseSpec)) {
    let leases: kube::Api<Lease> = kube::Api::namespaced(emu.client(), "default");
    let mut lease = leases.get("tartan-controller").await.expect("the Lease reads");
    edit(lease.spec.as_mut().expect("a spec"));
    leases
        .replace("tartan-controller", &Default::default(), &lease)
        .await
        .expect("the hand edit is written");
}

/// Waits for ctl-a's next renewal after `renewed` (which rewrites the edited record), or for ctl-b
/// leading (which the test then refuses).
async fn a_renews_or_b_leads(pair: &Pair, renewed: Option<Stamp>) {
    let b_role = pair.b.role();
    tartan_testkit::wait_for("ctl-a renewing, or ctl-b leading", Duration::from_secs(5), || {
        (pair.a_gate.renewed_at() != renewed || matches!(*b_role.borrow(), Role::Leader { .. })).then_some(())
    })
    .await;
}

/// Someone edits the Lease to name the standby (`kubectl edit`, to force a failover): the standby
/// must not take that as its own record and lead at once, while the leader's gate is still open
/// until its next round reads the change.
#[test]
fn a_lease_edited_to_name_the_standby_does_not_open_both_gates() {
    bounded(Duration::from_secs(40), async {
        let emu = tartan_testkit::start(Options::default())
            .await
            .expect("emulator starts");
        let pair = a_leads_b_stands_by(&emu).await;
        just_renewed(&pair.a_gate).await;
        hand_edit(&emu, |spec| spec.holder_identity = Some("ctl-b".into())).await;
        pair.b_took_over_alone("ctl-b leading after the edit").await;
    });
}

/// Someone deletes the Lease (`kubectl delete lease`, to reset the election) right after the
/// leader renewed: the standby, finding none, must not create it and lead at once while the
/// leader's gate stays open until its next round.
#[test]
fn a_lease_deleted_under_the_leader_does_not_open_both_gates() {
    bounded(Duration::from_secs(40), async {
        let emu = tartan_testkit::start(Options::default())
            .await
            .expect("emulator starts");
        let pair = a_leads_b_stands_by(&emu).await;
        just_renewed(&pair.a_gate).await;
        let leases: kube::Api<Lease> = kube::Api::namespaced(emu.client(), "default");
        leases
            .delete("tartan-controller", &Default::default())
            .await
            .expect("the Lease is deleted");
        pair.b_took_over_alone("ctl-b leading after the deletion").await;
    });
}

/// Someone edits the Lease's `leaseDurationSeconds` down (to 1 s) right after the leader renewed:
/// the standby must not count that record as expired after 1 s, while the leader may write for its
/// own whole window.
#[test]
fn a_lease_edited_to_a_short_duration_does_not_open_both_gates() {
    bounded(Duration::from_secs(40), async {
        let emu = tartan_testkit::start(Options::default())
            .await
            .expect("emulator starts");
        let pair = a_leads_b_stands_by(&emu).await;
        just_renewed(&pair.a_gate).await;
        let renewed = pair.a_gate.renewed_at();
        hand_edit(&emu, |spec| spec.lease_duration_seconds = Some(1)).await;
        // ctl-a's next renewal (2 s after its last) rewrites its own duration; ctl-b, polling every
        // 100 ms, has long seen the edited record by then, and took it if it counted 1 s.
        a_renews_or_b_leads(&pair, renewed).await;
        pair.no_overlap_and_a_leads("ctl-a renewing after the edit").await;
    });
}

/// Someone clears the Lease's holder by hand (not a release: its `renewTime` stays) right after the
/// leader renewed: the standby must not take that as released and lead at once, while the leader
/// may write until its next round.
#[test]
fn a_lease_edited_to_name_nobody_does_not_open_both_gates() {
    bounded(Duration::from_secs(40), async {
        let emu = tartan_testkit::start(Options::default())
            .await
            .expect("emulator starts");
        let pair = a_leads_b_stands_by(&emu).await;
        just_renewed(&pair.a_gate).await;
        let renewed = pair.a_gate.renewed_at();
        hand_edit(&emu, |spec| spec.holder_identity = None).await;
        a_renews_or_b_leads(&pair, renewed).await;
        pair.no_overlap_and_a_leads("ctl-a renewing after the edit").await;
    });
}

/// A replica that creates the missing Lease waits a lease duration before it leads; meanwhile its
/// role (what `/readyz` says) must not name itself as the leader it is not yet.
#[test]
fn a_replica_waiting_out_its_own_record_does_not_say_it_leads() {
    bounded(Duration::from_secs(30), async {
        let emu = tartan_testkit::start(Options::default())
            .await
            .expect("emulator starts");
        let metrics = Arc::new(Metrics::default());
        let cfg = config("ctl-a");
        let gate = Arc::new(Gate::new(cfg.write_window(), metrics.clone()));
        let elector = Elector::spawn(emu.client(), cfg, gate, metrics);
        let mut role = elector.role();
        let changed = tokio::time::timeout(
            Duration::from_secs(10),
            role.wait_for(|r| *r != Role::Standby { holder: None }),
        )
        .await
        .expect("a role other than the initial one within 10 s")
        .expect("the elector runs")
        .clone();
        assert!(
            matches!(changed, Role::Leader { .. }),
            "announced {changed:?} before leading"
        );
        tokio::time::timeout(Duration::from_secs(5), elector.shutdown())
            .await
            .expect("the elector shuts down within 5 s");
    });
}

/// A replica whose start-up checks fail (here: the MacBuild CRD is not served) exits without having
/// taken part in the election: had it taken the Lease first, it would hold it (and say it leads)
/// while it reconciles nothing, and leave it held when it exits, so that a healthy standby waits a
/// whole lease duration more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_failing_its_start_up_checks_never_takes_the_lease() {
    let emu = tartan_testkit::start(Options::default())
        .await
        .expect("emulator starts");
    let dir = tempfile::tempdir().expect("a temporary directory");
    let kubeconfig = dir.path().join("kubeconfig");
    emu.write_kubeconfig(&kubeconfig).expect("kubeconfig written");
    let cfg = config("ctl-a");
    let args = run_args(&cfg, Duration::from_secs(5), Some(kubeconfig));
    let failed = tokio::time::timeout(Duration::from_secs(20), tartan_controller::run::run(args))
        .await
        .expect("run ends within 20 s")
        .expect_err("the start-up checks fail without the MacBuild CRD");
    assert!(format!("{failed:#}").contains("MacBuild CRD"), "{failed:#}");
    let lease_requests: Vec<String> = emu
        .requests()
        .into_iter()
        .filter(|r| r.contains("/leases/") || r.contains("/leases?") || r.ends_with("/leases"))
        .collect();
    assert!(
        lease_requests.is_empty(),
        "the replica took part in the election before its checks passed: {lease_requests:?}"
    );
}

/// A leader whose renewals hang (an API server that stopped answering) steps down the moment its
/// write window ends, not when a hanging round gives up: until then `/readyz` and `/metrics` say
/// it leads and its reconcilers run, every write refused.
#[test]
fn a_leader_whose_renewals_hang_steps_down_when_its_window_ends() {
    bounded(Duration::from_secs(30), async {
        let emu = tartan_testkit::start(Options::default())
            .await
            .expect("emulator starts");
        // A round that hangs from 0.4 s gives up only at 1.2 s, 200 ms past the window's end at
        // 1 s: a step down left to the round would be that late, far beyond scheduling noise.
        let cfg = ElectionConfig {
            api_timeout: Duration::from_millis(800),
            ..config("ctl-a")
        };
        let (elector, gate, mut role) = leading(&emu, &cfg).await;
        // Every request hangs past the elector's timeout from now on.
        emu.set_latency(Duration::from_secs(5));
        let last_deadline = Arc::new(Mutex::new(None));
        let sampler = tokio::spawn({
            let (gate, last_deadline) = (gate.clone(), last_deadline.clone());
            async move {
                loop {
                    if let Some(d) = gate.deadline() {
                        *last_deadline.lock().expect("lock") = Some(d);
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        });
        role_becomes(&mut role, false, "stepping down once its renewals hang past the window").await;
        let stepped_down = Instant::now();
        sampler.abort();
        let deadline = last_deadline.lock().expect("lock").expect("a deadline while leading");
        let late = stepped_down.saturating_duration_since(deadline);
        assert!(
            late < Duration::from_millis(150),
            "stepped down {late:?} after the write window ended (renewal timeout {:?})",
            cfg.api_timeout
        );
        emu.set_latency(Duration::ZERO);
        tokio::time::timeout(Duration::from_secs(5), elector.shutdown())
            .await
            .expect("the elector shuts down within 5 s");
    });
}

/// An API server slower than `--leader-retry-every` but within `--api-timeout` (every request
/// answered after 600 ms; the retry period is 400 ms) does not unseat a leader whose renewals still
/// land inside its window: a Lease request may take the controller's `--api-timeout`. Cut at the
/// retry period instead, every renewal failed and the leader stepped down; a 100-host chaos run
/// (seed 70019) saw its leader lose the Lease 103 times in an hour that way, each time a new
/// catch-up of every CustomRun.
#[test]
fn a_leader_on_an_api_server_slower_than_its_retry_period_keeps_leading() {
    bounded(Duration::from_secs(40), async {
        let emu = tartan_testkit::start(Options::default())
            .await
            .expect("emulator starts");
        // A renewal round (read, then write) takes 1.2 s: begun 1 s after the last one was sent,
        // it lands 2.2 s after, well inside the 5 s window (slack for a loaded machine).
        let timings = ElectionConfig {
            lease: Duration::from_secs(6),
            renew_every: Duration::from_secs(1),
            retry_every: Duration::from_millis(400),
            margin: Duration::from_secs(1),
            ..config("ctl-a")
        };
        let cfg = run_args(&timings, Duration::from_secs(2), None)
            .election()
            .expect("valid flags")
            .expect("--leader-elect is on");
        let (elector, gate, mut role) = leading(&emu, &cfg).await;
        let first_deadline = gate.deadline().expect("a deadline while leading");
        emu.set_latency(Duration::from_millis(600));
        // Two write windows.
        let stepped_down = tokio::time::timeout(
            Duration::from_secs(10),
            role.wait_for(|r| !matches!(r, Role::Leader { .. })),
        )
        .await
        .is_ok();
        let last_deadline = gate.deadline();
        emu.set_latency(Duration::ZERO);
        assert!(
            !stepped_down,
            "the leader stepped down on an API server answering in 600 ms (Lease request limit {:?})",
            cfg.api_timeout
        );
        assert!(
            last_deadline.is_some_and(|d| d > first_deadline + Duration::from_secs(5)),
            "the renewals did not go on: first deadline {first_deadline:?}, last {last_deadline:?}"
        );
        tokio::time::timeout(Duration::from_secs(5), elector.shutdown())
            .await
            .expect("the elector shuts down within 5 s");
    });
}

/// Adversary round 18: on an API server answering just inside `--api-timeout`, a stop used to
/// wait for the renewal round under way (a read and a write of up to `--api-timeout` each) and
/// then release with two more: 7.5 s here, about 4 × `--api-timeout`, which on the default flags
/// (10 s) is past a pod's 30 s termination grace. A stop now ends the round under way, and the
/// release's requests get one retry period each.
#[test]
fn a_stop_on_a_slow_api_server_does_not_wait_for_the_round_under_way() {
    bounded(Duration::from_secs(40), async {
        let emu = tartan_testkit::start(Options::default())
            .await
            .expect("emulator starts");
        let cfg = ElectionConfig {
            lease: Duration::from_secs(3),
            renew_every: Duration::from_secs(1),
            retry_every: Duration::from_millis(400),
            margin: Duration::from_secs(1),
            api_timeout: Duration::from_secs(2),
            ..config("ctl-a")
        };
        let (elector, _gate, _role) = leading(&emu, &cfg).await;
        emu.set_latency(Duration::from_millis(1900));
        // A renewal round begins within the next renewal period.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let stopping = Instant::now();
        elector.shutdown().await;
        let took = stopping.elapsed();
        emu.set_latency(Duration::ZERO);
        assert!(
            took < Duration::from_secs(2),
            "the stop took {took:?} (Lease request limit {:?}, retry period {:?})",
            cfg.api_timeout,
            cfg.retry_every
        );
    });
}
