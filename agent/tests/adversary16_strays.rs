//! Adversary round 16: `StrayReads::read`, the scan's direct reads of the MacBuilds it has a
//! task for that its watches do not hold. Run against the API emulator.

mod cluster_common;

use cluster_common::{builds_in, create_build_in, emulator, merge};
use kube::api::DeleteParams;
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tartan_agent::cluster::view::StrayReads;
use tartan_agent::record::BuildRef;
use tartan_api::{FINALIZER, MacBuild};
use tartan_testkit::Availability;

fn bref(ns: &str, name: &str, uid: &str) -> BuildRef {
    BuildRef {
        namespace: ns.into(),
        name: name.into(),
        uid: uid.into(),
    }
}

fn uid(mb: &MacBuild) -> String {
    mb.metadata.uid.clone().unwrap()
}

/// Hostile namespaces and names (missing, empty, `..`, `/`, very long, odd characters, path
/// traversal towards a real build) return nothing, panic nowhere, and each stays within the
/// timeout; a real build among them is still read.
#[tokio::test]
async fn strays_held_hostile_namespaces_and_names_return_nothing_unrelated() {
    let emu = emulator().await;
    let real = create_build_in(&emu, "ci", "real", &[]).await;
    let secret = create_build_in(&emu, "other", "secret", &[]).await;
    let long = "a".repeat(5000);
    let tasks = vec![
        bref("nope", "x", "u1"),
        bref("", "x", "u2"),
        bref("..", "x", "u3"),
        bref("/", "x", "u4"),
        bref(&long, "x", "u5"),
        bref("ci", &long, "u6"),
        bref("ci", "", "u7"),
        bref("ci", "a b?c#d%2F", "u8"),
        bref("ci", "../../other/macbuilds/secret", "u9"),
        bref("ci/../other", "secret", "u10"),
        bref("ci", "real\n", "u11"),
        bref("ci", "real", &uid(&real)),
    ];
    let mut strays = StrayReads::new(Duration::from_secs(60));
    let timeout = Duration::from_secs(2);
    let started = Instant::now();
    let read = strays.read(&emu.client(), timeout, &tasks, &[]).await;
    let elapsed = started.elapsed();
    let uids: Vec<String> = read.iter().map(|mb| uid(mb)).collect();
    assert_eq!(uids, vec![uid(&real)], "only the real build comes back: {read:?}");
    assert!(!uids.contains(&uid(&secret)));
    assert!(elapsed < timeout * tasks.len() as u32, "bounded: {elapsed:?}");
}

/// Duplicate tasks for one uid: read once, returned once.
#[tokio::test]
async fn strays_held_duplicate_tasks_for_one_uid_read_once() {
    let emu = emulator().await;
    let real = create_build_in(&emu, "ci", "real", &[]).await;
    let t = bref("ci", "real", &uid(&real));
    let mut strays = StrayReads::new(Duration::from_secs(60));
    let read = strays
        .read(&emu.client(), Duration::from_secs(2), &[t.clone(), t.clone(), t], &[])
        .await;
    assert_eq!(read.len(), 1, "{read:?}");
}

/// An API that answers late: each read ends at the timeout, the whole call at most
/// tasks × timeout (serial); nothing is returned.
#[tokio::test]
async fn strays_held_a_slow_api_bounds_each_read_by_the_timeout() {
    let emu = emulator().await;
    let mut tasks = Vec::new();
    for i in 0..6 {
        let mb = create_build_in(&emu, "ci", &format!("b{i}"), &[]).await;
        tasks.push(bref("ci", &format!("b{i}"), &uid(&mb)));
    }
    emu.set_latency(Duration::from_secs(30));
    let mut strays = StrayReads::new(Duration::from_secs(60));
    let timeout = Duration::from_millis(300);
    let started = Instant::now();
    let read = strays.read(&emu.client(), timeout, &tasks, &[]).await;
    let elapsed = started.elapsed();
    assert!(read.is_empty());
    assert!(
        elapsed < timeout * tasks.len() as u32 + Duration::from_millis(700),
        "serial worst case tasks × timeout: {elapsed:?}"
    );
    assert!(elapsed >= timeout * tasks.len() as u32, "reads are serial: {elapsed:?}");
}

/// An API that is unavailable (503) or refuses connections: every read fails fast, nothing returned.
#[tokio::test]
async fn strays_held_an_unavailable_or_refusing_api_returns_nothing_in_time() {
    let emu = emulator().await;
    let mb = create_build_in(&emu, "ci", "b", &[]).await;
    let t = bref("ci", "b", &uid(&mb));
    let timeout = Duration::from_secs(1);
    for a in [Availability::Unavailable, Availability::Refuse] {
        emu.set_availability(a);
        let mut strays = StrayReads::new(Duration::from_secs(60));
        let started = Instant::now();
        let read = strays.read(&emu.client(), timeout, std::slice::from_ref(&t), &[]).await;
        assert!(read.is_empty());
        assert!(
            started.elapsed() < timeout + Duration::from_millis(700),
            "{:?}",
            started.elapsed()
        );
    }
    emu.set_availability(Availability::Up);
}

/// A read that failed (API down) is not retried before the interval ends: the cancel requested
/// meanwhile reaches the task only one interval later. A 1 s interval here shows it does come.
#[tokio::test]
async fn strays_held_a_failed_read_is_retried_after_the_interval_and_brings_the_cancel() {
    let emu = emulator().await;
    let mb = create_build_in(&emu, "ci", "b", &[]).await;
    merge(&emu, "ci", "b", json!({"spec": {"cancelRequested": true}})).await;
    let t = bref("ci", "b", &uid(&mb));
    let timeout = Duration::from_millis(500);
    let mut strays = StrayReads::new(Duration::from_secs(1));
    emu.set_availability(Availability::Unavailable);
    assert!(
        strays
            .read(&emu.client(), timeout, std::slice::from_ref(&t), &[])
            .await
            .is_empty()
    );
    emu.set_availability(Availability::Up);
    // Within the interval: not read.
    assert!(
        strays
            .read(&emu.client(), timeout, std::slice::from_ref(&t), &[])
            .await
            .is_empty()
    );
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let read = strays.read(&emu.client(), timeout, std::slice::from_ref(&t), &[]).await;
    assert!(read.len() == 1 && read[0].spec.cancel_requested, "{read:?}");
}

/// A deletion requested (finalizer holds it): the read brings the deletionTimestamp.
#[tokio::test]
async fn strays_held_a_requested_deletion_reaches_the_task() {
    let emu = emulator().await;
    let mb = create_build_in(&emu, "ci", "b", &[]).await;
    merge(&emu, "ci", "b", json!({"metadata": {"finalizers": [FINALIZER]}})).await;
    builds_in(&emu, "ci")
        .delete("b", &DeleteParams::default())
        .await
        .unwrap();
    let t = bref("ci", "b", &uid(&mb));
    let mut strays = StrayReads::new(Duration::from_secs(60));
    let read = strays.read(&emu.client(), Duration::from_secs(2), &[t], &[]).await;
    assert!(
        read.len() == 1 && read[0].metadata.deletion_timestamp.is_some(),
        "{read:?}"
    );
}

/// Deleted (finalizer stripped) and recreated under the same name: the new object is not
/// returned for the old task, nor the old one for a task of the new uid... the new one is.
#[tokio::test]
async fn strays_held_a_build_deleted_and_recreated_under_its_name_is_not_confused() {
    let emu = emulator().await;
    let old = create_build_in(&emu, "ci", "b", &[]).await;
    builds_in(&emu, "ci")
        .delete("b", &DeleteParams::default())
        .await
        .unwrap();
    let new = create_build_in(&emu, "ci", "b", &[]).await;
    assert_ne!(uid(&old), uid(&new));
    let mut strays = StrayReads::new(Duration::from_secs(60));
    let read = strays
        .read(
            &emu.client(),
            Duration::from_secs(2),
            &[bref("ci", "b", &uid(&old)), bref("ci", "b", &uid(&new))],
            &[],
        )
        .await;
    let uids: Vec<String> = read.iter().map(|mb| uid(mb)).collect();
    assert_eq!(uids, vec![uid(&new)]);
    // A view holding the new object does not hide the old task's read (compared by uid).
    let view = vec![Arc::new(new.clone())];
    let mut strays = StrayReads::new(Duration::from_secs(60));
    let read = strays
        .read(
            &emu.client(),
            Duration::from_secs(2),
            &[bref("ci", "b", &uid(&old))],
            &view,
        )
        .await;
    assert!(read.is_empty(), "old is gone, new is not it: {read:?}");
}
