//! The manifests in `deploy/` agree with the code: the Tekton example only uses params the
//! controller understands, the Deployment runs one Recreate replica of `run`, and RBAC grants
//! what the reconcile loop calls and nothing to write CustomRun specs.

use serde_json::Value;
use std::path::PathBuf;
use tartan_controller::params::PARAM_NAMES;

fn docs(file: &str) -> Vec<Value> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy").join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_saphyr::from_multiple::<Value>(&text).unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()))
}

fn kind<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

#[test]
fn tekton_example_uses_only_known_params_and_no_retries() {
    let d = docs("tekton-example.yaml");
    let pipeline = kind(&d, "Pipeline", "ios-app");
    let task = pipeline["spec"]["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "mac-build")
        .unwrap();
    assert_eq!(task["taskRef"]["apiVersion"], tartan_api::API_VERSION);
    assert_eq!(task["taskRef"]["kind"], tartan_api::KIND);
    assert!(task.get("retries").is_none());
    for p in task["params"].as_array().unwrap() {
        let name = p["name"].as_str().unwrap();
        assert!(PARAM_NAMES.contains(&name), "unknown param {name}");
    }
    assert!(d.iter().any(|x| x["kind"] == "PipelineRun"));
}

#[test]
fn controller_is_one_recreate_replica_running_the_run_subcommand() {
    let d = docs("controller.yaml");
    let dep = kind(&d, "Deployment", "tartan-controller");
    assert_eq!(dep["spec"]["replicas"], 1);
    assert_eq!(dep["spec"]["strategy"]["type"], "Recreate");
    let c = &dep["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(c["args"][0], "run");
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
}

fn allows(role: &Value, group: &str, resource: &str, verb: &str) -> bool {
    role["rules"].as_array().unwrap().iter().any(|r| {
        let has = |key: &str, v: &str| r[key].as_array().unwrap().iter().any(|x| x == v);
        has("apiGroups", group) && has("resources", resource) && has("verbs", verb)
    })
}

#[test]
fn rbac_is_least_privilege() {
    let d = docs("rbac.yaml");
    let ctl = kind(&d, "ClusterRole", "tartan-controller");
    for (g, r, v) in [
        ("tekton.dev", "customruns", "watch"),
        ("tekton.dev", "customruns/status", "patch"),
        ("tartan.dev", "macbuilds", "create"),
        ("tartan.dev", "macbuilds", "patch"),
        ("tartan.dev", "macbuilds", "delete"),
        ("coordination.k8s.io", "leases", "get"),
        ("events.k8s.io", "events", "create"),
    ] {
        assert!(allows(ctl, g, r, v), "controller needs {v} {g}/{r}");
    }
    // Never the CustomRun spec (spec.status is Tekton's), never MacBuild status (the agent's).
    assert!(!allows(ctl, "tekton.dev", "customruns", "patch"));
    assert!(!allows(ctl, "tekton.dev", "customruns", "update"));
    assert!(!allows(ctl, "tartan.dev", "macbuilds/status", "patch"));
    let agent = kind(&d, "Role", "tartan-agent");
    for (g, r, v) in [
        ("tartan.dev", "macbuilds", "watch"),
        ("tartan.dev", "macbuilds", "patch"),
        ("tartan.dev", "macbuilds/status", "patch"),
        ("coordination.k8s.io", "leases", "patch"),
        ("events.k8s.io", "events", "create"),
    ] {
        assert!(allows(agent, g, r, v), "agent needs {v} {g}/{r}");
    }
    assert!(!allows(agent, "tartan.dev", "macbuilds", "create"));
    assert!(!allows(agent, "tartan.dev", "macbuilds", "delete"));
    // The agent watches MacBuilds of all namespaces: a namespaced Role cannot allow that.
    let watch = kind(&d, "ClusterRole", "tartan-agent-watch");
    assert!(allows(watch, "tartan.dev", "macbuilds", "watch"));
    assert_eq!(
        watch["rules"].as_array().unwrap().len(),
        1,
        "read MacBuilds, nothing else"
    );
    let binding = kind(&d, "ClusterRoleBinding", "tartan-agent-watch");
    assert_eq!(binding["subjects"][0]["name"], "tartan-agent");
}
