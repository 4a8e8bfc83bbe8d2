//! Shared helpers for the emulator's integration tests.
#![allow(dead_code)]

use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::core::Status;
use serde_json::{Value, json};
use tartan_testkit::{EmulatorHandle, Options};

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// An emulator with the test MacBuild CRD and Tekton's CustomRun CRD installed.
pub async fn emulator() -> EmulatorHandle {
    emulator_with(Options::default()).await
}

pub async fn emulator_with(options: Options) -> EmulatorHandle {
    tartan_testkit::start(
        options
            .crd_file(fixture("macbuild-crd.yaml"))
            .crd_file(tartan_testkit::customrun_crd()),
    )
    .await
    .expect("emulator starts")
}

pub fn macbuild_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("tartan.dev", "v1alpha1", "MacBuild"),
        "macbuilds",
    )
}

pub fn customrun_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("tekton.dev", "v1beta1", "CustomRun"),
        "customruns",
    )
}

pub fn macbuilds(client: &kube::Client, ns: &str) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), ns, &macbuild_resource())
}

pub fn customruns(client: &kube::Client, ns: &str) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), ns, &customrun_resource())
}

pub fn macbuild(name: &str, spec: Value) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "tartan.dev/v1alpha1",
        "kind": "MacBuild",
        "metadata": {"name": name},
        "spec": spec,
    }))
    .expect("valid MacBuild")
}

/// The apiserver `Status` of a failed call.
pub fn status_of<T: std::fmt::Debug>(r: Result<T, kube::Error>) -> Status {
    match r {
        Err(kube::Error::Api(s)) => *s,
        other => panic!("expected an API error, got {other:?}"),
    }
}

pub fn json_of<T: serde::Serialize>(v: &T) -> Value {
    serde_json::to_value(v).expect("serializable")
}

/// Polls `check` until it yields `Some`, failing after `secs` seconds.
pub async fn eventually<T, F, Fut>(secs: u64, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
