//! `spec.mounts` and the agent's network setting against real `tart-double` processes: the VM is
//! started with `--dir` and `--net-softnet[-allow]` as tart-double records them, and a mount the
//! agent does not declare fails the build before anything is cloned.

mod host_common;

use host_common::*;
use std::time::Duration;
use tart_double::run_flags::runs_of;
use tartan_agent::config::MountConfig;
use tartan_agent::host::{AttemptExecutor, cancel_pair, drive};
use tartan_agent::machine::Config;
use tartan_api::crd::MountRequest;
use tartan_api::{AttemptState as S, Outcome, Reason};

const LIMIT: Duration = Duration::from_secs(90);

fn asked(names: &[&str]) -> Vec<MountRequest> {
    names.iter().map(|n| MountRequest { name: n.to_string() }).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declared_mounts_and_softnet_reach_tart_run() {
    let rig = Rig::new();
    let caches = tempfile::tempdir().unwrap();
    let (spm, seed) = (caches.path().join("spm"), caches.path().join("seed"));
    std::fs::create_dir_all(&spm).unwrap();
    std::fs::create_dir_all(&seed).unwrap();
    let mut spec = spec(vec![step("build", "echo built")]);
    spec.mounts = asked(&["spm", "seed"]);
    let (_cancel, signal) = cancel_pair();
    let (mut a, plain) = attempt(&rig, "mounts", spec, signal.clone());
    let mut cfg = rig.config();
    cfg.mounts = vec![
        MountConfig {
            name: "spm".into(),
            host_path: spm.clone(),
            read_only: false,
        },
        MountConfig {
            name: "seed".into(),
            host_path: seed.clone(),
            read_only: true,
        },
        MountConfig {
            name: "unused".into(),
            host_path: seed.clone(),
            read_only: false,
        },
    ];
    cfg.network = tartan_tart::RunNetwork::Softnet {
        allow: vec!["10.0.0.0/8".parse().unwrap()],
    };
    let mut exec = AttemptExecutor::new(plain.attempt().clone(), rig.tart.clone(), cfg, signal);
    let mut journal = MemJournal::new();
    let end = tokio::time::timeout(
        LIMIT,
        drive(&mut exec, &mut a, admit(600), &Config::default(), &mut journal),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(end, S::Retired);
    assert_eq!(a.outcome, Some(Outcome::Succeeded), "{:?}", journal.lines());
    let runs = runs_of(rig.home.path(), &a.vm);
    assert_eq!(runs.len(), 1, "{runs:?}");
    let dirs: Vec<(String, String, bool)> = runs[0]["dir"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            (
                d["name"].as_str().unwrap().to_string(),
                d["path"].as_str().unwrap().to_string(),
                d["read_only"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        dirs,
        [
            ("spm".to_string(), spm.display().to_string(), false),
            ("seed".to_string(), seed.display().to_string(), true)
        ]
    );
    assert_eq!(runs[0]["net_softnet"], true);
    assert_eq!(runs[0]["net_softnet_allow"], "10.0.0.0/8");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undeclared_mount_fails_the_build_before_anything_is_cloned() {
    let rig = Rig::new();
    let mut spec = spec(vec![step("build", "echo built")]);
    spec.mounts = asked(&["pods"]);
    let (_cancel, signal) = cancel_pair();
    let (mut a, mut exec) = attempt(&rig, "undeclared", spec, signal);
    let mut journal = MemJournal::new();
    let end = tokio::time::timeout(
        LIMIT,
        drive(&mut exec, &mut a, admit(600), &Config::default(), &mut journal),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(end, S::Retired);
    assert_eq!(journal.states(), vec![S::Admitted, S::Retiring, S::Retired]);
    let refused = journal.records.lock().unwrap()[1].clone();
    assert_eq!(
        (refused.reason, refused.outcome),
        (Some(Reason::MountNotDeclared), Some(Outcome::Failed))
    );
    assert_eq!(
        refused.detail,
        "mount \"pods\" is not declared by this agent's config ([[mounts]]: it declares none); nothing was cloned"
    );
    assert!(rig.vms().is_empty(), "nothing was cloned");
    assert!(runs_of(rig.home.path(), &a.vm).is_empty(), "tart run never ran");
    // Its retirement (the VMDeleted condition's message) says there was no VM.
    let retired = journal.records.lock().unwrap()[2].clone();
    assert_eq!(retired.detail, "no VM was cloned for attempt 1: nothing to delete");
}
