//! A build's task in the runtime (its slot, its recovery after a fault), on the API emulator
//! with a real journal.

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::CustomResourceExt;
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
use tartan_agent::runtime::build::{BuildTask, Rest, follow_retries, register};
use tartan_agent::runtime::core::{Builds, Shared};
use tartan_agent::runtime::machine_config;
use tartan_api::{MacBuild, MacBuildSpec, Step};
use tartan_tart::Tart;
use tartan_testkit::{Availability, EmulatorHandle};

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
        builds: Builds::new(journal),
        tart: Tart::new(&config.tart, config.tart_home.clone()),
        delivery: Delivery::spawn(client.clone(), DeliveryConfig::from_config(&config)),
        events: Events::spawn(client.clone(), &config.agent_id, config.timing.api_timeout),
        client,
        api_server: "emulator".into(),
        recovery_waits: std::sync::Mutex::new(None),
        lease,
        started: std::time::Instant::now(),
        fatal: tokio::sync::watch::Sender::new(None),
        disk: tartan_agent::host::disk::DiskFloor::new(config.state_dir.clone(), Err("not used".into()), 0).0,
        config,
    };
    (Arc::new(shared), lock)
}

/// Journals `t` for `attempt` holding no slot reservation, and reports it.
async fn journal(
    shared: &Shared,
    attempt: &Attempt,
    t: &tartan_agent::machine::Transition,
) -> tartan_agent::record::Record {
    let journaled = shared.journal(attempt, t, None, None, None, &mut None).await.unwrap();
    shared.report(journaled)
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
    let reservation = shared.builds.reserve(&build.uid, 1).await.unwrap();
    let next = NextAttempt {
        build: build.clone(),
        attempt: 2,
        deadline: Timestamp::now() + SignedDuration::from_secs(3600),
    };
    let rest = Rest::Retired { next: Some(next) };
    tokio::time::timeout(
        Duration::from_secs(30),
        follow_retries(
            Arc::clone(&shared),
            build.clone(),
            rest,
            BuildTask::holding(cancel, reservation),
        ),
    )
    .await
    .expect("the task ends once the MacBuild is found gone");
    assert!(!shared.builds.has_task(&build.uid).await, "the task is forgotten");
    assert_eq!(shared.builds.free_slots(1).await, 1, "no reservation outlives the task");
    assert_eq!(
        shared.builds.reserve("uid-next", 1).await.map(|r| r.slot()),
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
    journal(&shared, &attempt, &request(&attempt, None, Timestamp::now())).await;
    // The API is down when the task is taken over, and comes back a little later.
    emu.set_availability(Availability::Unavailable);
    let reads_before = reads_of(&emu, "blip");
    let task = tokio::spawn(follow_retries(
        Arc::clone(&shared),
        build.clone(),
        Rest::JournalFailed("injected".into()),
        BuildTask::new(cancel),
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

/// A holder whose claim moved to another agent while its attempt was open learns it from its
/// next status write, which is fenced out; the build's task is then withdrawn (`ClaimMoved`), so
/// the attempt stops and deletes its VM instead of running its copy of the build to the end.
/// Before the fix the fence only stopped the status writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_status_write_fenced_out_withdraws_the_open_attempt() {
    use tartan_agent::host::Withdrawal;
    use tartan_agent::machine::{Event, step};
    let emu = emulator().await;
    let namespaces: kube::Api<k8s_openapi::api::core::v1::Namespace> = kube::Api::all(emu.client());
    let ns = serde_json::from_value(serde_json::json!({"metadata": {"name": "ci"}})).unwrap();
    namespaces.create(&Default::default(), &ns).await.unwrap();
    let builds: kube::Api<MacBuild> = kube::Api::namespaced(emu.client(), "ci");
    let mut mb = MacBuild::new(
        "moved",
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
    // Another agent holds the build now (this one was cut off past its Lease).
    builds
        .patch_status(
            "moved",
            &Default::default(),
            &kube::api::Patch::Merge(
                serde_json::json!({"status": {"claim": {"holder": "mac-b", "attempt": "moved#2", "epoch": 2}}}),
            ),
        )
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (shared, _lock) = shared(emu.client(), dir.path());
    let build = BuildRef::of(&mb);
    let signal = register(&shared, &build.uid).await;
    let watcher = tokio::spawn(tartan_agent::runtime::build::withdraw_when_fenced_out(
        Arc::clone(&shared),
        build.clone(),
    ));
    let mut attempt = Attempt::new(build.clone(), 1, "mb-ci-moved-a1", 2);
    let requested = request(&attempt, None, Timestamp::now());
    attempt.observe(&journal(&shared, &attempt, &requested).await);
    let admit = Event::Admit {
        slot: 0,
        slots: 1,
        timeout: SignedDuration::from_secs(1800),
    };
    let admitted = step(&attempt, admit, Timestamp::now(), &shared.machine).unwrap();
    // Journaling the admission delivers its status, which the new holder's claim fences out.
    journal(&shared, &attempt, &admitted).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while signal.current().is_none() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the open attempt was never withdrawn (delivery: {:?})",
            shared.delivery.progress(&build).borrow().clone()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(signal.current(), Some(Withdrawal::ClaimMoved));
    tokio::time::timeout(Duration::from_secs(5), watcher)
        .await
        .expect("the watcher ends once it withdrew the attempt")
        .unwrap();
    // Nothing of ours reached the MacBuild.
    let now = builds.get("moved").await.unwrap();
    assert_eq!(now.status.unwrap().claim.unwrap().holder, "mac-b");
}

/// A finished attempt of `mb` as a previous agent journaled it (numbers from `first_seq`), its
/// last record holding the status to redeliver.
fn finished_records(mb: &MacBuild, first_seq: u64) -> Vec<tartan_agent::record::Record> {
    use tartan_agent::machine::{Deleted, Event, step};
    let build = BuildRef::of(mb);
    let mut a = Attempt::new(build.clone(), 1, format!("mb-ci-{}-a1", build.name), 1);
    let now = Timestamp::now();
    let machine = tartan_agent::machine::Config::default();
    let mut transitions = vec![request(&a, None, now)];
    let mut records = Vec::new();
    let events = [
        Event::Admit {
            slot: 0,
            slots: 1,
            timeout: SignedDuration::from_secs(1800),
        },
        Event::Boot,
        Event::VmStartFailed {
            error: "tart clone exited 2".into(),
        },
        Event::VmDeleted {
            how: Deleted::Stopped {
                took: SignedDuration::from_secs(1),
            },
        },
    ];
    let mut events = events.into_iter();
    let mut seq = first_seq;
    while let Some(t) = transitions.pop() {
        let mut r = a.record(&t, seq);
        seq += 1;
        a.observe(&r);
        if let Some(ev) = events.next() {
            transitions.push(step(&a, ev, now, &machine).unwrap());
        } else {
            let status = tartan_api::MacBuildStatus {
                claim: Some(tartan_api::Claim {
                    holder: "mac-a".into(),
                    attempt: tartan_api::attempt_id(&build.name, 1),
                    epoch: 1,
                }),
                ..Default::default()
            };
            r.status = Some(serde_json::to_value(status).unwrap());
        }
        records.push(r);
    }
    records
}

/// Recovery's second half (after the cluster could not be read at start) reads each waiting
/// build on its own: a MacBuild that does not decode holds up no other build's recovery, and is
/// given up after a bounded number of reads. Before the fix one bad read failed the read of all
/// of them, retried for ever, and no deferred build was recovered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_unreadable_macbuild_does_not_hold_up_the_recovery_of_the_others() {
    let emu = tartan_testkit::start(tartan_testkit::Options::default())
        .await
        .expect("emulator starts");
    // A schema that lets a negative journalSeq in: stored fine, it does not decode as ours.
    let mut crd = serde_json::to_value(MacBuild::crd()).unwrap();
    let seq_schema = &mut crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
        ["journalSeq"];
    seq_schema.as_object_mut().unwrap().remove("minimum");
    emu.install_crd(crd).expect("MacBuild CRD installs");
    let namespaces: kube::Api<k8s_openapi::api::core::v1::Namespace> = kube::Api::all(emu.client());
    let ns = serde_json::from_value(serde_json::json!({"metadata": {"name": "ci"}})).unwrap();
    namespaces.create(&Default::default(), &ns).await.unwrap();
    let builds: kube::Api<MacBuild> = kube::Api::namespaced(emu.client(), "ci");
    let mut created = Vec::new();
    for (name, seq) in [("bad", -1), ("good", 1)] {
        let mut mb = MacBuild::new(
            name,
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
        builds.create(&Default::default(), &mb).await.unwrap();
        let claim = serde_json::json!({"holder": "mac-a", "attempt": format!("{name}#1"), "epoch": 1});
        let patch = kube::api::Patch::Merge(serde_json::json!({"status": {"claim": claim}}));
        let mb = builds.patch_status(name, &Default::default(), &patch).await.unwrap();
        // Written raw: the typed client would refuse to read the answer back.
        let raw: kube::Api<kube::api::DynamicObject> =
            kube::Api::namespaced_with(emu.client(), "ci", &kube::api::ApiResource::erase::<MacBuild>(&()));
        let seq_patch = kube::api::Patch::Merge(serde_json::json!({"status": {"journalSeq": seq}}));
        raw.patch_status(name, &Default::default(), &seq_patch).await.unwrap();
        created.push(mb);
    }
    assert!(builds.get("bad").await.is_err(), "the bad MacBuild does not decode");
    let mut records = finished_records(&created[0], 2);
    records.extend(finished_records(&created[1], 7));
    let good_last = records.last().unwrap().seq;
    let dir = tempfile::tempdir().unwrap();
    let (shared, _lock) = shared(emu.client(), dir.path());
    let finish = tokio::spawn({
        let shared = Arc::clone(&shared);
        async move {
            tartan_agent::runtime::recover::finish_with_cluster(&shared, records, vec![], Default::default()).await;
        }
    });
    // The good build gets its status redelivered although the bad one cannot be read.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let good = builds.get("good").await.unwrap();
        if good.status.and_then(|s| s.journal_seq) == Some(good_last) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the good build was never recovered (waits: {:?})",
            shared.recovery_waits.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The bad one is read again a bounded number of times, then left to the next start.
    tokio::time::timeout(Duration::from_secs(120), finish)
        .await
        .expect("recovery gives up on the unreadable MacBuild")
        .unwrap();
    assert_eq!(*shared.recovery_waits.lock().unwrap(), None);
}

/// A build whose task keeps failing (here: the task and every take-over panic): once the faults
/// run out the agent does not leave the attempt open with its VM for the watchdog. It journals
/// the interruption (so the next start deletes the VM instead of resuming it), frees the slot and
/// asks the agent to exit non-zero, so that launchd starts it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_build_task_that_keeps_failing_interrupts_its_attempt_and_stops_the_agent() {
    use tartan_agent::machine::{Event, step};
    use tartan_api::{AttemptState, Outcome, Reason};
    let emu = emulator().await;
    let dir = tempfile::tempdir().unwrap();
    let (shared, _lock) = shared(emu.client(), dir.path());
    let build = BuildRef {
        namespace: "ci".into(),
        name: "faulty".into(),
        uid: "uid-faulty".into(),
    };
    let cancel = register(&shared, &build.uid).await;
    let mut attempt = Attempt::new(build.clone(), 1, "mb-ci-faulty-a1", 2);
    let now = Timestamp::now();
    let mut t = request(&attempt, None, now);
    for ev in [
        Some(Event::Admit {
            slot: 0,
            slots: 1,
            timeout: SignedDuration::from_secs(1800),
        }),
        Some(Event::Boot),
        None,
    ] {
        attempt.observe(&journal(&shared, &attempt, &t).await);
        if let Some(ev) = ev {
            t = step(&attempt, ev, now, &shared.machine).unwrap();
        }
    }
    assert_eq!(attempt.state, AttemptState::Booting);
    let mut fatal = shared.fatal.subscribe();
    let take_overs = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let counted = Arc::clone(&take_overs);
    tartan_agent::runtime::build::spawn_supervised_with(
        Arc::clone(&shared),
        build.clone(),
        cancel,
        |_, _| async { panic!("the build's task failed") },
        move |_, _, _, message| {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async move { panic!("the take-over failed too (after: {message})") }
        },
    );
    tokio::time::timeout(Duration::from_secs(20), fatal.changed())
        .await
        .expect("the agent is asked to exit")
        .unwrap();
    let why = fatal.borrow().clone().unwrap();
    assert!(why.contains("failed 4 times"), "{why}");
    assert_eq!(take_overs.load(std::sync::atomic::Ordering::SeqCst), 3);
    let a = shared.builds.latest_attempt(&build.uid).await.unwrap();
    assert_eq!(
        (a.state, a.reason, a.outcome),
        (
            AttemptState::Retiring,
            Some(Reason::AgentFault),
            Some(Outcome::Interrupted)
        )
    );
    assert!(!shared.builds.has_task(&build.uid).await, "the task is forgotten");
    // Durable: the next start finds the interruption and deletes the VM instead of resuming.
    drop(_lock);
    let records = tartan_agent::journal::read_records(dir.path()).unwrap().records;
    let last = records.last().unwrap();
    assert_eq!(
        (last.from, last.to),
        (Some(AttemptState::Booting), AttemptState::Retiring)
    );
    assert!(
        last.detail
            .contains("the agent exits and its next start deletes the VM"),
        "{}",
        last.detail
    );
}

/// A MacBuild `name` in namespace `ci` (created with the namespace when missing).
async fn macbuild(emu: &EmulatorHandle, name: &str) -> MacBuild {
    let namespaces: kube::Api<k8s_openapi::api::core::v1::Namespace> = kube::Api::all(emu.client());
    let ns = serde_json::from_value(serde_json::json!({"metadata": {"name": "ci"}})).unwrap();
    let _ = namespaces.create(&Default::default(), &ns).await;
    let builds: kube::Api<MacBuild> = kube::Api::namespaced(emu.client(), "ci");
    let mut mb = MacBuild::new(
        name,
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
    builds.create(&Default::default(), &mb).await.unwrap()
}

/// The journal step moves the slot: an `Admitted` record ends the build's reservation (the
/// attempt holds the slot now, also while its VM's deletion is unconfirmed), and an attempt
/// retired with a retry owed hands its slot straight to a reservation for that retry. The slot is
/// never free in between: another build finds none at every step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_journal_moves_the_slot_between_reservation_and_attempt_without_a_gap() {
    use tartan_agent::machine::{Deleted, Event, step};
    use tartan_api::{AttemptState, Outcome};
    let emu = emulator().await;
    let dir = tempfile::tempdir().unwrap();
    let (shared, _lock) = shared(emu.client(), dir.path());
    let build = BuildRef {
        namespace: "ci".into(),
        name: "moves".into(),
        uid: "uid-moves".into(),
    };
    let mut slot = shared.builds.reserve(&build.uid, 1).await;
    assert_eq!(slot.as_ref().map(|r| r.slot()), Some(0));
    let mut attempt = Attempt::new(build.clone(), 1, "mb-ci-moves-a1", 2);
    let now = Timestamp::now();
    let mut t = request(&attempt, None, now);
    let events = [
        Event::Admit {
            slot: 0,
            slots: 1,
            timeout: SignedDuration::from_secs(1800),
        },
        Event::Boot,
        Event::AgentFault {
            message: "injected".into(),
        },
        Event::VmDeleted {
            how: Deleted::Stopped {
                took: SignedDuration::from_secs(1),
            },
        },
    ];
    for ev in events.into_iter().map(Some).chain([None]) {
        let journaled = shared.journal(&attempt, &t, None, None, None, &mut slot).await.unwrap();
        attempt.observe(&shared.report(journaled));
        let held = match attempt.state {
            AttemptState::Requested => "the reservation",
            AttemptState::Retired => "the retry's reservation",
            _ => "the attempt",
        };
        assert_eq!(
            shared.builds.free_slots(1).await,
            0,
            "{}: {held} holds the slot",
            attempt.state
        );
        assert!(
            shared.builds.reserve("uid-other", 1).await.is_none(),
            "{}",
            attempt.state
        );
        let reserved = slot.is_some();
        assert_eq!(
            reserved,
            matches!(attempt.state, AttemptState::Requested | AttemptState::Retired),
            "{}: reservation {slot:?}",
            attempt.state
        );
        if let Some(ev) = ev {
            t = step(&attempt, ev, now, &shared.machine).unwrap();
        }
    }
    assert_eq!(attempt.outcome, Some(Outcome::Interrupted));
    assert_eq!(slot.as_ref().map(|r| (r.slot(), r.uid())), Some((0, "uid-moves")));
    drop(slot);
    assert_eq!(shared.builds.free_slots(1).await, 1, "released with its holder");
}

/// A claim another agent holds is lost before anything is cloned: the reservation the scan made
/// for it is freed, and the task holds none afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_claim_frees_its_reservation() {
    let emu = emulator().await;
    let mb = macbuild(&emu, "taken").await;
    let builds: kube::Api<MacBuild> = kube::Api::namespaced(emu.client(), "ci");
    let claim = serde_json::json!({"holder": "mac-b", "attempt": "taken#1", "epoch": 1});
    let patch = kube::api::Patch::Merge(serde_json::json!({"status": {"claim": claim}}));
    let mb = MacBuild {
        status: builds
            .patch_status("taken", &Default::default(), &patch)
            .await
            .unwrap()
            .status,
        ..mb
    };
    let dir = tempfile::tempdir().unwrap();
    let (shared, _lock) = shared(emu.client(), dir.path());
    let uid = mb.metadata.uid.clone().unwrap();
    let reservation = shared.builds.reserve(&uid, 1).await.unwrap();
    let mut task = BuildTask::new(register(&shared, &uid).await);
    let rest = tartan_agent::runtime::build::claim_and_run(&shared, &mb, 1, None, reservation, &mut task).await;
    assert_eq!(rest, Rest::Retired { next: None });
    assert_eq!(task.reserved_slot(), None);
    assert_eq!(shared.builds.free_slots(1).await, 1, "the slot is free again");
    let a = shared.builds.latest_attempt(&uid).await.unwrap();
    assert_eq!(a.reason, Some(tartan_api::Reason::ClaimLost));
}

/// An attempt the journal already has is never requested again: the reservation made for it is
/// freed at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_already_journaled_frees_its_reservation() {
    let emu = emulator().await;
    let mb = macbuild(&emu, "again").await;
    let dir = tempfile::tempdir().unwrap();
    let (shared, _lock) = shared(emu.client(), dir.path());
    let build = BuildRef::of(&mb);
    let attempt = Attempt::new(build.clone(), 1, "mb-ci-again-a1", 2);
    journal(&shared, &attempt, &request(&attempt, None, Timestamp::now())).await;
    let reservation = shared.builds.reserve(&build.uid, 1).await.unwrap();
    let mut task = BuildTask::new(register(&shared, &build.uid).await);
    let rest = tartan_agent::runtime::build::claim_and_run(&shared, &mb, 1, None, reservation, &mut task).await;
    assert_eq!(rest, Rest::Retired { next: None });
    assert_eq!(shared.builds.free_slots(1).await, 1);
}
