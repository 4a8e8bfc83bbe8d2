//! A build's task in the runtime (its slot, its recovery after a fault), on the API emulator
//! with a real journal.

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::CustomResourceExt;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tartan_agent::cluster::delivery::{Delivery, DeliveryConfig};
use tartan_agent::cluster::events::Events;
use tartan_agent::cluster::lease::LeaseState;
use tartan_agent::config::Config;
use tartan_agent::journal::{Journal, JournalOptions};
use tartan_agent::lock::StateLock;
use tartan_agent::machine::{Attempt, NextAttempt, request};
use tartan_agent::record::BuildRef;
use tartan_agent::runtime::build::{Rest, follow_retries, register};
use tartan_agent::runtime::core::{Core, Shared};
use tartan_agent::runtime::machine_config;
use tartan_api::{MacBuild, MacBuildSpec, Step};
use tartan_tart::Tart;
use tartan_testkit::{Availability, EmulatorHandle};
use tokio::sync::{Mutex, Notify};

async fn emulator() -> EmulatorHandle {
    let emu = tartan_testkit::start(tartan_testkit::Options::default())
        .await
        .expect("emulator starts");
    emu.install_crd(serde_json::to_value(MacBuild::crd()).unwrap())
        .expect("MacBuild CRD installs");
    emu
}

/// An agent's shared state with one slot, on `client`, its journal in `state`.
fn shared(client: kube::Client, state: &std::path::Path) -> (Arc<Shared>, StateLock) {
    let toml = format!("agent_id = \"mac-a\"\nstate_dir = \"{}\"\nslots = 1\n", state.display());
    let config = Config::from_toml(std::path::Path::new("agent.toml"), &toml, "host", Some(state)).unwrap();
    let lock = StateLock::acquire(&config.state_dir).unwrap();
    let (journal, _) = Journal::open(&lock, JournalOptions::default()).unwrap();
    let (_, lease) = tokio::sync::watch::channel(LeaseState {
        last_renewed: None,
        last_renewed_wall: None,
        duration: Duration::from_secs(20),
        held_by_other: None,
        renewals: 0,
        conflicts: 0,
        last_error: None,
    });
    let shared = Shared {
        machine: machine_config(&config),
        core: Mutex::new(Core::new(journal)),
        tart: Tart::new(&config.tart, config.tart_home.clone()),
        delivery: Delivery::spawn(client.clone(), DeliveryConfig::from_config(&config)),
        events: Events::spawn(client.clone(), &config.agent_id, config.timing.api_timeout),
        client,
        slot_freed: Notify::new(),
        api_server: "emulator".into(),
        recovery_waits: std::sync::Mutex::new(None),
        lease,
        started: std::time::Instant::now(),
        config,
    };
    (Arc::new(shared), lock)
}

/// An interrupted attempt retired with a retry owed passes its slot straight on (a reservation).
/// If the MacBuild is gone when the next attempt is due (an operator removed the finalizer and
/// deleted it), no attempt follows, and the reservation must go with the task: before the fix it
/// stayed, and the slot counted as used until the agent restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_owed_to_a_macbuild_that_is_gone_releases_its_slot() {
    let emu = emulator().await;
    let dir = tempfile::tempdir().unwrap();
    let (shared, _lock) = shared(emu.client(), dir.path());
    let build = BuildRef {
        namespace: "ci".into(),
        name: "gone".into(),
        uid: "uid-gone".into(),
    };
    let cancel = register(&shared, &build.uid).await;
    // What journaling `Retired` with a retry following leaves: the slot reserved for the build.
    shared.core.lock().await.reserved.insert(build.uid.clone(), 0);
    let next = NextAttempt {
        build: build.clone(),
        attempt: 2,
        deadline: Timestamp::now() + SignedDuration::from_secs(3600),
    };
    let rest = Rest::Retired { next: Some(next) };
    tokio::time::timeout(
        Duration::from_secs(30),
        follow_retries(Arc::clone(&shared), build.clone(), rest, cancel),
    )
    .await
    .expect("the task ends once the MacBuild is found gone");
    let mut core = shared.core.lock().await;
    assert!(!core.active.contains_key(&build.uid), "the task is forgotten");
    assert_eq!(core.reserved, BTreeMap::new(), "no reservation outlives the task");
    assert_eq!(
        core.reserve_slot("uid-next", 1),
        Some(0),
        "the slot is free for another build"
    );
}

/// A build's task that failed (here: a journal write) between `Requested` and `Admitted` is taken
/// over once the journal works: it reads the MacBuild again and resumes the claim. If that read
/// fails (the API down a moment), the build is not gone: the read is tried again. Before the fix
/// the failed read counted as "gone", the task stopped for good, and the attempt stayed open (so
/// no scan claimed the build) until the agent restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_taken_over_before_its_admission_rides_out_a_failed_read_of_its_macbuild() {
    let emu = emulator().await;
    let namespaces: kube::Api<k8s_openapi::api::core::v1::Namespace> = kube::Api::all(emu.client());
    let ns = serde_json::from_value(serde_json::json!({"metadata": {"name": "ci"}})).unwrap();
    namespaces.create(&Default::default(), &ns).await.unwrap();
    let builds: kube::Api<MacBuild> = kube::Api::namespaced(emu.client(), "ci");
    let mut mb = MacBuild::new(
        "blip",
        MacBuildSpec::new(
            "ghcr.io/cirruslabs/macos-sequoia-xcode:16",
            vec![Step {
                name: "build".into(),
                run: vec!["true".into()],
                timeout_seconds: None,
            }],
        ),
    );
    mb.metadata.namespace = Some("ci".into());
    let mb = builds.create(&Default::default(), &mb).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    // Without kube's own retries of a 503, so that the task's read fails at the first answer.
    let mut config = emu.config();
    config.default_retry = false;
    let (shared, _lock) = shared(kube::Client::try_from(config).unwrap(), dir.path());
    let build = BuildRef::of(&mb);
    let cancel = register(&shared, &build.uid).await;
    let attempt = Attempt::new(build.clone(), 1, "mb-ci-blip-a1", 2);
    shared
        .journal(&attempt, &request(&attempt, None, Timestamp::now()), None, None, None)
        .await
        .unwrap();
    // The API is down when the task is taken over, and comes back a little later.
    emu.set_availability(Availability::Unavailable);
    let reads_before = reads_of(&emu, "blip");
    let task = tokio::spawn(follow_retries(
        Arc::clone(&shared),
        build.clone(),
        Rest::JournalFailed("injected".into()),
        cancel,
    ));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while reads_of(&emu, "blip") == reads_before {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the task never read its MacBuild"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    emu.set_availability(Availability::Up);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let now = builds.get("blip").await.unwrap();
        if now.status.and_then(|s| s.claim).is_some_and(|c| c.holder == "mac-a") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the build was never claimed after the API came back (task ended: {})",
            task.is_finished()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    task.abort();
}

/// How many reads of MacBuild `name` reached the emulator (an unavailable one answers each 503,
/// decided as it logs the request).
fn reads_of(emu: &EmulatorHandle, name: &str) -> usize {
    let path = format!("/macbuilds/{name}");
    emu.requests()
        .iter()
        .filter(|r| r.starts_with("GET ") && r.split(['?', ' ']).nth(1).is_some_and(|p| p.ends_with(&path)))
        .count()
}
