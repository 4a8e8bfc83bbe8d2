//! The controller end to end against the testkit's Kubernetes API emulator (real HTTP, real
//! kube `Controller`): test code plays Tekton (creates/patches CustomRuns) and the agent (writes
//! MacBuild status and its Lease).

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Client, CustomResourceExt as _};
use serde_json::{Value, json};
use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;
use tartan_api::{FINISHED_LABEL, MacBuild};
use tartan_controller::customrun::{CustomRun, CustomRunStatus};
use tartan_controller::run::RunArgs;
use tartan_testkit::{EmulatorHandle, Options};

const NS: &str = "default";

struct Harness {
    emu: EmulatorHandle,
    client: Client,
    _dir: tempfile::TempDir,
    kubeconfig: PathBuf,
    controllers: Vec<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl Drop for Harness {
    fn drop(&mut self) {
        for c in &self.controllers {
            c.abort();
        }
    }
}

async fn harness() -> Harness {
    let tekton = tartan_testkit::customrun_crd();
    let emu = tartan_testkit::start(Options::default().crd_file(tekton))
        .await
        .expect("emulator starts");
    emu.install_crd(serde_json::to_value(MacBuild::crd()).unwrap())
        .expect("MacBuild CRD installs");
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    emu.write_kubeconfig(&kubeconfig).unwrap();
    let client = emu.client();
    Harness {
        emu,
        client,
        _dir: dir,
        kubeconfig,
        controllers: vec![],
    }
}

impl Harness {
    fn args(&self) -> RunArgs {
        RunArgs {
            kubeconfig: Some(self.kubeconfig.clone()),
            namespaces: vec![NS.into()],
            default_timeout: Duration::from_secs(3600),
            grace: Duration::from_secs(2),
            lease_duration: Duration::from_secs(20),
            finished_label_after: Duration::ZERO,
            agent_lease_namespace: None,
            api_timeout: Duration::from_secs(5),
            metrics_address: "127.0.0.1:0".parse().unwrap(),
            http_max_connections: tartan_serve::DEFAULT_MAX_CONNECTIONS,
            http_idle_timeout: tartan_serve::DEFAULT_IDLE_TIMEOUT,
            instance: "test".into(),
            leader_elect: false,
            leader_lease_namespace: None,
            leader_lease_name: "tartan-controller".into(),
            leader_identity: None,
            leader_lease: Duration::from_secs(15),
            leader_renew_every: Duration::from_secs(5),
            leader_retry_every: Duration::from_secs(2),
            leader_margin: Duration::from_secs(5),
            concurrency: 16,
        }
    }

    fn start_controller(&mut self) {
        let args = self.args();
        self.controllers.push(tokio::spawn(tartan_controller::run::run(args)));
    }

    fn runs(&self) -> Api<CustomRun> {
        Api::namespaced(self.client.clone(), NS)
    }

    fn builds(&self) -> Api<MacBuild> {
        Api::namespaced(self.client.clone(), NS)
    }

    async fn create_run(&self, name: &str, extra_spec: Value) -> CustomRun {
        let mut spec = json!({
            "customRef": {"apiVersion": "tartan.dev/v1alpha1", "kind": "MacBuild"},
            "params": [
                {"name": "image", "value": "ghcr.io/cirruslabs/macos-sequoia-xcode:16"},
                {"name": "steps", "value": ["xcodebuild build", "xcodebuild test"]},
            ],
            "serviceAccountName": "default",
        });
        for (k, v) in extra_spec.as_object().unwrap() {
            spec[k] = v.clone();
        }
        let run: CustomRun = serde_json::from_value(json!({
            "apiVersion": "tekton.dev/v1beta1", "kind": "CustomRun",
            "metadata": {"name": name, "labels": {"tekton.dev/pipelineRun": "build-42", "tekton.dev/pipelineTask": "mac-build"}},
            "spec": spec,
        }))
        .unwrap();
        self.runs()
            .create(&PostParams::default(), &run)
            .await
            .expect("CustomRun created")
    }

    /// The simulated agent: claim (status) and a finalizer, as the real agent does.
    async fn agent_writes(&self, name: &str, status: Value) {
        self.builds()
            .patch_status(name, &PatchParams::default(), &Patch::Merge(json!({"status": status})))
            .await
            .expect("agent status write");
    }

    async fn renew_lease(&self, agent: &str, renewed: Timestamp) {
        let leases: Api<Lease> = Api::namespaced(self.client.clone(), NS);
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(format!("tartan-agent-{agent}")),
                labels: Some([("tartan.dev/agent".to_string(), agent.to_string())].into()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(agent.into()),
                lease_duration_seconds: Some(20),
                renew_time: Some(MicroTime(renewed)),
                ..Default::default()
            }),
        };
        let spec = serde_json::to_value(&lease.spec).unwrap();
        match leases.get_opt(&format!("tartan-agent-{agent}")).await.unwrap() {
            None => {
                leases
                    .create(&PostParams::default(), &lease)
                    .await
                    .expect("lease created");
            }
            Some(_) => {
                leases
                    .patch(
                        &format!("tartan-agent-{agent}"),
                        &PatchParams::default(),
                        &Patch::Merge(json!({"spec": spec})),
                    )
                    .await
                    .expect("lease renewed");
            }
        }
    }

    async fn status(&self, name: &str) -> Option<CustomRunStatus> {
        self.runs().get(name).await.unwrap().status
    }
}

async fn eventually<T, F, Fut>(what: &str, probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    eventually_within(Duration::from_secs(20), what, probe).await
}

async fn eventually_within<T, F, Fut>(limit: Duration, what: &str, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn succeeded(s: &CustomRunStatus) -> (String, String) {
    let c = &s.conditions[0];
    assert_eq!(c.type_, "Succeeded");
    (c.status.clone(), c.reason.clone().unwrap_or_default())
}

async fn wait_reason(h: &Harness, name: &str, status: &str, reason: &str) -> CustomRunStatus {
    eventually(&format!("{name} {status}/{reason}"), || async {
        h.status(name)
            .await
            .filter(|s| !s.conditions.is_empty() && succeeded(s) == (status.into(), reason.into()))
    })
    .await
}

fn result(s: &CustomRunStatus, name: &str) -> String {
    s.results
        .iter()
        .find(|r| r.name == name)
        .map(|r| r.value.clone())
        .unwrap_or_else(|| panic!("no result {name}"))
}

/// Waits until the CustomRun `name` and its MacBuild carry the finished label (with the
/// harness's `finished_label_after` of 0).
async fn wait_marked_finished(h: &Harness, name: &str) {
    wait_marked_finished_within(h, name, Duration::from_secs(20)).await
}

async fn wait_marked_finished_within(h: &Harness, name: &str, limit: Duration) {
    eventually_within(limit, &format!("{name} and its MacBuild labelled finished"), || async {
        let run = h.runs().get(name).await.unwrap();
        let mb = h.builds().get_opt(name).await.unwrap();
        let marked = |labels: Option<&std::collections::BTreeMap<String, String>>| {
            labels.is_some_and(|l| l.get(FINISHED_LABEL).map(String::as_str) == Some("true"))
        };
        (marked(run.metadata.labels.as_ref()) && mb.is_none_or(|mb| marked(mb.metadata.labels.as_ref()))).then_some(())
    })
    .await;
}

fn vm_deleted(status: &str) -> Value {
    json!({"type": "VMDeleted", "status": status, "reason": if status == "True" { "VMDeleted" } else { "Running" },
           "message": "", "lastTransitionTime": "2026-10-05T02:55:00Z"})
}

fn claim() -> Value {
    json!({"holder": "agent-a", "attempt": "run#1", "epoch": 1})
}

#[tokio::test]
async fn customrun_becomes_an_owned_macbuild_and_succeeds_only_after_vm_deleted() {
    let mut h = harness().await;
    h.start_controller();
    let run = h.create_run("run", json!({"timeout": "30m0s"})).await;

    let mb = eventually("MacBuild", || async { h.builds().get_opt("run").await.unwrap() }).await;
    let owner = &mb.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.uid.as_str(), owner.controller),
        ("CustomRun", run.metadata.uid.as_deref().unwrap(), Some(true))
    );
    let labels = mb.metadata.labels.as_ref().unwrap();
    assert_eq!(labels["tekton.dev/customRun"], "run");
    assert_eq!(labels["tekton.dev/pipelineRun"], "build-42");
    assert_eq!(mb.spec.timeout_seconds, 1800);
    assert_eq!(mb.spec.steps[1].run, vec!["/bin/sh", "-c", "xcodebuild test"]);
    let st = wait_reason(&h, "run", "Unknown", "Pending").await;
    assert!(st.start_time.is_some());

    h.renew_lease("agent-a", Timestamp::now()).await;
    h.agent_writes(
        "run",
        json!({"phase": "Running", "claim": claim(), "conditions": [vm_deleted("False")]}),
    )
    .await;
    let st = wait_reason(&h, "run", "Unknown", "Running").await;
    assert_eq!(st.extra_fields.as_ref().unwrap()["holder"], "agent-a");

    // Outcome fixed, VM not yet deleted: still Unknown.
    h.agent_writes(
        "run",
        json!({"phase": "Retiring", "outcome": "Succeeded",
               "results": {"testsPassed": 2, "testsTotal": 2, "artifactUrl": "s3://ci-artifacts/app/App.ipa"}}),
    )
    .await;
    wait_reason(&h, "run", "Unknown", "DeletingVM").await;

    h.agent_writes(
        "run",
        json!({"phase": "Succeeded", "conditions": [vm_deleted("True"),
            {"type": "Succeeded", "status": "True", "reason": "TestsPassed", "message": "2/2 tests passed", "lastTransitionTime": "2026-10-05T02:55:00Z"}]}),
    )
    .await;
    let st = wait_reason(&h, "run", "True", "TestsPassed").await;
    assert_eq!(result(&st, "attempt"), "run#1");
    assert_eq!(result(&st, "testsPassed"), "2");
    assert_eq!(result(&st, "testsTotal"), "2");
    assert_eq!(result(&st, "artifact"), "s3://ci-artifacts/app/App.ipa");
    assert_eq!(result(&st, "vmRetirement"), "deleted");
    assert!(st.completion_time.is_some());

    // Finished with nothing owed: the run and its MacBuild are labelled out of the watches.
    wait_marked_finished(&h, "run").await;
    // A cancel patch on the finished run changes nothing: the controller no longer watches it.
    let from = h.emu.requests().len();
    h.runs()
        .patch(
            "run",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"status": "RunCancelled"}})),
        )
        .await
        .unwrap();
    h.create_run("later", json!({})).await;
    wait_reason(&h, "later", "Unknown", "Pending").await;
    let after = h.status("run").await.unwrap();
    assert_eq!(succeeded(&after), ("True".into(), "TestsPassed".into()));
    assert_eq!(after.results, st.results);
    assert!(!h.builds().get("run").await.unwrap().spec.cancel_requested);
    let about_run: Vec<String> = h.emu.requests()[from..]
        .iter()
        .filter(|r| r.contains("ua=tartan-controller"))
        .filter(|r| ["/run ", "/run?", "/run/"].iter().any(|p| r.contains(p)))
        .cloned()
        .collect();
    assert!(about_run.is_empty(), "requests about the finished run: {about_run:#?}");

    // The transitions' Events, published apart from the reconciles, reach the API.
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(h.client.clone(), NS);
    eventually("the CustomRun's Events", || async {
        let mut reasons: Vec<String> = events
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("run"))
            .filter_map(|e| e.reason)
            .collect();
        reasons.sort();
        reasons.dedup();
        let want = ["MacBuildCreated", "TestsPassed"];
        want.iter().all(|w| reasons.iter().any(|r| r == w)).then_some(())
    })
    .await;
}

#[tokio::test]
async fn retries_are_refused_without_a_macbuild() {
    let mut h = harness().await;
    h.start_controller();
    h.create_run("retry", json!({"retries": 2})).await;
    let st = wait_reason(&h, "retry", "False", "RetriesNotSupported").await;
    assert!(
        st.conditions[0]
            .message
            .as_deref()
            .unwrap()
            .contains("retries belong to the Tartan agent")
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(h.builds().get_opt("retry").await.unwrap().is_none());
    // Other custom tasks are left alone.
    let other: CustomRun = serde_json::from_value(json!({
        "apiVersion": "tekton.dev/v1beta1", "kind": "CustomRun", "metadata": {"name": "wait"},
        "spec": {"customRef": {"apiVersion": "wait.testing.tekton.dev/v1beta1", "kind": "Wait"}, "serviceAccountName": "default"},
    }))
    .unwrap();
    h.runs().create(&PostParams::default(), &other).await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(h.status("wait").await.is_none_or(|s| s.conditions.is_empty()));
}

#[tokio::test]
async fn cancellation_reaches_the_agent_and_ends_once_the_vm_is_gone() {
    let mut h = harness().await;
    h.start_controller();
    h.create_run("cancel", json!({})).await;
    eventually("MacBuild", || async { h.builds().get_opt("cancel").await.unwrap() }).await;
    h.renew_lease("agent-a", Timestamp::now()).await;
    h.agent_writes(
        "cancel",
        json!({"phase": "Booting", "claim": claim(), "conditions": [vm_deleted("False")]}),
    )
    .await;
    wait_reason(&h, "cancel", "Unknown", "BootingVM").await;

    h.runs()
        .patch(
            "cancel",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"status": "RunCancelled",
                "statusMessage": "CustomRun cancelled as the PipelineRun it belongs to has been cancelled."}})),
        )
        .await
        .unwrap();
    eventually("cancelRequested", || async {
        h.builds()
            .get("cancel")
            .await
            .unwrap()
            .spec
            .cancel_requested
            .then_some(())
    })
    .await;
    wait_reason(&h, "cancel", "Unknown", "Cancelling").await;
    h.agent_writes(
        "cancel",
        json!({"phase": "Cancelled", "outcome": "Cancelled", "conditions": [vm_deleted("True")]}),
    )
    .await;
    let st = wait_reason(&h, "cancel", "False", "CustomRunCancelled").await;
    assert_eq!(result(&st, "vmRetirement"), "deleted");
    // spec.status is Tekton's: never written by us.
    let run = h.runs().get("cancel").await.unwrap();
    assert_eq!(run.spec.status.as_deref(), Some("RunCancelled"));
}

#[tokio::test]
async fn timeout_with_an_expired_holder_lease_ends_unconfirmed_and_requests_deletion() {
    let mut h = harness().await;
    h.start_controller();
    h.create_run("slow", json!({"timeout": "3s"})).await;
    eventually("MacBuild", || async { h.builds().get_opt("slow").await.unwrap() }).await;
    // The agent claimed, added its finalizer, then stopped renewing long ago.
    let renewed = Timestamp::now() - SignedDuration::from_secs(60);
    h.renew_lease("agent-a", renewed).await;
    h.builds()
        .patch(
            "slow",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": ["tartan.dev/vm-cleanup"]}})),
        )
        .await
        .unwrap();
    h.agent_writes(
        "slow",
        json!({"phase": "Running", "claim": claim(), "conditions": [vm_deleted("False")]}),
    )
    .await;
    let st = eventually("HostUnreachable", || async {
        h.status("slow").await.filter(|s| {
            s.conditions
                .iter()
                .any(|c| c.type_ == "HostUnreachable" && c.status == "True")
        })
    })
    .await;
    assert_eq!(st.conditions[0].type_, "Succeeded");
    assert_eq!(st.conditions[0].status, "Unknown");

    let st = wait_reason(&h, "slow", "False", "CustomRunTimedOut").await;
    let renewed_text = renewed.strftime("%Y-%m-%dT%H:%M:%SZ").to_string();
    assert_eq!(
        st.conditions[0].message.as_deref().unwrap(),
        format!(
            "MacBuild did not finish within timeout 3s + 2s grace; VM retirement unconfirmed: agent agent-a lease expired \
             (last renewed {renewed_text}); the MacBuild is kept until the agent returns"
        )
    );
    assert_eq!(result(&st, "vmRetirement"), "unconfirmed");
    let mb = h.builds().get("slow").await.unwrap();
    assert!(
        mb.metadata.deletion_timestamp.is_some(),
        "deletion requested, held by the agent's finalizer"
    );
    assert!(mb.spec.cancel_requested);

    // Labelled finished while the agent still holds its VM: the MacBuild leaves the controller's
    // watch, and the agent's return (cleanup confirmed, finalizer released) is the agent's
    // business alone: the run's terminal status, said once, stays as it is.
    wait_marked_finished(&h, "slow").await;
    let from = h.emu.requests().len();
    h.agent_writes(
        "slow",
        json!({"phase": "Cancelled", "outcome": "Cancelled", "conditions": [vm_deleted("True")]}),
    )
    .await;
    h.builds()
        .patch(
            "slow",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await
        .unwrap();
    eventually("the MacBuild gone", || async {
        h.builds().get_opt("slow").await.unwrap().is_none().then_some(())
    })
    .await;
    h.create_run("after-slow", json!({})).await;
    wait_reason(&h, "after-slow", "Unknown", "Pending").await;
    assert_eq!(h.status("slow").await.unwrap(), st);
    let about_slow: Vec<String> = h.emu.requests()[from..]
        .iter()
        .filter(|r| r.contains("ua=tartan-controller") && r.contains("/slow"))
        .cloned()
        .collect();
    assert!(about_slow.is_empty(), "{about_slow:#?}");
}

#[tokio::test]
async fn two_controller_instances_create_one_macbuild() {
    let mut h = harness().await;
    h.start_controller();
    h.start_controller();
    for i in 0..3 {
        h.create_run(&format!("twin-{i}"), json!({})).await;
    }
    for i in 0..3 {
        wait_reason(&h, &format!("twin-{i}"), "Unknown", "Pending").await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let all = h.builds().list(&Default::default()).await.unwrap();
    assert_eq!(all.items.len(), 3, "one MacBuild per CustomRun");
    let creates = h
        .emu
        .requests()
        .iter()
        .filter(|r| r.starts_with("POST") && r.contains("/macbuilds"))
        .count();
    assert!(creates >= 3, "{creates}");
    for c in &h.controllers {
        assert!(!c.is_finished(), "both controllers still running");
    }
}

/// A restarted controller sends no request about CustomRuns that are finished and say so:
/// it used to read each one's CustomRun, MacBuild and Lease afresh (issue 16: 3,500-4,000 GETs
/// of each kind for 1,000 finished runs).
#[tokio::test]
async fn a_restart_makes_no_request_for_finished_customruns() {
    let mut h = harness().await;
    // The label's delay on its default (30 s), counted from each run's completion.
    let mut args = h.args();
    args.finished_label_after = tartan_controller::decide::Timing::default().finished_label_after;
    h.controllers.push(tokio::spawn(tartan_controller::run::run(args)));
    h.renew_lease("agent-a", Timestamp::now()).await;
    let names = ["done-a", "done-b", "done-c"];
    for name in names {
        h.create_run(name, json!({})).await;
        eventually("MacBuild", || async { h.builds().get_opt(name).await.unwrap() }).await;
        h.agent_writes(
            name,
            json!({"phase": "Succeeded", "claim": {"holder": "agent-a", "attempt": format!("{name}#1"), "epoch": 1},
                   "conditions": [vm_deleted("True"), {"type": "Succeeded", "status": "True", "reason": "TestsPassed",
                   "message": "", "lastTransitionTime": "2026-10-05T02:55:00Z"}]}),
        )
        .await;
        wait_reason(&h, name, "True", "TestsPassed").await;
    }
    let finished = tokio::time::Instant::now();
    let run = h.runs().get(names[0]).await.unwrap();
    assert!(
        !run.metadata.labels.unwrap().contains_key(FINISHED_LABEL),
        "labelled before its delay"
    );
    for name in names {
        wait_marked_finished_within(&h, name, Duration::from_secs(45)).await;
    }
    assert!(
        finished.elapsed() >= Duration::from_secs(25),
        "labelled {:?} after the last finished",
        finished.elapsed()
    );
    for c in h.controllers.drain(..) {
        c.abort();
        let _ = c.await;
    }
    let from = h.emu.requests().len();
    // One reconcile at a time: the finished runs, queued at the first list, are all handled
    // before a CustomRun created after that list.
    let mut args = h.args();
    args.concurrency = 1;
    h.controllers.push(tokio::spawn(tartan_controller::run::run(args)));
    eventually("the restarted controller's CustomRun watch", || async {
        h.emu.requests()[from..]
            .iter()
            .any(|r| r.starts_with("GET") && r.contains("/customruns?") && r.contains("watch=true"))
            .then_some(())
    })
    .await;
    h.create_run("probe", json!({})).await;
    wait_reason(&h, "probe", "Unknown", "Pending").await;
    let log = h.emu.requests();
    // Its lists and watches of CustomRuns and MacBuilds leave the finished ones out.
    let unselected: Vec<&String> = log[from..]
        .iter()
        .filter(|r| r.starts_with("GET") && (r.contains("/customruns?") || r.contains("/macbuilds?")))
        .filter(|r| !r.contains("labelSelector=%21tartan.dev%2Ffinished"))
        // (but the start-up check that the CRDs are served)
        .filter(|r| r.contains("ua=tartan-controller") && !r.contains("?&limit=1 "))
        .collect();
    assert!(unselected.is_empty(), "lists or watches of everything: {unselected:#?}");
    let about_finished: Vec<&String> = log[from..]
        .iter()
        .filter(|r| r.contains("/leases/") || names.iter().any(|n| r.contains(&format!("/{n}"))))
        .collect();
    assert!(
        about_finished.is_empty(),
        "requests about finished runs: {about_finished:#?}"
    );
    // And the probe cost what a new run costs: a MacBuild created and a status written, no reads.
    let probe: Vec<&String> = log[from..].iter().filter(|r| r.contains("/probe")).collect();
    assert!(
        !probe.iter().any(|r| r.starts_with("GET /apis/tartan.dev")),
        "the MacBuild is read from the watch: {probe:#?}"
    );
}

#[tokio::test]
async fn missing_macbuild_crd_fails_fast_with_the_fix() {
    let tekton = tartan_testkit::customrun_crd();
    let emu = tartan_testkit::start(Options::default().crd_file(tekton))
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    emu.write_kubeconfig(&kubeconfig).unwrap();
    let h = Harness {
        emu,
        client: emu_client_placeholder(),
        _dir: dir,
        kubeconfig,
        controllers: vec![],
    };
    let err = tokio::time::timeout(Duration::from_secs(10), tartan_controller::run::run(h.args()))
        .await
        .expect("fails fast")
        .unwrap_err();
    let text = format!("{err:#}");
    assert!(text.contains("tartan-controller crd | kubectl apply -f -"), "{text}");
}

fn emu_client_placeholder() -> Client {
    // Not used by this test; the harness only needs one for its fields.
    Client::try_from(kube::Config::new("http://127.0.0.1:1".parse().unwrap())).unwrap()
}

/// A merge patch that ends a run as TestsPassed (completed 02:55:00Z, long past its label delay).
fn finished_status() -> serde_json::Value {
    json!({"status": {"conditions": [{"type": "Succeeded", "status": "True", "reason": "TestsPassed",
        "message": "", "lastTransitionTime": "2026-10-05T02:55:00Z"}],
        "completionTime": "2026-10-05T02:55:00Z", "startTime": "2026-10-05T02:50:00Z"}})
}

/// Runs finished before the label existed (an upgrade) are labelled on the first start, their
/// own MacBuild with them; a same-named MacBuild that is not the run's is left alone.
#[tokio::test]
async fn finished_runs_without_the_label_are_labelled_once_with_their_own_macbuild() {
    let mut h = harness().await;
    let done = finished_status();
    let mut owners = vec![];
    for name in ["old-owned", "old-foreign"] {
        let run = h.create_run(name, json!({})).await;
        h.runs()
            .patch_status(name, &PatchParams::default(), &Patch::Merge(done.clone()))
            .await
            .unwrap();
        owners.push(run);
    }
    // A bare CustomRun with no labels at all: the patch must create the map.
    let bare: CustomRun = serde_json::from_value(json!({
        "apiVersion": "tekton.dev/v1beta1", "kind": "CustomRun", "metadata": {"name": "old-bare"},
        "spec": {"customRef": {"apiVersion": "tartan.dev/v1alpha1", "kind": "MacBuild"}},
    }))
    .unwrap();
    h.runs().create(&PostParams::default(), &bare).await.unwrap();
    h.runs()
        .patch_status("old-bare", &PatchParams::default(), &Patch::Merge(done.clone()))
        .await
        .unwrap();
    let macbuild = |name: &str, owner: Option<&CustomRun>| -> MacBuild {
        let mut mb: MacBuild = serde_json::from_value(json!({
            "apiVersion": "tartan.dev/v1alpha1", "kind": "MacBuild",
            "metadata": {"name": name, "labels": {"tekton.dev/customRun": name}},
            "spec": {"image": "img", "steps": [{"name": "build", "run": ["true"]}]},
        }))
        .unwrap();
        if let Some(run) = owner {
            mb.metadata.owner_references = Some(vec![kube::Resource::controller_owner_ref(run, &()).unwrap()]);
        }
        mb
    };
    h.builds()
        .create(&PostParams::default(), &macbuild("old-owned", Some(&owners[0])))
        .await
        .unwrap();
    h.builds()
        .create(&PostParams::default(), &macbuild("old-foreign", None))
        .await
        .unwrap();

    h.start_controller();
    wait_marked_finished(&h, "old-owned").await;
    wait_marked_finished(&h, "old-bare").await;
    eventually("old-foreign labelled finished", || async {
        let run = h.runs().get("old-foreign").await.unwrap();
        run.metadata
            .labels
            .is_some_and(|l| l.contains_key(FINISHED_LABEL))
            .then_some(())
    })
    .await;
    let foreign = h.builds().get("old-foreign").await.unwrap();
    assert!(
        !foreign.metadata.labels.unwrap_or_default().contains_key(FINISHED_LABEL),
        "a MacBuild the run does not own is not the controller's to label"
    );
    // Nothing else changed: the statuses are as they were.
    for name in ["old-owned", "old-foreign", "old-bare"] {
        let st = h.status(name).await.unwrap();
        assert_eq!(succeeded(&st), ("True".into(), "TestsPassed".into()), "{name}");
    }
}

/// Many more runs due their finished label at once than there are labelling slots
/// (`LABELS_IN_FLIGHT`): those without a slot come back a few seconds later, and every one is
/// labelled, with its own MacBuild, and its status left as it was.
#[tokio::test]
async fn more_runs_due_their_label_than_slots_are_all_labelled() {
    let mut h = harness().await;
    let done = finished_status();
    let names: Vec<String> = (0..6 * tartan_controller::reconcile::LABELS_IN_FLIGHT)
        .map(|i| format!("due-{i}"))
        .collect();
    for name in &names {
        let run = h.create_run(name, json!({})).await;
        h.runs()
            .patch_status(name, &PatchParams::default(), &Patch::Merge(done.clone()))
            .await
            .unwrap();
        let mut mb: MacBuild = serde_json::from_value(json!({
            "apiVersion": "tartan.dev/v1alpha1", "kind": "MacBuild",
            "metadata": {"name": name, "labels": {"tekton.dev/customRun": name}},
            "spec": {"image": "img", "steps": [{"name": "build", "run": ["true"]}]},
        }))
        .unwrap();
        mb.metadata.owner_references = Some(vec![kube::Resource::controller_owner_ref(&run, &()).unwrap()]);
        h.builds().create(&PostParams::default(), &mb).await.unwrap();
    }
    h.start_controller();
    for name in &names {
        wait_marked_finished_within(&h, name, Duration::from_secs(40)).await;
    }
    for name in &names {
        let st = h.status(name).await.unwrap();
        assert_eq!(succeeded(&st), ("True".into(), "TestsPassed".into()), "{name}");
    }
}

/// A finished run deleted and created again under its name while the controller's watches lag:
/// the label meant for the old run (fenced on its uid) must not hide the new one, which is run
/// as any other once the watches catch up.
#[tokio::test]
async fn a_run_created_again_under_a_finished_runs_name_is_never_hidden() {
    let mut h = harness().await;
    let mut args = h.args();
    args.finished_label_after = Duration::from_secs(4);
    h.controllers.push(tokio::spawn(tartan_controller::run::run(args)));
    h.renew_lease("agent-a", Timestamp::now()).await;
    let old = h.create_run("again", json!({})).await;
    eventually("MacBuild", || async { h.builds().get_opt("again").await.unwrap() }).await;
    h.agent_writes(
        "again",
        json!({"phase": "Succeeded", "claim": claim(),
               "conditions": [vm_deleted("True"), {"type": "Succeeded", "status": "True", "reason": "TestsPassed",
               "message": "", "lastTransitionTime": "2026-10-05T02:55:00Z"}]}),
    )
    .await;
    wait_reason(&h, "again", "True", "TestsPassed").await;
    // The controller's caches stop here: it still sees the old run, due its label in 4 s.
    let mut faults = h.emu.faults();
    faults.watches_stalled = true;
    h.emu.set_faults(faults.clone());
    let from = h.emu.answers().len();
    h.runs().delete("again", &Default::default()).await.unwrap();
    eventually("the old MacBuild collected", || async {
        h.builds().get_opt("again").await.unwrap().is_none().then_some(())
    })
    .await;
    let new = h.create_run("again", json!({})).await;
    assert_ne!(new.metadata.uid, old.metadata.uid);
    // The label meant for the old run reaches the new one, and its uid test refuses it.
    eventually("the old run's label refused", || async {
        h.emu.answers()[from..]
            .iter()
            .any(|a| a.method == "PATCH" && a.uri.contains("/customruns/again") && a.code == 422)
            .then_some(())
    })
    .await;
    faults.watches_stalled = false;
    h.emu.set_faults(faults);
    let mb = eventually("the new run's MacBuild", || async {
        h.builds().get_opt("again").await.unwrap()
    })
    .await;
    assert_eq!(
        mb.metadata.owner_references.unwrap()[0].uid,
        new.metadata.uid.clone().unwrap()
    );
    wait_reason(&h, "again", "Unknown", "Pending").await;
    let run = h.runs().get("again").await.unwrap();
    assert!(
        !run.metadata.labels.unwrap_or_default().contains_key(FINISHED_LABEL),
        "the new, unfinished run was labelled finished"
    );
    // And it finishes and is labelled as any other.
    h.agent_writes(
        "again",
        json!({"phase": "Succeeded", "claim": {"holder": "agent-a", "attempt": "again#1", "epoch": 1},
               "conditions": [vm_deleted("True"), {"type": "Succeeded", "status": "True", "reason": "TestsPassed",
               "message": "", "lastTransitionTime": "2026-10-05T02:56:00Z"}]}),
    )
    .await;
    wait_reason(&h, "again", "True", "TestsPassed").await;
    wait_marked_finished_within(&h, "again", Duration::from_secs(30)).await;
}

/// The finished label removed by hand (from the run, then from its MacBuild): the run comes back
/// into the watch and is labelled again, with no status write and no Event; a MacBuild that
/// comes back alone is left as it is.
#[tokio::test]
async fn a_finished_label_removed_by_hand_is_put_back_with_nothing_else_written() {
    let mut h = harness().await;
    h.start_controller();
    h.renew_lease("agent-a", Timestamp::now()).await;
    h.create_run("unlabelled", json!({})).await;
    eventually("MacBuild", || async { h.builds().get_opt("unlabelled").await.unwrap() }).await;
    h.agent_writes(
        "unlabelled",
        json!({"phase": "Succeeded", "claim": claim(),
               "conditions": [vm_deleted("True"), {"type": "Succeeded", "status": "True", "reason": "TestsPassed",
               "message": "", "lastTransitionTime": "2026-10-05T02:55:00Z"}]}),
    )
    .await;
    let st = wait_reason(&h, "unlabelled", "True", "TestsPassed").await;
    wait_marked_finished(&h, "unlabelled").await;
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(h.client.clone(), NS);
    let about_run = || async {
        let mut reasons: Vec<String> = events
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("unlabelled"))
            .filter_map(|e| e.reason)
            .collect();
        reasons.sort();
        reasons
    };
    let published = eventually("the run's Events", || async {
        let r = about_run().await;
        r.iter().any(|x| x == "TestsPassed").then_some(r)
    })
    .await;

    let unlabel = Patch::Json::<()>(
        serde_json::from_value(json!([{"op": "remove", "path": "/metadata/labels/tartan.dev~1finished"}])).unwrap(),
    );
    // The run, with a cancel patched onto it meanwhile (its generation moves on: one status
    // write of observedGeneration, nothing else).
    let from = h.emu.requests().len();
    h.runs()
        .patch("unlabelled", &PatchParams::default(), &unlabel)
        .await
        .unwrap();
    h.runs()
        .patch(
            "unlabelled",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"status": "RunCancelled"}})),
        )
        .await
        .unwrap();
    wait_marked_finished(&h, "unlabelled").await;
    let after = h.status("unlabelled").await.unwrap();
    assert_eq!(succeeded(&after), ("True".into(), "TestsPassed".into()));
    assert_eq!(after.results, st.results);
    assert_eq!(after.completion_time, st.completion_time);
    assert!(!h.builds().get("unlabelled").await.unwrap().spec.cancel_requested);

    // The MacBuild alone: its run stays out of the watch, so nothing is owed and nothing written.
    h.builds()
        .patch("unlabelled", &PatchParams::default(), &unlabel)
        .await
        .unwrap();
    // A run created after that, handled, shows the controller has seen the MacBuild come back.
    h.create_run("after-unlabel", json!({})).await;
    wait_reason(&h, "after-unlabel", "Unknown", "Pending").await;
    let writes: Vec<String> = h.emu.requests()[from..]
        .iter()
        .filter(|r| r.contains("ua=tartan-controller") && !r.starts_with("GET"))
        .filter(|r| r.contains("/unlabelled"))
        .cloned()
        .collect();
    assert!(
        writes.iter().all(|w| w.starts_with("PATCH")
            && (w.contains("/customruns/unlabelled?") || w.contains("/customruns/unlabelled/status?"))),
        "{writes:#?}"
    );
    assert!(
        !writes.iter().any(|w| w.contains("/macbuilds/")),
        "the MacBuild written again: {writes:#?}"
    );
    assert_eq!(about_run().await, published, "Events published again");
}

/// A controller whose RBAC lacks `patch` on customruns (a release's image applied without its
/// RBAC): the refused label leaves the run in the watch, as before the label existed, instead of
/// retrying it every 5 s for good, each finished run one refused PATCH and a warning per turn.
#[tokio::test]
async fn a_refused_finished_label_is_not_retried() {
    let mut h = harness().await;
    // Each run due its label 8 s after it finished: the second run's label, asked after the
    // first run's was refused, comes after the 5 s retry of a failed reconcile would have.
    let mut args = h.args();
    args.finished_label_after = Duration::from_secs(8);
    h.controllers.push(tokio::spawn(tartan_controller::run::run(args)));
    h.emu.add_deny_rule(
        tartan_testkit::DenyRule::new("no-customrun-patch")
            .operations(&["UPDATE"])
            .resource("tekton.dev", "customruns")
            .subresource("")
            .forbidden(),
    );
    h.renew_lease("agent-a", Timestamp::now()).await;
    let label_patches = |name: &str| {
        let uri = format!("/customruns/{name}?");
        h.emu
            .answers()
            .iter()
            .filter(|a| a.method == "PATCH" && a.uri.contains(&uri))
            .map(|a| a.code)
            .collect::<Vec<u16>>()
    };
    for name in ["refused-a", "refused-b"] {
        h.create_run(name, json!({})).await;
        eventually("MacBuild", || async { h.builds().get_opt(name).await.unwrap() }).await;
        h.agent_writes(
            name,
            json!({"phase": "Succeeded", "claim": {"holder": "agent-a", "attempt": format!("{name}#1"), "epoch": 1},
                   "conditions": [vm_deleted("True"), {"type": "Succeeded", "status": "True", "reason": "TestsPassed",
                   "message": "", "lastTransitionTime": "2026-10-05T02:55:00Z"}]}),
        )
        .await;
        wait_reason(&h, name, "True", "TestsPassed").await;
        eventually_within(Duration::from_secs(30), "the label refused", || async {
            (!label_patches(name).is_empty()).then_some(())
        })
        .await;
    }
    // Twice at most: its MacBuild's label takes it out of that watch, which asks for the run again.
    let tried = label_patches("refused-a");
    assert!(
        tried.len() <= 2 && tried.iter().all(|c| *c == 403),
        "the refused label was tried again: {tried:?}"
    );
}

/// A CustomRun created with the finished label (its PipelineRun's labels, or a finished run's
/// YAML created again) is out of the watch and never run, as docs/upgrading.md says; removing
/// the label brings it in, and it runs.
#[tokio::test]
async fn a_run_created_with_the_finished_label_runs_once_the_label_is_removed() {
    let mut h = harness().await;
    h.start_controller();
    let run: CustomRun = serde_json::from_value(json!({
        "apiVersion": "tekton.dev/v1beta1", "kind": "CustomRun",
        "metadata": {"name": "born-finished", "labels": {FINISHED_LABEL: "true"}},
        "spec": {"customRef": {"apiVersion": "tartan.dev/v1alpha1", "kind": "MacBuild"},
                 "params": [{"name": "image", "value": "img"}, {"name": "steps", "value": ["make"]}]},
    }))
    .unwrap();
    h.runs().create(&PostParams::default(), &run).await.unwrap();
    // A run created after it is handled: the controller has had its chance at the first.
    h.create_run("witness", json!({})).await;
    wait_reason(&h, "witness", "Unknown", "Pending").await;
    assert!(h.builds().get_opt("born-finished").await.unwrap().is_none());
    assert!(h.status("born-finished").await.is_none_or(|s| s.conditions.is_empty()));

    let unlabel = Patch::Json::<()>(
        serde_json::from_value(json!([{"op": "remove", "path": "/metadata/labels/tartan.dev~1finished"}])).unwrap(),
    );
    h.runs()
        .patch("born-finished", &PatchParams::default(), &unlabel)
        .await
        .unwrap();
    wait_reason(&h, "born-finished", "Unknown", "Pending").await;
    let mb = h.builds().get("born-finished").await.unwrap();
    assert!(!mb.metadata.labels.unwrap_or_default().contains_key(FINISHED_LABEL));
}

/// A PipelineRun deleted mid-build and created again under its name (as real Tekton does with a
/// fixed-name re-run) while the old MacBuild is still held by its agent's finalizer: the new run
/// waits `Unknown` for the name instead of ending `MacBuildNameTaken`, and gets its own MacBuild
/// once the old one is gone.
#[tokio::test]
async fn a_run_created_again_while_its_old_macbuild_is_being_deleted_waits_for_the_name() {
    let mut h = harness().await;
    h.start_controller();
    h.renew_lease("agent-a", Timestamp::now()).await;
    let old = h.create_run("rerun", json!({})).await;
    eventually("MacBuild", || async { h.builds().get_opt("rerun").await.unwrap() }).await;
    h.builds()
        .patch(
            "rerun",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": ["tartan.dev/vm-cleanup"]}})),
        )
        .await
        .unwrap();
    h.agent_writes(
        "rerun",
        json!({"phase": "Running", "claim": claim(), "conditions": [vm_deleted("False")]}),
    )
    .await;
    wait_reason(&h, "rerun", "Unknown", "Running").await;
    h.runs().delete("rerun", &Default::default()).await.unwrap();
    eventually("the old MacBuild being deleted, held by the finalizer", || async {
        h.builds()
            .get_opt("rerun")
            .await
            .unwrap()
            .filter(|mb| mb.metadata.deletion_timestamp.is_some())
            .map(|_| ())
    })
    .await;
    let new = h.create_run("rerun", json!({})).await;
    assert_ne!(new.metadata.uid, old.metadata.uid);
    let st = wait_reason(&h, "rerun", "Unknown", "MacBuildNameTerminating").await;
    let message = st.conditions[0].message.clone().unwrap_or_default();
    assert!(message.contains("is being deleted"), "{message}");
    // The agent finishes deleting its VM and releases the old MacBuild.
    h.builds()
        .patch(
            "rerun",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await
        .unwrap();
    let mb = eventually("the new run's MacBuild", || async {
        h.builds()
            .get_opt("rerun")
            .await
            .unwrap()
            .filter(|mb| mb.metadata.owner_references.as_ref().unwrap()[0].uid == new.metadata.uid.clone().unwrap())
    })
    .await;
    assert!(mb.metadata.deletion_timestamp.is_none());
    wait_reason(&h, "rerun", "Unknown", "Pending").await;
}

/// GET `path` on a new connection to `port` (blocking thread; 10 s read bound); the answer, or the
/// error.
async fn http_get(port: u16, path: &'static str) -> std::io::Result<String> {
    tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        Ok(out)
    })
    .await
    .unwrap()
}

/// 300 idle connections to the controller's `/metrics` port (launchd's 256 soft limit was used up
/// so on an agent): the server holds at most its cap of them, `/healthz` still answers, and a
/// client that never finishes its headers is dropped after the (shortened) idle timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_neither_hold_descriptors_nor_lock_out_healthz() {
    use std::io::{Read, Write};
    let mut h = harness().await;
    // A free port for the controller (the harness binds port 0 and nothing reads it back).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut args = h.args();
    args.metrics_address = ([127, 0, 0, 1], port).into();
    args.http_max_connections = 8;
    args.http_idle_timeout = Duration::from_millis(1500);
    h.controllers.push(tokio::spawn(tartan_controller::run::run(args)));
    eventually("the controller's /healthz", || async {
        http_get(port, "/healthz").await.ok().filter(|a| a.ends_with("ok\n"))
    })
    .await;

    let flood = 300;
    let idle: Vec<_> = (0..flood)
        .map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).unwrap())
        .collect();
    let answer = http_get(port, "/healthz").await.expect("/healthz answers");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    if let Some(held) = tartan_testkit::server_socket_fds(port) {
        // The listener and at most 8 accepted connections (before the cap: all 300, and the
        // agent ran out of descriptors at 256).
        assert!(
            held <= 8 + 1,
            "the controller holds {held} descriptors for {flood} idle connections"
        );
    }
    drop(idle);

    let started = std::time::Instant::now();
    let closed = tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nHo").unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).is_ok()
    })
    .await
    .unwrap();
    assert!(closed, "a client stuck in its headers was not dropped within 20 s");
    assert!(
        started.elapsed() >= Duration::from_millis(1500),
        "dropped before the idle timeout"
    );
}
