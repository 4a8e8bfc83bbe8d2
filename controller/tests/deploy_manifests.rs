//! The manifests in `deploy/` agree with the code: the Tekton example only uses params the
//! controller understands, the Deployment runs two leader-electing replicas of `run` with a
//! PodDisruptionBudget, and RBAC grants what the reconcile loop and the elector call and nothing
//! to write CustomRun specs.

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

/// `tartan-controller run` with `args` parsed as the binary parses them.
#[derive(clap::Parser)]
struct Run {
    #[command(flatten)]
    args: tartan_controller::run::RunArgs,
}

#[test]
fn controller_is_two_leader_electing_replicas_with_a_disruption_budget() {
    use clap::Parser as _;
    let d = docs("controller.yaml");
    let dep = kind(&d, "Deployment", "tartan-controller");
    assert_eq!(dep["spec"]["replicas"], 2);
    assert_eq!(dep["spec"]["strategy"]["type"], "RollingUpdate");
    assert_eq!(dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"], 0);
    let c = &dep["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(c["args"][0], "run");
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    let env = |name: &str| {
        c["env"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == name)
            .unwrap_or_else(|| panic!("no env {name}"))["valueFrom"]["fieldRef"]["fieldPath"]
            .clone()
    };
    assert_eq!(env("POD_NAME"), "metadata.name", "the leader identity");
    assert_eq!(
        env("POD_NAMESPACE"),
        "metadata.namespace",
        "the leader Lease's namespace"
    );

    // The Deployment's flags parse, elect, and pass the elector's own checks.
    let mut argv: Vec<String> = vec!["tartan-controller".into()];
    argv.extend(
        c["args"].as_array().unwrap()[1..]
            .iter()
            .map(|a| a.as_str().unwrap().to_string()),
    );
    argv.extend([
        "--leader-lease-namespace=tartan-system".into(),
        "--leader-identity=pod-a".into(),
    ]);
    let run = Run::try_parse_from(&argv).unwrap_or_else(|e| panic!("{argv:?}: {e}"));
    let election = run.args.election().unwrap().expect("--leader-elect is on");
    assert_eq!(election.name, "tartan-controller");
    assert_eq!(election.lease, std::time::Duration::from_secs(15));
    // Every timing flag the Deployment leaves out is the source's default.
    assert_eq!(run.args.timing(), tartan_controller::decide::Timing::default());

    let pdbs = docs("controller-pdb.yaml");
    let pdb = kind(&pdbs, "PodDisruptionBudget", "tartan-controller");
    assert_eq!(pdb["spec"]["minAvailable"], 1);
    assert_eq!(pdb["metadata"]["namespace"], dep["metadata"]["namespace"]);
    assert_eq!(
        pdb["spec"]["selector"]["matchLabels"],
        dep["spec"]["template"]["metadata"]["labels"]
    );
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
    // A patch of the CustomRun for its `tartan.dev/finished` label (RBAC cannot narrow it to
    // labels; the code's only CustomRun patch is that label, agent/tests/rbac_real.rs), never a
    // replace of it (its spec is Tekton's), never MacBuild status (the agent's).
    assert!(allows(ctl, "tekton.dev", "customruns", "patch"));
    assert!(!allows(ctl, "tekton.dev", "customruns", "update"));
    assert!(!allows(ctl, "tartan.dev", "macbuilds/status", "patch"));
    // The leader Lease: get/update on that one name, create (which resourceNames cannot restrict).
    let leader = kind(&d, "Role", "tartan-controller-leader");
    assert_eq!(leader["metadata"]["namespace"], "tartan-system");
    let rules = leader["rules"].as_array().unwrap();
    assert_eq!(rules[0]["resourceNames"], serde_json::json!(["tartan-controller"]));
    assert_eq!(rules[0]["verbs"], serde_json::json!(["get", "update"]));
    assert_eq!(rules[1]["verbs"], serde_json::json!(["create"]));
    assert!(allows(leader, "coordination.k8s.io", "leases", "update"));
    assert!(
        !allows(ctl, "coordination.k8s.io", "leases", "update"),
        "no other Lease"
    );
    let binding = kind(&d, "RoleBinding", "tartan-controller-leader");
    assert_eq!(binding["subjects"][0]["name"], "tartan-controller");
    let agent = kind(&d, "Role", "tartan-agent");
    for (g, r, v) in [
        ("tartan.dev", "macbuilds", "watch"),
        ("tartan.dev", "macbuilds", "patch"),
        ("tartan.dev", "macbuilds/status", "patch"),
        ("coordination.k8s.io", "leases", "patch"),
        // The other agents' Leases (runtime/mod.rs: claim waits only for agents that could take
        // the build).
        ("coordination.k8s.io", "leases", "list"),
        ("coordination.k8s.io", "leases", "watch"),
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
