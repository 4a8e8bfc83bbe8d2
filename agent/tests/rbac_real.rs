//! RBAC proven both ways on a real kube-apiserver (`KUBEBUILDER_ASSETS` or an existing cluster, see `tartan_testkit::real`):
//! `deploy/rbac.yaml` (rendered into the namespace `builds`) and `tartan-agent rbac` are applied,
//! then every request kind the controller's and the agent's code makes is sent with each
//! ServiceAccount's own token and must not be refused (anything but 403: a 404 or 422 comes after
//! authorization), and what each must never do must be refused with 403.
//!
//! [`CALLS`] is derived from the code; [`calls_table_matches_the_code`] greps `agent/src` and
//! `controller/src` for kube API calls and fails when the code and the table disagree either way.
//!
//! Skips (printing why) without etcd or the cluster script; one cluster for the whole file.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams, WatchParams,
};
use serde_json::json;
use tartan_testkit::RealCluster;

/// The namespace `deploy/rbac.yaml`'s `ci` is rendered into.
const NS: &str = "builds";
/// Another namespace, whose Secret nobody may read.
const OTHER_NS: &str = "elsewhere";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Who {
    Controller,
    Agent,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verb {
    Get,
    List,
    Watch,
    Create,
    /// A merge patch of metadata (a label): what the agent's finalizer/label patch needs.
    Patch,
    /// A merge patch of `spec`.
    PatchSpec,
    PatchStatus,
    Delete,
    /// A replace (PUT) of the whole object.
    Update,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scope {
    /// In [`NS`] (or the Lease namespace).
    Namespaced,
    /// All namespaces (`Api::all`).
    Cluster,
}

/// A resource: group, version, kind, plural.
type Res = (&'static str, &'static str, &'static str, &'static str);
const MACBUILD: Res = ("tartan.dev", "v1alpha1", "MacBuild", "macbuilds");
const CUSTOMRUN: Res = ("tekton.dev", "v1beta1", "CustomRun", "customruns");
const LEASE: Res = ("coordination.k8s.io", "v1", "Lease", "leases");
const EVENT: Res = ("events.k8s.io", "v1", "Event", "events");
const SECRET: Res = ("", "v1", "Secret", "secrets");

/// The controllers' leader Lease (`controller/src/leader.rs`), in the namespace of deploy/rbac.yaml.
const LEADER_LEASE: &str = "tartan-controller";
const CONTROLLER_NS: &str = "tartan-system";
const LEADER_FILE: &str = "controller/src/leader.rs";

/// One request kind the code makes: who, on what, how, and where in the source (file, the Rust
/// type the `Api` is of, and the call: a kube `Api` method, or `watcher` / `Controller::new` /
/// `owns` / `watches` (list + watch) / `Recorder::new` (Event create, and patch for a series)).
struct Call {
    who: Who,
    res: Res,
    verb: Verb,
    scope: Scope,
    file: &'static str,
    rust_type: &'static str,
    call: &'static str,
}

const fn c(
    who: Who,
    res: Res,
    verb: Verb,
    scope: Scope,
    file: &'static str,
    rust_type: &'static str,
    call: &'static str,
) -> Call {
    Call {
        who,
        res,
        verb,
        scope,
        file,
        rust_type,
        call,
    }
}

use Scope::{Cluster, Namespaced};
use Verb::*;
use Who::{Agent, Controller};

/// Every API call of the code, one row per (call site kind, verb).
const CALLS: &[Call] = &[
    // `spec.env`'s Secrets, read by name at attempt start: allowed only for the Secrets an
    // operator lists (`tartan-agent rbac --secret`), checked on its own below.
    c(
        Agent,
        SECRET,
        Get,
        Namespaced,
        "agent/src/host/env.rs",
        "Secret",
        "get_opt",
    ),
    // The agent's MacBuild watches (reflectors: list, then watch; by label), in each served
    // namespace or, with `namespaces` empty, over all of them.
    c(
        Agent,
        MACBUILD,
        List,
        Cluster,
        "agent/src/cluster/view.rs",
        "MacBuild",
        "watcher",
    ),
    c(
        Agent,
        MACBUILD,
        Watch,
        Cluster,
        "agent/src/cluster/view.rs",
        "MacBuild",
        "watcher",
    ),
    // Fresh reads of one MacBuild before acting on it, and of one this agent still works on
    // that its watches no longer have.
    c(
        Agent,
        MACBUILD,
        Get,
        Namespaced,
        "agent/src/cluster/view.rs",
        "MacBuild",
        "get_opt",
    ),
    c(
        Agent,
        MACBUILD,
        Get,
        Namespaced,
        "agent/src/runtime/build.rs",
        "MacBuild",
        "get_opt",
    ),
    c(
        Agent,
        MACBUILD,
        Get,
        Namespaced,
        "agent/src/cluster/claim.rs",
        "MacBuild",
        "get_opt",
    ),
    c(
        Agent,
        MACBUILD,
        Get,
        Namespaced,
        "agent/src/cluster/delivery.rs",
        "MacBuild",
        "get_opt",
    ),
    // The claim (status) and the finalizer + agent label (metadata of the main resource).
    c(
        Agent,
        MACBUILD,
        PatchStatus,
        Namespaced,
        "agent/src/cluster/claim.rs",
        "MacBuild",
        "patch_status",
    ),
    c(
        Agent,
        MACBUILD,
        Patch,
        Namespaced,
        "agent/src/cluster/claim.rs",
        "MacBuild",
        "patch",
    ),
    // Status delivery.
    c(
        Agent,
        MACBUILD,
        PatchStatus,
        Namespaced,
        "agent/src/cluster/delivery.rs",
        "MacBuild",
        "patch_status",
    ),
    // The agent's own Lease.
    c(
        Agent,
        LEASE,
        Get,
        Namespaced,
        "agent/src/cluster/lease.rs",
        "Lease",
        "get_opt",
    ),
    c(
        Agent,
        LEASE,
        Create,
        Namespaced,
        "agent/src/cluster/lease.rs",
        "Lease",
        "create",
    ),
    c(
        Agent,
        LEASE,
        Patch,
        Namespaced,
        "agent/src/cluster/lease.rs",
        "Lease",
        "patch",
    ),
    // Every agent's Lease, read by a reflector (list, then watch) in the Lease namespace: which
    // other agents could take a build (`cluster/placement.rs`).
    c(
        Agent,
        LEASE,
        List,
        Namespaced,
        "agent/src/runtime/mod.rs",
        "Lease",
        "watcher",
    ),
    c(
        Agent,
        LEASE,
        Watch,
        Namespaced,
        "agent/src/runtime/mod.rs",
        "Lease",
        "watcher",
    ),
    // Transition events: a fresh Recorder per event, so never a series patch.
    c(
        Agent,
        EVENT,
        Create,
        Namespaced,
        "agent/src/cluster/events.rs",
        "Event",
        "Recorder::new",
    ),
    // The controller's start-up probe (`--namespace` or all namespaces).
    c(
        Controller,
        MACBUILD,
        List,
        Namespaced,
        "controller/src/run.rs",
        "MacBuild",
        "list",
    ),
    c(
        Controller,
        MACBUILD,
        List,
        Cluster,
        "controller/src/run.rs",
        "MacBuild",
        "list",
    ),
    c(
        Controller,
        CUSTOMRUN,
        List,
        Namespaced,
        "controller/src/run.rs",
        "CustomRun",
        "list",
    ),
    c(
        Controller,
        CUSTOMRUN,
        List,
        Cluster,
        "controller/src/run.rs",
        "CustomRun",
        "list",
    ),
    // The Controller's watches (each feeding a trimmed cache the reconciles read): CustomRuns,
    // owned MacBuilds, agent Leases (namespaced or all).
    c(
        Controller,
        CUSTOMRUN,
        List,
        Cluster,
        "controller/src/run.rs",
        "CustomRun",
        "watcher",
    ),
    c(
        Controller,
        CUSTOMRUN,
        Watch,
        Cluster,
        "controller/src/run.rs",
        "CustomRun",
        "watcher",
    ),
    c(
        Controller,
        CUSTOMRUN,
        Watch,
        Namespaced,
        "controller/src/run.rs",
        "CustomRun",
        "watcher",
    ),
    c(
        Controller,
        MACBUILD,
        List,
        Cluster,
        "controller/src/run.rs",
        "MacBuild",
        "watcher",
    ),
    c(
        Controller,
        MACBUILD,
        Watch,
        Cluster,
        "controller/src/run.rs",
        "MacBuild",
        "watcher",
    ),
    c(
        Controller,
        MACBUILD,
        Watch,
        Namespaced,
        "controller/src/run.rs",
        "MacBuild",
        "watcher",
    ),
    c(
        Controller,
        LEASE,
        List,
        Cluster,
        "controller/src/run.rs",
        "Lease",
        "watcher",
    ),
    c(
        Controller,
        LEASE,
        Watch,
        Cluster,
        "controller/src/run.rs",
        "Lease",
        "watcher",
    ),
    c(
        Controller,
        LEASE,
        Watch,
        Namespaced,
        "controller/src/run.rs",
        "Lease",
        "watcher",
    ),
    // Events on CustomRuns and MacBuilds: a fresh Recorder per Event, so never a series patch.
    c(
        Controller,
        EVENT,
        Create,
        Namespaced,
        "controller/src/run.rs",
        "Event",
        "Recorder::new",
    ),
    // The reconcile loop.
    c(
        Controller,
        CUSTOMRUN,
        Get,
        Namespaced,
        "controller/src/reconcile.rs",
        "CustomRun",
        "get_opt",
    ),
    c(
        Controller,
        MACBUILD,
        Get,
        Namespaced,
        "controller/src/reconcile.rs",
        "MacBuild",
        "get_opt",
    ),
    c(
        Controller,
        LEASE,
        Get,
        Namespaced,
        "controller/src/reconcile.rs",
        "Lease",
        "get_opt",
    ),
    // Cache reads (`self.cache.builds.get`, `.leases.get`): the scan takes them for API gets by
    // their names; they need no more than the get_opt rows above.
    c(
        Controller,
        MACBUILD,
        Get,
        Namespaced,
        "controller/src/reconcile.rs",
        "MacBuild",
        "get",
    ),
    c(
        Controller,
        LEASE,
        Get,
        Namespaced,
        "controller/src/reconcile.rs",
        "Lease",
        "get",
    ),
    c(
        Controller,
        MACBUILD,
        Create,
        Namespaced,
        "controller/src/reconcile.rs",
        "MacBuild",
        "create",
    ),
    // spec.cancelRequested, and the `tartan.dev/finished` label (a metadata patch: covered).
    c(
        Controller,
        MACBUILD,
        PatchSpec,
        Namespaced,
        "controller/src/reconcile.rs",
        "MacBuild",
        "patch",
    ),
    c(
        Controller,
        MACBUILD,
        Delete,
        Namespaced,
        "controller/src/reconcile.rs",
        "MacBuild",
        "delete",
    ),
    c(
        Controller,
        CUSTOMRUN,
        PatchStatus,
        Namespaced,
        "controller/src/reconcile.rs",
        "CustomRun",
        "patch_status",
    ),
    // The `tartan.dev/finished` label on a finished run (`Ctx::mark_finished`). RBAC cannot
    // narrow a patch to one label: the code patches nothing else, fenced on the run's uid.
    c(
        Controller,
        CUSTOMRUN,
        Patch,
        Namespaced,
        "controller/src/reconcile.rs",
        "CustomRun",
        "patch",
    ),
    // Leader election among controller replicas: its own Lease only.
    c(Controller, LEASE, Get, Namespaced, LEADER_FILE, "Lease", "get_opt"),
    c(Controller, LEASE, Create, Namespaced, LEADER_FILE, "Lease", "create"),
    c(Controller, LEASE, Update, Namespaced, LEADER_FILE, "Lease", "replace"),
];

/// What must be refused (403), with the reason.
struct Never {
    who: Who,
    res: Res,
    verb: Verb,
    ns: &'static str,
    why: &'static str,
}

const NEVER: &[Never] = &[
    Never {
        who: Agent,
        res: CUSTOMRUN,
        verb: Get,
        ns: NS,
        why: "the agent never touches CustomRuns",
    },
    Never {
        who: Agent,
        res: CUSTOMRUN,
        verb: List,
        ns: NS,
        why: "the agent never touches CustomRuns",
    },
    Never {
        who: Agent,
        res: CUSTOMRUN,
        verb: Watch,
        ns: NS,
        why: "the agent never touches CustomRuns",
    },
    Never {
        who: Agent,
        res: CUSTOMRUN,
        verb: Create,
        ns: NS,
        why: "the agent never touches CustomRuns",
    },
    Never {
        who: Agent,
        res: CUSTOMRUN,
        verb: Patch,
        ns: NS,
        why: "the agent never touches CustomRuns",
    },
    Never {
        who: Agent,
        res: CUSTOMRUN,
        verb: PatchStatus,
        ns: NS,
        why: "the agent never touches CustomRuns",
    },
    Never {
        who: Agent,
        res: CUSTOMRUN,
        verb: Delete,
        ns: NS,
        why: "the agent never touches CustomRuns",
    },
    Never {
        who: Agent,
        res: MACBUILD,
        verb: Delete,
        ns: NS,
        why: "only the controller deletes MacBuilds",
    },
    Never {
        who: Agent,
        res: MACBUILD,
        verb: Create,
        ns: NS,
        why: "only the controller creates MacBuilds",
    },
    Never {
        who: Agent,
        res: SECRET,
        verb: Get,
        ns: NS,
        why: "the agent reads no Secret it was not given",
    },
    Never {
        who: Agent,
        res: SECRET,
        verb: List,
        ns: NS,
        why: "the agent reads no Secret it was not given",
    },
    Never {
        who: Agent,
        res: SECRET,
        verb: Get,
        ns: OTHER_NS,
        why: "the agent reads no Secret it was not given",
    },
    Never {
        who: Controller,
        res: MACBUILD,
        verb: PatchStatus,
        ns: NS,
        why: "MacBuild status is the agent's",
    },
    Never {
        who: Controller,
        res: CUSTOMRUN,
        verb: Delete,
        ns: NS,
        why: "the controller never deletes CustomRuns",
    },
    Never {
        who: Controller,
        res: LEASE,
        verb: Patch,
        ns: NS,
        why: "Leases are the agents'",
    },
    Never {
        who: Controller,
        res: SECRET,
        verb: Get,
        ns: NS,
        why: "the controller reads no Secret",
    },
    Never {
        who: Controller,
        res: SECRET,
        verb: List,
        ns: OTHER_NS,
        why: "the controller reads no Secret",
    },
];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

// ---------------------------------------------------------------------------------------------
// The table against the code.

/// `(file, Rust type, call)` of every kube API call found in `agent/src` and `controller/src`.
fn api_calls_in_source() -> BTreeSet<(String, String, String)> {
    // `Api<K>`, or `Api<Unmanaged<K>>` (the controller's watches read K without managedFields).
    let ident_type = regex::Regex::new(r"\b(\w+)\s*:\s*&?Api<(?:Unmanaged<)?(\w+)>").unwrap();
    let tuple = regex::Regex::new(r"let\s*\(([\w\s,]+)\)\s*:\s*\(([^)]*)\)").unwrap();
    let api_type = regex::Regex::new(r"Api<(?:Unmanaged<)?(\w+)>").unwrap();
    let method = regex::Regex::new(
        r"\b(\w+)\s*\.(get|get_opt|get_metadata|get_metadata_opt|get_status|list|list_metadata|watch|watch_metadata|create|delete|delete_collection|patch|patch_status|patch_metadata|patch_subresource|replace|replace_status|replace_subresource|entry)\(",
    )
    .unwrap();
    let stream = regex::Regex::new(r"(watcher|metadata_watcher|Controller::new|\.owns|\.watches)\(\s*(\w+)").unwrap();
    let mut found = BTreeSet::new();
    for dir in ["agent/src", "controller/src"] {
        for file in rust_files(&workspace().join(dir)) {
            let text = std::fs::read_to_string(&file).unwrap();
            let rel = file
                .strip_prefix(workspace())
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/");
            let mut types = std::collections::HashMap::new();
            for m in ident_type.captures_iter(&text) {
                types.insert(m[1].to_string(), m[2].to_string());
            }
            for m in tuple.captures_iter(&text) {
                let names: Vec<&str> = m[1].split(',').map(str::trim).collect();
                let tys: Vec<String> = api_type.captures_iter(&m[2]).map(|t| t[1].to_string()).collect();
                if names.len() == tys.len() {
                    for (n, t) in names.iter().zip(tys) {
                        types.insert(n.to_string(), t);
                    }
                }
            }
            for m in method.captures_iter(&text) {
                if let Some(t) = types.get(&m[1]) {
                    found.insert((rel.clone(), t.clone(), m[2].to_string()));
                }
            }
            for m in stream.captures_iter(&text) {
                let call = m[1].trim_start_matches('.').to_string();
                let t = types
                    .get(&m[2])
                    .unwrap_or_else(|| panic!("{rel}: {call}({}) on an Api whose type the scan cannot tell", &m[2]));
                found.insert((rel.clone(), t.clone(), call));
            }
            if text.contains("Recorder::new(") {
                found.insert((rel.clone(), "Event".into(), "Recorder::new".into()));
            }
            // Kube calls the scan cannot classify must not slip by.
            for bad in ["DynamicObject", ".request(", ".request_text(", "Discovery::"] {
                assert!(
                    !text.contains("kube") || !text.contains(bad),
                    "{rel} uses {bad}: extend api_calls_in_source and CALLS for it"
                );
            }
        }
    }
    found
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(rust_files(&p));
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    out
}

#[test]
fn calls_table_matches_the_code() {
    let found = api_calls_in_source();
    let table: BTreeSet<(String, String, String)> = CALLS
        .iter()
        .map(|c| (c.file.to_string(), c.rust_type.to_string(), c.call.to_string()))
        .collect();
    let missing: Vec<_> = found.difference(&table).collect();
    let stale: Vec<_> = table.difference(&found).collect();
    assert!(
        missing.is_empty(),
        "API calls in the code that CALLS does not list (add rows, with the verbs and scope, and check \
         deploy/rbac.yaml and `tartan-agent rbac` allow them): {missing:#?}"
    );
    assert!(
        stale.is_empty(),
        "CALLS rows whose call is no longer in the code: {stale:#?}"
    );
}

// ---------------------------------------------------------------------------------------------
// The real apiserver.

fn resource(res: Res) -> ApiResource {
    let (group, version, kind, plural) = res;
    let api_version = if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    };
    ApiResource {
        group: group.into(),
        version: version.into(),
        api_version,
        kind: kind.into(),
        plural: plural.into(),
    }
}

fn api(client: &kube::Client, res: Res, ns: Option<&str>) -> Api<DynamicObject> {
    match ns {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &resource(res)),
        None => Api::all_with(client.clone(), &resource(res)),
    }
}

/// A valid new object of `res` named `name` (for creates, always dry-run).
fn object(res: Res, name: &str, ns: &str) -> DynamicObject {
    let (group, version, kind, _) = res;
    let api_version = if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    };
    let mut v = json!({"apiVersion": api_version, "kind": kind, "metadata": {"name": name, "namespace": ns}});
    match kind {
        "MacBuild" => v["spec"] = json!({"image": "sequoia", "steps": [{"name": "build", "run": ["make"]}]}),
        "CustomRun" => v["spec"] = json!({"customRef": {"apiVersion": "tartan.dev/v1alpha1", "kind": "MacBuild"}}),
        "Lease" => v["spec"] = json!({"holderIdentity": "nobody"}),
        "Event" => {
            v = json!({"apiVersion": api_version, "kind": kind, "metadata": {"name": name, "namespace": ns},
                "eventTime": "2026-01-01T00:00:00.000000Z", "reportingController": "rbac-test",
                "reportingInstance": "rbac-test", "action": "Probe", "reason": "Probe", "type": "Normal",
                "regarding": {"apiVersion": "tartan.dev/v1alpha1", "kind": "MacBuild", "name": "probe", "namespace": ns}})
        }
        "Secret" => v["stringData"] = json!({"k": "v"}),
        _ => unreachable!("{kind}"),
    }
    serde_json::from_value(v).unwrap()
}

#[derive(Debug, PartialEq)]
enum Outcome {
    /// Authorized: the code (200/201, or an error that comes after authorization).
    Allowed(u16),
    Forbidden,
}

/// Sends `verb` on `res` named `name` (writes dry-run) and says whether RBAC let it through.
async fn attempt(client: &kube::Client, res: Res, verb: Verb, ns: Option<&str>, name: &str) -> Outcome {
    let api = api(client, res, ns);
    let dry_patch = PatchParams {
        dry_run: true,
        ..Default::default()
    };
    let label = Patch::Merge(json!({"metadata": {"labels": {"rbac-probe": "yes"}}}));
    let result: Result<u16, kube::Error> = match verb {
        Get => api.get(name).await.map(|_| 200),
        List => api.list(&ListParams::default().limit(1)).await.map(|_| 200),
        Watch => api.watch(&WatchParams::default().timeout(1), "0").await.map(|_| 200),
        Create => {
            let pp = PostParams {
                dry_run: true,
                ..Default::default()
            };
            api.create(&pp, &object(res, &format!("{name}-new"), ns.unwrap_or(NS)))
                .await
                .map(|_| 201)
        }
        Patch => api.patch(name, &dry_patch, &label).await.map(|_| 200),
        PatchSpec => {
            let spec = match res.2 {
                "MacBuild" => json!({"spec": {"cancelRequested": true}}),
                _ => json!({"spec": {"timeout": "1h"}}),
            };
            api.patch(name, &dry_patch, &Patch::Merge(spec)).await.map(|_| 200)
        }
        PatchStatus => api.patch_status(name, &dry_patch, &label).await.map(|_| 200),
        Update => {
            let pp = PostParams {
                dry_run: true,
                ..Default::default()
            };
            // Without a resourceVersion: an authorized replace answers 409/422, after RBAC.
            api.replace(name, &pp, &object(res, name, ns.unwrap_or(NS)))
                .await
                .map(|_| 200)
        }
        Delete => api
            .delete(
                name,
                &DeleteParams {
                    dry_run: true,
                    ..Default::default()
                },
            )
            .await
            .map(|_| 200),
    };
    match result {
        Ok(code) => Outcome::Allowed(code),
        Err(kube::Error::Api(s)) if s.code == 403 => Outcome::Forbidden,
        Err(kube::Error::Api(s)) => Outcome::Allowed(s.code),
        Err(e) => panic!("{verb:?} {} {name} in {ns:?}: not an API answer: {e}", res.3),
    }
}

/// `deploy/rbac.yaml` with its agent namespace `ci` rendered into [`NS`].
fn rendered_deploy_rbac() -> String {
    let text = std::fs::read_to_string(workspace().join("deploy/rbac.yaml")).unwrap();
    assert!(
        text.contains("namespace: ci\n"),
        "deploy/rbac.yaml no longer names its agent namespace `ci`"
    );
    text.replace("namespace: ci\n", &format!("namespace: {NS}\n"))
}

/// `tartan-agent rbac --token-secret` for `mac-a`: the token controller fills the Secret in, and
/// its token acts as mac-a's ServiceAccount (its own Lease yes, another agent's no), the way
/// docs/install-on-mac.md builds the agent's kubeconfig.
fn the_token_secret_authenticates_as_its_agent(cluster: &RealCluster) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let token = loop {
        let token = cluster
            .kubectl(
                &[
                    "-n",
                    NS,
                    "get",
                    "secret",
                    "tartan-agent-mac-a-token",
                    "-o",
                    "go-template={{if .data.token}}{{.data.token | base64decode}}{{end}}",
                ],
                None,
            )
            .unwrap();
        if !token.is_empty() {
            break token;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the token controller did not fill in Secret {NS}/tartan-agent-mac-a-token within 30 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    let can_i = |lease: &str| {
        let out = std::process::Command::new("kubectl")
            .args([
                "--server",
                cluster.api_url(),
                "--token",
                &token,
                "--certificate-authority",
            ])
            .arg(cluster.ca_file())
            .args(["-n", NS, "auth", "can-i", "patch", &format!("leases/{lease}")])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    assert_eq!(
        can_i("tartan-agent-mac-a"),
        "yes",
        "mac-a's token may renew its own Lease"
    );
    assert_eq!(
        can_i("tartan-agent-mac-b"),
        "no",
        "mac-a's token must not renew mac-b's Lease"
    );
}

/// `tartan-agent rbac ARGS` (the real binary).
fn agent_rbac(args: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tartan-agent"))
        .arg("rbac")
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "tartan-agent rbac {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn verb_name(v: Verb) -> &'static str {
    match v {
        Get => "get",
        List => "list",
        Watch => "watch",
        Create => "create",
        Patch => "patch (metadata)",
        PatchSpec => "patch (spec)",
        PatchStatus => "patch status",
        Delete => "delete",
        Update => "update",
    }
}

#[tokio::test]
async fn rbac_allows_every_call_of_the_code_and_refuses_the_rest() {
    let Some(cluster) = RealCluster::start("rbac_real").expect("the real cluster starts") else {
        return;
    };
    cluster.kubectl(&["create", "namespace", NS], None).unwrap();
    cluster.kubectl(&["create", "namespace", OTHER_NS], None).unwrap();
    cluster.kubectl(&["create", "namespace", "leases"], None).unwrap();
    for f in [workspace().join("deploy/crd.yaml"), tartan_testkit::customrun_crd()] {
        cluster.kubectl(&["apply", "-f", f.to_str().unwrap()], None).unwrap();
    }
    for crd in ["macbuilds.tartan.dev", "customruns.tekton.dev"] {
        cluster
            .kubectl(
                &[
                    "wait",
                    "--for=condition=Established",
                    "--timeout=60s",
                    &format!("crd/{crd}"),
                ],
                None,
            )
            .unwrap();
    }
    cluster.apply(&rendered_deploy_rbac()).unwrap();
    cluster
        .apply(&agent_rbac(&[
            "--agent-id",
            "mac-a",
            "--namespace",
            NS,
            "--token-secret",
        ]))
        .unwrap();
    if cluster.has_controller_manager() {
        the_token_secret_authenticates_as_its_agent(&cluster);
    } else {
        tartan_testkit::real::skip(
            tartan_testkit::real::NO_CONTROLLER_MANAGER,
            "rbac_real: the token Secret's token (the token controller fills it in)",
        );
    }
    cluster
        .apply(&agent_rbac(&["--agent-id", "mac-b", "--namespace", NS]))
        .unwrap();
    cluster
        .apply(&agent_rbac(&[
            "--agent-id",
            "mac-c",
            "--namespace",
            NS,
            "--lease-namespace",
            "leases",
        ]))
        .unwrap();

    // The objects the requests name, created as admin.
    let admin = cluster.admin_client().await.unwrap();
    let pp = PostParams::default();
    for (res, name, ns) in [
        (MACBUILD, "probe", NS),
        (CUSTOMRUN, "probe", NS),
        (SECRET, "probe", NS),
        (SECRET, "probe", OTHER_NS),
        (LEASE, "tartan-agent-mac-a", NS),
        (LEASE, "tartan-agent-mac-b", NS),
        (LEASE, "tartan-agent-mac-c", "leases"),
        (LEASE, "tartan-agent-shared", NS),
        (LEASE, LEADER_LEASE, CONTROLLER_NS),
        (LEASE, "not-the-leader-lease", CONTROLLER_NS),
    ] {
        api(&admin, res, Some(ns))
            .create(&pp, &object(res, name, ns))
            .await
            .unwrap();
    }
    api(&admin, EVENT, Some(NS))
        .create(&pp, &object(EVENT, "probe", NS))
        .await
        .unwrap();

    let controller = cluster.sa_client("tartan-system", "tartan-controller").await.unwrap();
    // The agent identities: the shared one of deploy/rbac.yaml, and per-agent ones.
    let agents = [
        (
            "tartan-agent (deploy/rbac.yaml)",
            cluster.sa_client(NS, "tartan-agent").await.unwrap(),
            "tartan-agent-shared",
            NS,
        ),
        (
            "tartan-agent-mac-a",
            cluster.sa_client(NS, "tartan-agent-mac-a").await.unwrap(),
            "tartan-agent-mac-a",
            NS,
        ),
        (
            "tartan-agent-mac-c",
            cluster.sa_client(NS, "tartan-agent-mac-c").await.unwrap(),
            "tartan-agent-mac-c",
            "leases",
        ),
    ];

    let mut report = Vec::new();
    let mut failures = Vec::new();
    let mut seen = BTreeSet::new();
    for call in CALLS.iter().filter(|c| c.res != SECRET) {
        let runs: Vec<(&str, &kube::Client, &str, &str)> = match call.who {
            Controller => vec![("tartan-controller", &controller, "probe", NS)],
            Agent => agents
                .iter()
                .map(|(who, client, lease, lease_ns)| (*who, client, *lease, *lease_ns))
                .collect(),
        };
        for (who, client, lease, lease_ns) in runs {
            let (name, ns) = if call.file == LEADER_FILE {
                (LEADER_LEASE, CONTROLLER_NS)
            } else if call.res == LEASE {
                (lease, lease_ns)
            } else {
                ("probe", NS)
            };
            if !seen.insert((who, call.res.3, verb_name(call.verb), call.scope as u8, name, ns)) {
                continue;
            }
            let scope_ns = match call.scope {
                Namespaced => Some(ns),
                Cluster => None,
            };
            let got = attempt(client, call.res, call.verb, scope_ns, name).await;
            let where_ = scope_ns.map_or("all namespaces".to_string(), |n| n.to_string());
            let line = format!(
                "{who:32} {:16} {:10} {name:20} {where_:16} {got:?}",
                verb_name(call.verb),
                call.res.3
            );
            if got == Outcome::Forbidden {
                failures.push(format!("needed by {} but forbidden: {line}", call.file));
            }
            report.push(format!("allow  {line}"));
        }
    }

    // (who, resource, verb, namespace, name, why, outcome)
    let mut refusals = Vec::new();
    for n in NEVER {
        let clients: Vec<(&str, &kube::Client)> = match n.who {
            Controller => vec![("tartan-controller", &controller)],
            Agent => agents.iter().map(|(who, client, _, _)| (*who, client)).collect(),
        };
        for (who, client) in clients {
            let got = attempt(client, n.res, n.verb, Some(n.ns), "probe").await;
            refusals.push((who, n.res, n.verb, n.ns, "probe", n.why, got));
        }
    }
    // Per-agent ServiceAccounts: never write another agent's Lease, nor get it by name (they are
    // read only through the list and watch).
    let (_, mac_a, _, _) = &agents[1];
    let (_, mac_c, _, _) = &agents[2];
    for (who, client, lease, ns) in [
        ("tartan-agent-mac-a", mac_a, "tartan-agent-mac-b", NS),
        ("tartan-agent-mac-a", mac_a, "tartan-agent-mac-c", "leases"),
        ("tartan-agent-mac-c", mac_c, "tartan-agent-mac-a", NS),
    ] {
        for verb in [Patch, Get, Delete] {
            let got = attempt(client, LEASE, verb, Some(ns), lease).await;
            refusals.push((who, LEASE, verb, ns, lease, "only its own Lease", got));
        }
    }
    // The controller updates its leader Lease and no other (resourceNames).
    for (lease, ns) in [("not-the-leader-lease", CONTROLLER_NS), ("tartan-agent-mac-a", NS)] {
        let got = attempt(&controller, LEASE, Update, Some(ns), lease).await;
        refusals.push((
            "tartan-controller",
            LEASE,
            Update,
            ns,
            lease,
            "only its leader Lease",
            got,
        ));
    }
    for (who, res, verb, ns, name, why, got) in refusals {
        let line = format!("{who:32} {:16} {:10} {name:20} {ns:16} {got:?}", verb_name(verb), res.3);
        if got != Outcome::Forbidden {
            failures.push(format!("must be refused ({why}): {line}"));
        }
        report.push(format!("deny   {line}"));
    }

    // What RBAC cannot refuse, shown so that the gap stays visible: the agent's patch of the
    // MacBuild (finalizer and label) cannot be kept off the spec without an admission policy.
    for (who, client, _, _) in &agents {
        let got = attempt(client, MACBUILD, PatchSpec, Some(NS), "probe").await;
        report.push(format!(
            "gap    {who:32} {:16} {:10} {:20} {NS:16} {got:?} (RBAC cannot tell a spec patch from a finalizer patch)",
            verb_name(PatchSpec),
            "macbuilds",
            "probe"
        ));
    }

    // An agent given Secrets (by --secret and by its config's [secrets] allowed) may get exactly
    // those, in their namespace; never another, never list or watch. Its own reader (the code
    // the agent runs) tells a Secret that is missing from one it may not read.
    let config_dir = tempfile::tempdir().unwrap();
    let config = config_dir.path().join("agent.toml");
    std::fs::write(
        &config,
        format!(
            "agent_id = \"mac-s\"\nstate_dir = \"/tmp/tartan-rbac-test\"\n[secrets]\nallowed = [\"{NS}/from-config\"]\n"
        ),
    )
    .unwrap();
    cluster
        .apply(&agent_rbac(&[
            "--agent-id",
            "mac-s",
            "--namespace",
            NS,
            "--secret",
            &format!("{NS}/allowed"),
            "--secret",
            &format!("{NS}/allowed-but-absent"),
            "--config",
            config.to_str().unwrap(),
        ]))
        .unwrap();
    for (name, ns) in [("allowed", NS), ("from-config", NS), ("allowed", OTHER_NS)] {
        api(&admin, SECRET, Some(ns))
            .create(&pp, &object(SECRET, name, ns))
            .await
            .unwrap();
    }
    let mac_s = cluster.sa_client(NS, "tartan-agent-mac-s").await.unwrap();
    for (verb, ns, name, allowed) in [
        (Get, NS, "allowed", true),
        (Get, NS, "from-config", true),
        (Get, NS, "probe", false),
        (List, NS, "allowed", false),
        (Watch, NS, "allowed", false),
        (Get, OTHER_NS, "allowed", false),
        (Delete, NS, "allowed", false),
    ] {
        let got = attempt(&mac_s, SECRET, verb, Some(ns), name).await;
        let line = format!(
            "{:32} {:16} {:10} {name:20} {ns:16} {got:?}",
            "tartan-agent-mac-s",
            verb_name(verb),
            "secrets"
        );
        match (allowed, got) {
            (true, Outcome::Allowed(200)) | (false, Outcome::Forbidden) => {}
            _ => failures.push(format!("secret access wrong (allowed: {allowed}): {line}")),
        }
        report.push(format!("{}  {line}", if allowed { "allow" } else { "deny " }));
    }
    {
        use tartan_agent::host::env::{KubeSecrets, SecretReadError, SecretSource};
        let reader = KubeSecrets {
            client: mac_s.clone(),
            timeout: std::time::Duration::from_secs(10),
        };
        let read = reader.get(NS, "allowed").await;
        assert!(matches!(read, Ok(Some(_))), "{read:?}");
        assert_eq!(
            reader.get(NS, "allowed-but-absent").await,
            Ok(None),
            "a missing allowed Secret reads as missing"
        );
        let refused = reader.get(NS, "probe").await;
        assert!(matches!(refused, Err(SecretReadError::Forbidden(_))), "{refused:?}");
    }

    println!(
        "RBAC on the real apiserver ({}):\n{}",
        cluster.api_url(),
        report.join("\n")
    );
    assert!(
        failures.is_empty(),
        "RBAC is wrong:\n{}\n\nfull table:\n{}",
        failures.join("\n"),
        report.join("\n")
    );
    // A cross-check of one denial through the authorizer itself (a supplement, not the proof).
    let can_i = std::process::Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(cluster.admin_kubeconfig())
        .args(["auth", "can-i", "patch", "leases/tartan-agent-mac-b", "-n", NS, "--as"])
        .arg(format!("system:serviceaccount:{NS}:tartan-agent-mac-a"))
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&can_i.stdout).trim(),
        "no",
        "kubectl auth can-i: {can_i:?}"
    );
}

/// `tartan-agent doctor` asks the API server about each kind of request the agent makes
/// (`tartan_agent::doctor::AGENT_API_CALLS`): the same set as the agent's rows of [`CALLS`], which
/// [`calls_table_matches_the_code`] keeps in step with the code.
#[test]
fn doctor_asks_about_every_call_of_the_agent() {
    let from_calls: BTreeSet<(String, String, String, String)> = CALLS
        .iter()
        .filter(|c| c.who == Agent)
        .map(|c| {
            let (verb, sub) = match c.verb {
                Get => ("get", ""),
                List => ("list", ""),
                Watch => ("watch", ""),
                Create => ("create", ""),
                Patch => ("patch", ""),
                PatchStatus => ("patch", "status"),
                other => panic!("doctor has no review for the agent's {}", verb_name(other)),
            };
            (
                c.res.0.to_string(),
                c.res.3.to_string(),
                sub.to_string(),
                verb.to_string(),
            )
        })
        .collect();
    let from_doctor: BTreeSet<(String, String, String, String)> = tartan_agent::doctor::AGENT_API_CALLS
        .iter()
        .map(|(g, r, s, v, _)| (g.to_string(), r.to_string(), s.to_string(), v.to_string()))
        .collect();
    assert_eq!(from_doctor, from_calls);
}
