//! Adversary round 15: the agent's MacBuild view (two label-selected watches) and the attempt
//! book keyed by (build uid, attempt number).
//!
//! Part 1 runs the real watches of `MacBuildView` against the API emulator; part 2 drives the
//! attempt book through `Builds`' public entry points (`load_replay`, lookups, the scan's pass).
//! `Shared::compact_journal` needs a whole `Shared` (kube client, delivery, events, tart): it is
//! not attacked here (see the round's report).

mod cluster_common;

use cluster_common::{builds_in, create_build_in, emulator, merge};
use kube::api::DeleteParams;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use tartan_agent::cluster::view::{MacBuildView, StrayReads, selectors};
use tartan_agent::config::check_agent_id;
use tartan_agent::journal::{Journal, JournalOptions};
use tartan_agent::lock::StateLock;
use tartan_agent::machine::{Attempt, AttemptKey};
use tartan_agent::record::BuildRef;
use tartan_agent::recovery::Replay;
use tartan_agent::runtime::core::Builds;
use tartan_api::{AGENT_LABEL, AttemptState, FINALIZER, FINISHED_LABEL, MacBuild, MacBuildSpec, Outcome};
use tokio::sync::Notify;

// ---------------------------------------------------------------------------------------------
// Part 1: the view.

fn names_in(view: &MacBuildView) -> Vec<String> {
    let mut names: Vec<String> = view
        .builds()
        .iter()
        .map(|mb| {
            format!(
                "{}/{}",
                mb.metadata.namespace.clone().unwrap_or_default(),
                mb.metadata.name.clone().unwrap_or_default()
            )
        })
        .collect();
    names.sort();
    names
}

/// Waits until `view` holds exactly `want` (sorted), up to 10 s.
async fn settle(view: &MacBuildView, want: &[&str]) {
    let want: Vec<String> = want.iter().map(|s| s.to_string()).collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let now = names_in(view);
        if now == want {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "view holds {now:?}, expected {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Finished builds labelled with agent ids that are prefixes, extensions or look-alikes of this
/// agent's id, an empty value, or no agent label at all: only the exact id's finished build is
/// seen (plus every unfinished one, whatever its agent label).
#[tokio::test]
async fn view_held_lookalike_agent_labels_do_not_widen_the_own_finished_watch() {
    let emu = emulator().await;
    create_build_in(&emu, "ci", "queued", &[]).await;
    create_build_in(&emu, "ci", "running-elsewhere", &[(AGENT_LABEL, "mac-10")]).await;
    for (name, agent) in [
        ("mine", Some("mac-1")),
        ("prefix-longer", Some("mac-10")),
        ("prefix-shorter", Some("mac-")),
        ("dotted", Some("mac-1.x")),
        ("upper", Some("MAC-1")),
        ("empty", Some("")),
        ("nobody", None),
    ] {
        let mut labels = vec![(FINISHED_LABEL, "true")];
        if let Some(agent) = agent {
            labels.push((AGENT_LABEL, agent));
        }
        create_build_in(&emu, "ci", name, &labels).await;
    }
    // Finished with an odd value of the finished label: still finished (the selector is existence).
    create_build_in(
        &emu,
        "ci",
        "finished-false",
        &[(FINISHED_LABEL, "false"), (AGENT_LABEL, "mac-10")],
    )
    .await;
    // A long (63-character) agent label value of another agent.
    let long = format!("mac-1{}", "0".repeat(58));
    create_build_in(
        &emu,
        "ci",
        "long",
        &[(FINISHED_LABEL, "true"), (AGENT_LABEL, long.as_str())],
    )
    .await;
    let changed = Arc::new(Notify::new());
    let view = MacBuildView::watch(&emu.client(), &["ci".to_string()], "mac-1", &changed);
    settle(&view, &["ci/mine", "ci/queued", "ci/running-elsewhere"]).await;
    // The same in an all-namespaces view; another namespace's own finished build joins.
    create_build_in(
        &emu,
        "other",
        "mine-too",
        &[(FINISHED_LABEL, "true"), (AGENT_LABEL, "mac-1")],
    )
    .await;
    create_build_in(
        &emu,
        "other",
        "not-mine",
        &[(FINISHED_LABEL, "true"), (AGENT_LABEL, "mac-11")],
    )
    .await;
    let all = MacBuildView::watch(&emu.client(), &[], "mac-1", &changed);
    settle(
        &all,
        &["ci/mine", "ci/queued", "ci/running-elsewhere", "other/mine-too"],
    )
    .await;
    // A namespaced view does not see another namespace's build.
    settle(&view, &["ci/mine", "ci/queued", "ci/running-elsewhere"]).await;
}

/// Selector injection through the agent id: every id the configuration accepts yields the two
/// selectors with exactly one requirement on the agent label and no other; the ids that could
/// change the selector's meaning (',', '=', '!', spaces, parentheses, empty, > 63) are refused.
#[test]
fn view_held_an_agent_id_cannot_inject_selector_requirements() {
    for hostile in [
        "",
        "a,b",
        "a=b",
        "a!=b",
        "!a",
        "a b",
        "a in (b)",
        "a,!tartan.dev/finished",
        "a,tartan.dev/agent",
        "-a",
        "a-",
        "A",
        "a/b",
        "a_b",
        &"a".repeat(64),
    ] {
        assert!(check_agent_id(hostile).is_err(), "{hostile:?} accepted as an agent id");
    }
    for id in ["a", "mac-1", "mac.mini.07", &"a".repeat(63), "0"] {
        check_agent_id(id).unwrap();
        let [unfinished, own] = selectors(id);
        assert_eq!(unfinished, format!("!{FINISHED_LABEL}"));
        let reqs: Vec<&str> = own.split(',').collect();
        assert_eq!(
            reqs,
            vec![FINISHED_LABEL.to_string(), format!("{AGENT_LABEL}={id}")],
            "{own}"
        );
    }
}

/// A build this agent holds moves from the unfinished watch to its own-finished one (the
/// controller labels it finished), and is then deleted (the agent's finalizer keeps it, with a
/// deletionTimestamp): sampled all along, the view never holds it twice, and ends up showing the
/// deletion request, which the agent must act on. Another agent's view drops it for good.
#[tokio::test]
async fn view_held_a_held_build_moving_between_the_watches_is_never_doubled_and_its_deletion_is_seen() {
    let emu = emulator().await;
    create_build_in(&emu, "ci", "held", &[(AGENT_LABEL, "mac-1")]).await;
    merge(&emu, "ci", "held", json!({"metadata": {"finalizers": [FINALIZER]}})).await;
    let changed = Arc::new(Notify::new());
    let mine = MacBuildView::watch(&emu.client(), &["ci".to_string()], "mac-1", &changed);
    let other = MacBuildView::watch(&emu.client(), &["ci".to_string()], "mac-10", &changed);
    settle(&mine, &["ci/held"]).await;
    settle(&other, &["ci/held"]).await;

    // Sample the view continuously while the build moves between the watches.
    let sampling = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let mine = Arc::new(mine);
    let sampler = {
        let (view, on) = (Arc::clone(&mine), Arc::clone(&sampling));
        tokio::spawn(async move {
            let (mut doubled, mut absent, mut samples) = (0u32, 0u32, 0u32);
            while on.load(std::sync::atomic::Ordering::SeqCst) {
                let b = view.builds();
                samples += 1;
                match b.len() {
                    0 => absent += 1,
                    1 => {}
                    _ => doubled += 1,
                }
                tokio::task::yield_now().await;
            }
            (doubled, absent, samples)
        })
    };
    for round in 0..5 {
        // Several transitions back and forth (as only an operator could do) to widen the window.
        merge(
            &emu,
            "ci",
            "held",
            json!({"metadata": {"labels": {FINISHED_LABEL: "true"}}}),
        )
        .await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        if round < 4 {
            merge(
                &emu,
                "ci",
                "held",
                json!({"metadata": {"labels": {FINISHED_LABEL: null}}}),
            )
            .await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    builds_in(&emu, "ci")
        .delete("held", &DeleteParams::default())
        .await
        .expect("deletion accepted");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let b = mine.builds();
        if b.len() == 1 && b[0].metadata.deletion_timestamp.is_some() {
            assert!(b[0].metadata.labels.as_ref().unwrap().contains_key(FINISHED_LABEL));
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the deletion never reached mac-1's view"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sampling.store(false, std::sync::atomic::Ordering::SeqCst);
    let (doubled, absent, samples) = sampler.await.unwrap();
    assert_eq!(doubled, 0, "the build was in the view twice ({samples} samples)");
    // A moment with the build in neither store is possible (two watch connections); it only
    // delays the next scan's look at it. Report it without failing.
    eprintln!("samples {samples}, absent {absent}");
    settle(&other, &[]).await;
}

/// Was a FINDING. Steps: agent mac-a holds build `taken` (claim and label `tartan.dev/agent=mac-a`,
/// its VM running a long step) and is cut off from the API past its Lease. mac-b takes the claim
/// over (status.claim.holder = mac-b; its finalizer patch relabels `tartan.dev/agent=mac-b`).
/// The pipeline is cancelled: `spec.cancelRequested`; the run finishes and, 30 s later
/// (`finished_label_after`), the controller labels the MacBuild `tartan.dev/finished`. mac-a
/// comes back and relists its two watches: `!tartan.dev/finished` no longer has the build and
/// `tartan.dev/finished,tartan.dev/agent=mac-a` never had it, so its scan never saw the cancel
/// (before the view, mac-a watched every MacBuild). Fixed: the scan reads each build it has a
/// task for that neither watch has (`StrayReads`), at most once per interval.
#[tokio::test]
async fn view_held_a_former_holder_reads_the_cancel_of_a_build_taken_over_and_finished() {
    let emu = emulator().await;
    let created = create_build_in(&emu, "ci", "taken", &[(AGENT_LABEL, "mac-a")]).await;
    merge(&emu, "ci", "taken", json!({"metadata": {"finalizers": [FINALIZER]}})).await;
    // While mac-a is away: takeover by mac-b (label follows the claim), cancel, finished label.
    merge(
        &emu,
        "ci",
        "taken",
        json!({"metadata": {"labels": {AGENT_LABEL: "mac-b"}}}),
    )
    .await;
    merge(&emu, "ci", "taken", json!({"spec": {"cancelRequested": true}})).await;
    merge(
        &emu,
        "ci",
        "taken",
        json!({"metadata": {"labels": {FINISHED_LABEL: "true"}}}),
    )
    .await;
    // mac-a is back: its watches list again, and do not have the build.
    let changed = Arc::new(Notify::new());
    let mac_a = MacBuildView::watch(&emu.client(), &["ci".to_string()], "mac-a", &changed);
    let mac_b = MacBuildView::watch(&emu.client(), &["ci".to_string()], "mac-b", &changed);
    settle(&mac_b, &["ci/taken"]).await;
    settle(&mac_a, &[]).await;
    // mac-a still has a task for `taken`: the stray read brings its cancel request.
    let taken = bref("ci", "taken", created.metadata.uid.as_deref().unwrap());
    let mut strays = StrayReads::new(Duration::from_secs(60));
    let timeout = Duration::from_secs(2);
    let read = strays
        .read(&emu.client(), timeout, std::slice::from_ref(&taken), &mac_a.builds())
        .await;
    assert!(
        read.len() == 1 && read[0].spec.cancel_requested,
        "mac-a reads the cancel request of `taken`: {read:?}"
    );
    // Read again only after the interval; never for a build the view has.
    let again = strays
        .read(&emu.client(), timeout, std::slice::from_ref(&taken), &mac_a.builds())
        .await;
    assert!(again.is_empty(), "read again within the interval");
    let in_view = strays
        .read(&emu.client(), timeout, std::slice::from_ref(&taken), &mac_b.builds())
        .await;
    assert!(in_view.is_empty(), "a build the view has is not read");
    // Another object under the same name is not the build this task works on.
    let other = bref("ci", "taken", "some-other-uid");
    let renamed = strays.read(&emu.client(), timeout, &[other], &mac_a.builds()).await;
    assert!(renamed.is_empty(), "another object under the name: {renamed:?}");
}

// ---------------------------------------------------------------------------------------------
// Part 2: the attempt book.

fn new_builds() -> (Builds, StateLock, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let lock = StateLock::acquire(dir.path()).unwrap();
    let (journal, _) = Journal::open(&lock, JournalOptions::default()).unwrap();
    (Builds::new(journal), lock, dir)
}

fn bref(ns: &str, name: &str, uid: &str) -> BuildRef {
    BuildRef {
        namespace: ns.into(),
        name: name.into(),
        uid: uid.into(),
    }
}

fn attempt(b: &BuildRef, number: u32, state: AttemptState, outcome: Option<Outcome>) -> Attempt {
    let mut a = Attempt::new(b.clone(), number, format!("mb-{}-{}-a{number}", b.name, b.uid), 3);
    a.state = state;
    a.outcome = outcome;
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

fn macbuild(uid: &str) -> Arc<MacBuild> {
    let mut mb = MacBuild::new(&format!("b-{uid}"), MacBuildSpec::new("img", vec![]));
    mb.metadata.namespace = Some("ci".into());
    mb.metadata.uid = Some(uid.into());
    Arc::new(mb)
}

async fn picked(builds: &Builds, uids: &[&str]) -> Vec<String> {
    let mbs: Vec<Arc<MacBuild>> = uids.iter().map(|u| macbuild(u)).collect();
    builds
        .withdraw_or_pick_new(&mbs, "agent-a")
        .await
        .new
        .into_iter()
        .map(|mb| mb.metadata.uid.clone().unwrap())
        .collect()
}

/// Attempt numbers at the edges (0 and u32::MAX) and uids that are prefixes of one another (or
/// differ only past a NUL, or are empty): each build's range holds its own attempts only, the
/// latest is the highest number, and the scan's pass picks exactly the builds with nothing open
/// and nothing finished.
#[tokio::test]
async fn attempt_book_held_edge_numbers_and_prefix_uids_stay_apart() {
    let (builds, _lock, _dir) = new_builds();
    let a = bref("ci", "a", "u");
    let a_long = bref("ci", "a-long", "u1");
    let a_nul = bref("ci", "a-nul", "u\0");
    let empty = bref("ci", "empty", "");
    load(
        &builds,
        vec![
            attempt(&a, 0, AttemptState::Retired, None),
            attempt(&a, u32::MAX, AttemptState::Retired, Some(Outcome::Succeeded)),
            attempt(&a, 7, AttemptState::Retired, Some(Outcome::Failed)),
            // `u1` and `u\0` sort right after `u`: open attempts there must not count for `u`.
            attempt(&a_long, 0, AttemptState::Running, None),
            attempt(&a_nul, u32::MAX, AttemptState::Admitted, None),
            attempt(&empty, 1, AttemptState::Retired, None),
        ],
    )
    .await;
    let latest = builds.latest_attempt("u").await.unwrap();
    assert_eq!((latest.number, latest.outcome), (u32::MAX, Some(Outcome::Succeeded)));
    assert_eq!(builds.latest_attempt("u1").await.unwrap().number, 0);
    assert_eq!(builds.latest_attempt("u\0").await.unwrap().number, u32::MAX);
    assert_eq!(builds.latest_attempt("").await.unwrap().number, 1);
    assert!(builds.latest_attempt("u2").await.is_none());
    assert!(builds.latest_attempt("t").await.is_none());
    // `u` finished here (latest retired with an outcome); `u1`, `u\0` open; `` retired without
    // an outcome (a lost claim): new again; `u2` never seen: new.
    assert!(!builds.is_new("u").await);
    assert!(!builds.is_new("u1").await);
    assert!(!builds.is_new("u\0").await);
    assert!(builds.is_new("").await);
    assert!(builds.is_new("u2").await);
    // The scan does not pick `` all the same: the claim it would make (a1, its MacBuild listing
    // no attempt) is the one the journal has lost, and a journaled attempt is never claimed again.
    assert_eq!(picked(&builds, &["u", "u1", "u\0", "", "u2"]).await, vec!["u2"]);
    for (b, n) in [(&a, 0), (&a, 7), (&a, u32::MAX), (&a_long, 0), (&a_nul, u32::MAX)] {
        let key = AttemptKey {
            build: b.clone(),
            attempt: n,
        };
        assert!(builds.has_attempt(&key).await, "{key}");
        assert_eq!(builds.attempt(&key).await.unwrap().build, *b);
    }
    for (b, n) in [(&a, 1), (&a_long, 1), (&a, u32::MAX - 1), (&empty, 0)] {
        let key = AttemptKey {
            build: b.clone(),
            attempt: n,
        };
        assert!(!builds.has_attempt(&key).await, "{key}");
    }
}

/// A later attempt of the same number replaces the earlier one (a replay folds each attempt to
/// its last record): the open/finished verdicts follow the replacement, not a stale copy.
#[tokio::test]
async fn attempt_book_held_a_replaced_attempt_leaves_no_stale_verdict() {
    let (builds, _lock, _dir) = new_builds();
    let b = bref("ci", "b", "uid-b");
    load(&builds, vec![attempt(&b, 1, AttemptState::Running, None)]).await;
    assert!(!builds.is_new("uid-b").await);
    load(
        &builds,
        vec![attempt(&b, 1, AttemptState::Retired, Some(Outcome::Failed))],
    )
    .await;
    assert!(!builds.is_new("uid-b").await, "finished here");
    assert_eq!(picked(&builds, &["uid-b"]).await, Vec::<String>::new());
    load(&builds, vec![attempt(&b, 2, AttemptState::Retired, None)]).await;
    // The latest (a2) is retired without an outcome: the build may be claimed again.
    assert_eq!(builds.latest_attempt("uid-b").await.unwrap().number, 2);
    assert!(builds.is_new("uid-b").await);
}

/// Behaviour change of the uid-keyed book, pinned: an attempt is found by its build's uid and
/// number whatever namespace/name the key spells (a uid names one object in a cluster, so the
/// journal never has one uid under two references), and two references sharing a uid share one
/// entry per number: the last one loaded. The full-reference key kept both apart before.
#[tokio::test]
async fn attempt_book_held_the_uid_identifies_the_build_not_its_reference() {
    let (builds, _lock, _dir) = new_builds();
    let first = bref("ci", "x", "same-uid");
    let renamed = bref("team", "y", "same-uid");
    load(&builds, vec![attempt(&first, 1, AttemptState::Running, None)]).await;
    let other_spelling = AttemptKey {
        build: renamed.clone(),
        attempt: 1,
    };
    let found = builds.attempt(&other_spelling).await.unwrap();
    assert_eq!(found.build, first, "found under the uid, with its own reference");
    load(
        &builds,
        vec![attempt(&renamed, 1, AttemptState::Retired, Some(Outcome::Succeeded))],
    )
    .await;
    let key = AttemptKey {
        build: first.clone(),
        attempt: 1,
    };
    assert_eq!(
        builds.attempt(&key).await.unwrap().build,
        renamed,
        "one entry per uid and number"
    );
    // Nothing open is left for the uid: the running copy under the first reference is gone.
    assert!(!builds.is_new("same-uid").await, "finished here under either reference");
}
