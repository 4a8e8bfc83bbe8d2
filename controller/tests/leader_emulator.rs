//! The leader elector against the testkit's Kubernetes API emulator (real HTTP): what a replica
//! does when the API goes away under it and comes back.

use std::sync::Arc;
use std::time::Duration;
use tartan_api::lease_clock::Stamp;
use tartan_controller::leader::{ElectionConfig, Elector, Gate, Role};
use tartan_controller::metrics::Metrics;
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
    let metrics = Arc::new(Metrics::default());
    let cfg = config("ctl-a");
    let gate = Arc::new(Gate::new(cfg.write_window(), metrics.clone()));
    let elector = Elector::spawn(emu.client(), cfg, gate.clone(), metrics);
    let mut role = elector.role();
    role_becomes(&mut role, true, "taking the free Lease").await;
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
