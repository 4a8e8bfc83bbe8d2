//! Test support for the agent's cluster code on the emulator: a namespace `ci` with the MacBuild
//! CRD, MacBuilds in it, and claims won through the agent's own claim path.

#![allow(dead_code)] // each test binary uses a different part of this module

use k8s_openapi::api::core::v1::Namespace;
use kube::CustomResourceExt;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use std::collections::BTreeMap;
use std::time::Duration;
use tartan_agent::cluster::claim::{self, ClaimOutcome};
use tartan_agent::record::BuildRef;
use tartan_api::{Claim, MacBuild, MacBuildSpec, MacBuildStatus, Phase, Step};
use tartan_testkit::{EmulatorHandle, Options};

pub const API_TIMEOUT: Duration = Duration::from_secs(2);

/// An emulator with the MacBuild CRD and the namespaces `ci` and `other` (for tests of what one
/// namespace must not see of another).
pub async fn emulator() -> EmulatorHandle {
    let emu = tartan_testkit::start(Options::default())
        .await
        .expect("emulator starts");
    emu.install_crd(serde_json::to_value(MacBuild::crd()).unwrap())
        .expect("MacBuild CRD installs");
    let namespaces: Api<Namespace> = Api::all(emu.client());
    for name in ["ci", "other"] {
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            ..Default::default()
        };
        namespaces
            .create(&PostParams::default(), &ns)
            .await
            .unwrap_or_else(|e| panic!("namespace {name}: {e}"));
    }
    emu
}

pub async fn create_build(emu: &EmulatorHandle, name: &str) -> MacBuild {
    create_build_in(emu, "ci", name, &[]).await
}

/// A MacBuild `name` in namespace `ns` with these labels: one step, 600 s, for hosts labelled
/// `xcode=16`.
pub async fn create_build_in(emu: &EmulatorHandle, ns: &str, name: &str, labels: &[(&str, &str)]) -> MacBuild {
    let mut mb = MacBuild::new(
        name,
        MacBuildSpec {
            timeout_seconds: 600,
            host_selector: BTreeMap::from([("xcode".to_string(), "16".to_string())]),
            ..MacBuildSpec::new(
                "ghcr.io/cirruslabs/macos-sequoia-xcode:16",
                vec![Step {
                    name: "build".into(),
                    run: vec!["true".into()],
                    timeout_seconds: None,
                }],
            )
        },
    );
    mb.metadata.namespace = Some(ns.into());
    if !labels.is_empty() {
        mb.metadata.labels = Some(labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
    }
    builds_in(emu, ns)
        .create(&PostParams::default(), &mb)
        .await
        .expect("MacBuild created")
}

pub fn builds(emu: &EmulatorHandle) -> Api<MacBuild> {
    builds_in(emu, "ci")
}

pub fn builds_in(emu: &EmulatorHandle, ns: &str) -> Api<MacBuild> {
    Api::namespaced(emu.client(), ns)
}

/// Merge-patches MacBuild `ns/name` (metadata or spec).
pub async fn merge(emu: &EmulatorHandle, ns: &str, name: &str, patch: serde_json::Value) {
    builds_in(emu, ns)
        .patch(name, &PatchParams::default(), &Patch::Merge(patch))
        .await
        .expect("MacBuild patched");
}

pub async fn get(emu: &EmulatorHandle, name: &str) -> MacBuild {
    builds(emu).get(name).await.expect("MacBuild readable")
}

pub fn build_ref(mb: &MacBuild) -> BuildRef {
    BuildRef {
        namespace: mb.metadata.namespace.clone().unwrap(),
        name: mb.metadata.name.clone().unwrap(),
        uid: mb.metadata.uid.clone().unwrap(),
    }
}

pub fn claimed_status(claim: &Claim, phase: Phase, message: &str) -> MacBuildStatus {
    MacBuildStatus {
        phase: Some(phase),
        claim: Some(claim.clone()),
        message: Some(message.into()),
        ..Default::default()
    }
}

pub async fn won(emu: &EmulatorHandle, mb: &MacBuild, agent: &str, attempt: u32) -> (Claim, MacBuild) {
    match claim::claim(&emu.client(), API_TIMEOUT, mb, agent, attempt)
        .await
        .unwrap()
    {
        ClaimOutcome::Won { claim, macbuild } => (claim, *macbuild),
        ClaimOutcome::Lost { reason } => panic!("claim lost: {reason}"),
    }
}
