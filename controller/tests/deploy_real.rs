//! `deploy/` installed the usual way, and old MacBuilds against today's CRD:
//! - `kubectl kustomize deploy/` renders exactly the objects a cluster needs, with the controller
//!   image `scripts/image` builds (tag = crate version, never `latest`);
//! - `kubectl apply -k deploy/ --server-side` on a real kube-apiserver (`KUBEBUILDER_ASSETS` or an existing cluster, see
//!   `tartan_testkit::real`) creates them and the CRD becomes Established;
//! - every MacBuild fixture of `api/tests/fixtures/` (shapes earlier releases wrote) is accepted
//!   by that CRD, spec and status, and comes back without a field pruned.
//!
//! The real-cluster test skips (printing why) without etcd or the cluster script.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams};
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use tartan_testkit::RealCluster;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The image reference scripts/image builds: the crate version as the tag.
fn image_ref() -> String {
    format!("ghcr.io/tartan-dev/tartan-controller:{}", env!("CARGO_PKG_VERSION"))
}

/// `kind namespace/name` of each object `kubectl kustomize deploy/` renders.
const EXPECTED: &[&str] = &[
    "ClusterRole /tartan-agent-watch",
    "ClusterRole /tartan-controller",
    "ClusterRoleBinding /tartan-agent-watch",
    "ClusterRoleBinding /tartan-controller",
    "CustomResourceDefinition /macbuilds.tartan.dev",
    "Deployment tartan-system/tartan-controller",
    "Namespace /tartan-system",
    "PodDisruptionBudget tartan-system/tartan-controller",
    "Role ci/tartan-agent",
    "Role tartan-system/tartan-controller-leader",
    "RoleBinding ci/tartan-agent",
    "RoleBinding tartan-system/tartan-controller-leader",
    "Service tartan-system/tartan-controller-metrics",
    "ServiceAccount ci/tartan-agent",
    "ServiceAccount tartan-system/tartan-controller",
];

fn ids(docs: &[Value]) -> BTreeSet<String> {
    docs.iter()
        .map(|d| {
            let ns = d["metadata"]["namespace"].as_str().unwrap_or_default();
            format!(
                "{} {ns}/{}",
                d["kind"].as_str().unwrap(),
                d["metadata"]["name"].as_str().unwrap()
            )
        })
        .collect()
}

fn kustomized() -> Vec<Value> {
    let yaml = run(Command::new("kubectl").arg("kustomize").arg(workspace().join("deploy")));
    serde_saphyr::from_multiple::<Value>(&yaml).unwrap_or_else(|e| panic!("kubectl kustomize printed no YAML: {e}"))
}

#[test]
fn kustomize_renders_every_object_with_the_image_scripts_image_builds() {
    let docs = kustomized();
    assert_eq!(ids(&docs), EXPECTED.iter().map(|s| s.to_string()).collect());
    let deployment = docs.iter().find(|d| d["kind"] == "Deployment").unwrap();
    let image = &deployment["spec"]["template"]["spec"]["containers"][0]["image"];
    assert_eq!(image, &Value::from(image_ref()));
    // deploy/controller.yaml itself (for `kubectl apply -f`) names the same reference.
    let plain = std::fs::read_to_string(workspace().join("deploy/controller.yaml")).unwrap();
    let plain: Vec<Value> = serde_saphyr::from_multiple(&plain).unwrap();
    let d = plain.iter().find(|d| d["kind"] == "Deployment").unwrap();
    assert_eq!(d["spec"]["template"]["spec"]["containers"][0]["image"], *image);
    // And the CRD in the kustomization is the one the code generates (crd_drift.rs checks the file).
    let crd = docs.iter().find(|d| d["kind"] == "CustomResourceDefinition").unwrap();
    let crd: CustomResourceDefinition = serde_json::from_value(crd.clone()).unwrap();
    assert_eq!(crd, <tartan_api::MacBuild as kube::CustomResourceExt>::crd());
}

#[test]
fn scripts_image_tags_with_the_crate_version() {
    let printed = run(Command::new(workspace().join("scripts/image")).arg("--print-ref"));
    assert_eq!(printed.trim(), image_ref());
    assert!(!printed.contains(":latest"));
}

#[test]
fn the_controller_version_names_the_git_commit() {
    let printed = run(Command::new(env!("CARGO_BIN_EXE_tartan-controller")).arg("--version"));
    let commit = Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(workspace())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map_or_else(
            || "unknown".to_owned(),
            |o| String::from_utf8_lossy(&o.stdout).trim().to_owned(),
        );
    assert_eq!(
        printed,
        format!("tartan-controller {} (commit {commit})\n", env!("CARGO_PKG_VERSION"))
    );
}

fn fixtures() -> Vec<(String, Value)> {
    let dir = workspace().join("api/tests/fixtures");
    let mut found: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap();
            let value: Value = serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p.file_name().unwrap().to_string_lossy().into_owned(), value)
        })
        .collect();
    found.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(found.len() >= 5, "expected the fixtures in {}", dir.display());
    found
}

/// Where `stored` lacks or changes something of `written` (what structural pruning or a
/// changed type would do to an old object).
fn lost(written: &Value, stored: &Value, path: &str, out: &mut Vec<String>) {
    match (written, stored) {
        (Value::Object(w), Value::Object(s)) => {
            for (k, v) in w {
                match s.get(k) {
                    Some(sv) => lost(v, sv, &format!("{path}.{k}"), out),
                    None => out.push(format!("{path}.{k} was dropped")),
                }
            }
        }
        (Value::Array(w), Value::Array(s)) if w.len() == s.len() => {
            for (i, (a, b)) in w.iter().zip(s).enumerate() {
                lost(a, b, &format!("{path}[{i}]"), out);
            }
        }
        _ if written == stored => {}
        _ => out.push(format!("{path}: wrote {written}, stored {stored}")),
    }
}

#[tokio::test]
async fn apply_k_creates_every_object_and_old_macbuilds_pass_today_s_crd() {
    let Some(cluster) = RealCluster::start("deploy_real").expect("the real control plane failed to start") else {
        return;
    };
    let deploy = workspace().join("deploy");
    let deploy = deploy.to_str().unwrap();
    // rbac.yaml's shared agent objects live in the MacBuild namespace, which the user has.
    cluster.kubectl(&["create", "namespace", "ci"], None).unwrap();
    cluster
        .kubectl(&["apply", "-k", deploy, "--server-side", "--dry-run=server"], None)
        .expect_err("a server dry run cannot create tartan-system's objects before the Namespace exists");
    let out = cluster
        .kubectl(&["apply", "-k", deploy, "--server-side"], None)
        .unwrap();
    assert_eq!(out.lines().count(), EXPECTED.len(), "one line per object: {out}");
    cluster
        .kubectl(
            &[
                "wait",
                "--for=condition=Established",
                "crd/macbuilds.tartan.dev",
                "--timeout=30s",
            ],
            None,
        )
        .unwrap();
    let listed = cluster.kubectl(&["get", "-k", deploy, "-o", "json"], None).unwrap();
    let listed: Value = serde_json::from_str(&listed).unwrap();
    let items = listed["items"].as_array().unwrap();
    assert_eq!(
        ids(items),
        EXPECTED.iter().map(|s| s.to_string()).collect(),
        "what the apiserver holds"
    );
    let deployment = items.iter().find(|d| d["kind"] == "Deployment").unwrap();
    assert_eq!(
        deployment["spec"]["template"]["spec"]["containers"][0]["image"],
        Value::from(image_ref())
    );
    // Applying again changes nothing (a rollout must not fight the kustomization).
    let generation = deployment["metadata"]["generation"].clone();
    cluster
        .kubectl(&["apply", "-k", deploy, "--server-side"], None)
        .unwrap();
    let again = cluster
        .kubectl(
            &[
                "-n",
                "tartan-system",
                "get",
                "deployment",
                "tartan-controller",
                "-o",
                "json",
            ],
            None,
        )
        .unwrap();
    assert_eq!(
        serde_json::from_str::<Value>(&again).unwrap()["metadata"]["generation"],
        generation
    );

    // The CRD validates: a MacBuild without an image is refused (so acceptance below means something).
    let bad = "apiVersion: tartan.dev/v1alpha1\nkind: MacBuild\nmetadata: {name: no-image}\nspec:\n  steps: [{name: b, run: [\"true\"]}]\n";
    let e = cluster
        .kubectl(&["-n", "ci", "create", "--validate=false", "-f", "-"], Some(bad))
        .unwrap_err();
    assert!(format!("{e:#}").contains("spec.image"), "{e:#}");

    let admin = cluster.admin_client().await.unwrap();
    let macbuilds: Api<DynamicObject> =
        Api::namespaced_with(admin, "ci", &ApiResource::erase::<tartan_api::MacBuild>(&()));
    let mut problems = vec![];
    for (name, written) in fixtures() {
        let yaml = serde_json::to_string(&written).unwrap();
        // --validate=false: the apiserver's own validation and pruning, as the agent's and the
        // controller's writes get them (kube-rs validates nothing on the client).
        let created = match cluster.kubectl(
            &["-n", "ci", "create", "--validate=false", "-o", "json", "-f", "-"],
            Some(&yaml),
        ) {
            Ok(out) => serde_json::from_str::<Value>(&out).unwrap(),
            Err(e) => {
                problems.push(format!("{name}: refused: {e:#}"));
                continue;
            }
        };
        let before = problems.len();
        lost(&written["spec"], &created["spec"], "spec", &mut problems);
        lost(
            &written["metadata"]["labels"],
            &created["metadata"]["labels"],
            "labels",
            &mut problems,
        );
        if written.get("status").is_some() {
            // Status goes through its subresource as the agent writes it: a merge patch by kube-rs.
            let patch = Patch::Merge(serde_json::json!({"status": written["status"]}));
            let mb_name = written["metadata"]["name"].as_str().unwrap();
            match macbuilds.patch_status(mb_name, &PatchParams::default(), &patch).await {
                Ok(stored) => {
                    let stored = serde_json::to_value(stored).unwrap();
                    lost(&written["status"], &stored["status"], "status", &mut problems);
                }
                Err(e) => problems.push(format!("status refused: {e}")),
            }
        }
        for p in &mut problems[before..] {
            *p = format!("{name}: {p}");
        }
    }
    assert!(
        problems.is_empty(),
        "today's CRD breaks MacBuilds of earlier releases:\n{}",
        problems.join("\n")
    );
}
