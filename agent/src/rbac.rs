//! `tartan-agent rbac`: the Kubernetes RBAC of one agent, as YAML for `kubectl apply -f -`.
//!
//! One ServiceAccount per agent (per Mac), so that RBAC can tell agents apart: each may renew only
//! its own Lease `tartan-agent-<agent id>` (a rule with `resourceNames`), which a ServiceAccount
//! shared by several agents cannot express. RBAC cannot limit `create` by name (the name is not
//! part of the request it authorizes), so `create` on Leases stays unrestricted in the Lease
//! namespace; once an agent's Lease exists, only that agent can renew it.
//!
//! What each rule is for (the calls are listed in `agent/tests/rbac_real.rs`, which checks this
//! output on a real kube-apiserver):
//! - ClusterRole `tartan-agent-watch` (shared by all agents, also in `deploy/rbac.yaml`): get, list
//!   and watch MacBuilds in every namespace — needed by an agent whose `namespaces` is empty, which
//!   watches MacBuilds cluster-wide (`runtime/mod.rs`); one that lists its namespaces watches each
//!   of them and needs only the namespaced Role (the binding then only grants reading);
//! - in each served namespace: patch MacBuilds (finalizer and agent label, `cluster/claim.rs`),
//!   patch `macbuilds/status` (claim and delivery), create `events.k8s.io` Events (`cluster/events.rs`);
//! - in the Lease namespace: create Leases; get and patch its own Lease (`cluster/lease.rs`); list
//!   and watch all Leases, read-only (`runtime/mod.rs`: whether another agent could take a build,
//!   `cluster/placement.rs`);
//! - only for the Secrets the operator allows (`--secret NS/NAME`, or `[secrets] allowed` of the
//!   agent config given with `--config`): `get` on exactly those names (`resourceNames`) in their
//!   namespace (`host/env.rs` reads them at attempt start for `spec.env`).
//!
//! Never: create or delete MacBuilds, anything on CustomRuns, list, watch or read any other
//! Secret, write (or get by name) other agents' Leases.

use std::fmt::Write as _;

use anyhow::bail;

use crate::cluster::lease::lease_name;
use crate::config::check_agent_id;

/// The ClusterRole every agent's ServiceAccount is bound to (defined here and in `deploy/rbac.yaml`).
pub const WATCH_CLUSTER_ROLE: &str = "tartan-agent-watch";

#[derive(clap::Args, Debug)]
pub struct RbacArgs {
    /// The agent's id (`agent_id` in its config; its Lease is `tartan-agent-<ID>`).
    #[arg(long, value_name = "ID")]
    pub agent_id: String,
    /// A namespace whose MacBuilds the agent serves (repeat for several; the ServiceAccount lives
    /// in the first).
    #[arg(long = "namespace", value_name = "NS", required = true)]
    pub namespaces: Vec<String>,
    /// The namespace of the agent's Lease (`lease_namespace` in its config) [default: the first
    /// --namespace]
    #[arg(long, value_name = "NS")]
    pub lease_namespace: Option<String>,
    /// Also print a long-lived token Secret `tartan-agent-<ID>-token` for the ServiceAccount
    /// (Kubernetes fills in its token; the agent's kubeconfig uses it, docs/install-on-mac.md).
    #[arg(long)]
    pub token_secret: bool,
    /// A Secret builds may read into their environment, as NAMESPACE/NAME (repeat for several);
    /// its namespace must be a --namespace. Grants `get` on that Secret only.
    #[arg(long = "secret", value_name = "NS/NAME")]
    pub secrets: Vec<String>,
    /// The agent's config file: its `[secrets] allowed` list is added to --secret, so the Role
    /// and the config agree.
    #[arg(long, value_name = "FILE")]
    pub config: Option<std::path::PathBuf>,
}

/// The name of the agent's token Secret (`--token-secret`).
pub fn token_secret_name(agent_id: &str) -> String {
    format!("{}-token", service_account(agent_id))
}

/// A `kubernetes.io/service-account-token` Secret: since Kubernetes 1.24 one is no longer made
/// for each ServiceAccount, and the agent needs a token that outlives a TokenRequest's hour.
fn token_secret(agent_id: &str, namespace: &str) -> String {
    format!(
        "\
---
apiVersion: v1
kind: Secret
metadata:
  name: {}
  namespace: {namespace}
  annotations:
    kubernetes.io/service-account.name: {}
type: kubernetes.io/service-account-token
",
        token_secret_name(agent_id),
        service_account(agent_id)
    )
}

/// The ServiceAccount name of `agent_id`.
pub fn service_account(agent_id: &str) -> String {
    format!("tartan-agent-{agent_id}")
}

fn check_namespace(ns: &str) -> anyhow::Result<()> {
    let ok = !ns.is_empty()
        && ns.len() <= 63
        && ns.bytes().all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'-'))
        && !ns.starts_with('-')
        && !ns.ends_with('-');
    if !ok {
        bail!(
            "{ns:?} is not a namespace name: use 1 to 63 characters of a-z, 0-9 and '-', starting and ending with a \
             letter or digit"
        );
    }
    Ok(())
}

const MACBUILD_RULES: &str = "\
- apiGroups: [\"tartan.dev\"]
  resources: [\"macbuilds\"]
  verbs: [\"get\", \"list\", \"watch\", \"patch\"]
- apiGroups: [\"tartan.dev\"]
  resources: [\"macbuilds/status\"]
  verbs: [\"patch\"]
- apiGroups: [\"events.k8s.io\"]
  resources: [\"events\"]
  verbs: [\"create\"]
";

fn lease_rules(agent_id: &str) -> String {
    format!(
        "\
# RBAC cannot restrict create by name; once the Lease exists only this agent can renew it.
- apiGroups: [\"coordination.k8s.io\"]
  resources: [\"leases\"]
  verbs: [\"create\"]
- apiGroups: [\"coordination.k8s.io\"]
  resources: [\"leases\"]
  resourceNames: [\"{}\"]
  verbs: [\"get\", \"patch\"]
# Every agent's Lease, read-only: what other agents could take a build (their claim waits).
- apiGroups: [\"coordination.k8s.io\"]
  resources: [\"leases\"]
  verbs: [\"list\", \"watch\"]
",
        lease_name(agent_id)
    )
}

fn secret_rules(names: &[&str]) -> String {
    let quoted: Vec<String> = names.iter().map(|n| format!("\"{n}\"")).collect();
    format!(
        "\
# Only the Secrets the operator allows ([secrets] allowed), by name: never list, watch or others.
- apiGroups: [\"\"]
  resources: [\"secrets\"]
  resourceNames: [{}]
  verbs: [\"get\"]
",
        quoted.join(", ")
    )
}

/// The YAML documents for one agent: ServiceAccount, the shared watch ClusterRole and its
/// binding, and a Role + RoleBinding in each served namespace and in the Lease namespace; the
/// Role of a namespace with allowed `secrets` (`namespace/name`) may `get` those by name.
pub fn render(
    agent_id: &str,
    namespaces: &[String],
    lease_namespace: Option<&str>,
    secrets: &[String],
) -> anyhow::Result<String> {
    check_agent_id(agent_id).map_err(|why| anyhow::anyhow!("--agent-id: {why}"))?;
    let Some(home) = namespaces.first() else {
        bail!("no --namespace given: name the namespace(s) whose MacBuilds the agent serves");
    };
    for ns in namespaces.iter().map(String::as_str).chain(lease_namespace) {
        check_namespace(ns)?;
    }
    let lease_ns = lease_namespace.unwrap_or(home);
    let mut allowed: std::collections::BTreeMap<&str, Vec<&str>> = std::collections::BTreeMap::new();
    for entry in secrets {
        let (ns, name) =
            crate::config::check_allowed_secret(entry).map_err(|why| anyhow::anyhow!("--secret: {why}"))?;
        if !namespaces.iter().any(|n| n == ns) {
            bail!(
                "--secret {entry}: namespace {ns:?} is not a --namespace; a build reads only Secrets of its own namespace"
            );
        }
        let names = allowed.entry(ns).or_default();
        if !names.contains(&name) {
            names.push(name);
        }
    }
    let sa = service_account(agent_id);
    let mut out = String::new();
    let _ = write!(
        out,
        "\
# RBAC of Tartan agent {agent_id:?} (generated by `tartan-agent rbac`); apply with kubectl apply -f -.
apiVersion: v1
kind: ServiceAccount
metadata:
  name: {sa}
  namespace: {home}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: {WATCH_CLUSTER_ROLE}
rules:
- apiGroups: [\"tartan.dev\"]
  resources: [\"macbuilds\"]
  verbs: [\"get\", \"list\", \"watch\"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: {sa}-watch
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: {WATCH_CLUSTER_ROLE}
subjects:
- kind: ServiceAccount
  name: {sa}
  namespace: {home}
"
    );
    let mut role_namespaces: Vec<&str> = Vec::new();
    for ns in namespaces.iter().map(String::as_str).chain([lease_ns]) {
        if !role_namespaces.contains(&ns) {
            role_namespaces.push(ns);
        }
    }
    for ns in role_namespaces {
        let mut rules = String::new();
        if namespaces.iter().any(|n| n == ns) {
            rules.push_str(MACBUILD_RULES);
        }
        if ns == lease_ns {
            rules.push_str(&lease_rules(agent_id));
        }
        if let Some(names) = allowed.get(ns) {
            rules.push_str(&secret_rules(names));
        }
        let _ = write!(
            out,
            "\
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata:
  name: {sa}
  namespace: {ns}
rules:
{rules}---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata:
  name: {sa}
  namespace: {ns}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: Role
  name: {sa}
subjects:
- kind: ServiceAccount
  name: {sa}
  namespace: {home}
"
        );
    }
    Ok(out)
}

pub fn run(args: RbacArgs) -> anyhow::Result<()> {
    let mut secrets = args.secrets.clone();
    if let Some(path) = &args.config {
        let config = crate::config::Config::load(path)?;
        secrets.extend(config.secrets.allowed);
    }
    let mut yaml = render(
        &args.agent_id,
        &args.namespaces,
        args.lease_namespace.as_deref(),
        &secrets,
    )?;
    if args.token_secret {
        yaml.push_str(&token_secret(&args.agent_id, &args.namespaces[0]));
    }
    print!("{yaml}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn docs(yaml: &str) -> Vec<Value> {
        serde_saphyr::from_multiple::<Value>(yaml).unwrap_or_else(|e| panic!("not YAML: {e}\n{yaml}"))
    }

    fn find<'a>(docs: &'a [Value], kind: &str, name: &str, ns: Option<&str>) -> &'a Value {
        docs.iter()
            .find(|d| {
                d["kind"] == kind
                    && d["metadata"]["name"] == name
                    && ns.is_none_or(|ns| d["metadata"]["namespace"] == ns)
            })
            .unwrap_or_else(|| panic!("no {kind} {name} in {ns:?}: {docs:#?}"))
    }

    #[test]
    fn one_namespace_gets_one_role_with_the_own_lease_only() {
        let yaml = render("mac-mini-07", &["ci".into()], None, &[]).unwrap();
        let d = docs(&yaml);
        assert_eq!(
            d.len(),
            5,
            "SA, ClusterRole, ClusterRoleBinding, Role, RoleBinding: {yaml}"
        );
        let sa = find(&d, "ServiceAccount", "tartan-agent-mac-mini-07", Some("ci"));
        assert_eq!(sa["apiVersion"], "v1");
        let role = find(&d, "Role", "tartan-agent-mac-mini-07", Some("ci"));
        assert_eq!(
            role["rules"],
            json!([
                {"apiGroups": ["tartan.dev"], "resources": ["macbuilds"], "verbs": ["get", "list", "watch", "patch"]},
                {"apiGroups": ["tartan.dev"], "resources": ["macbuilds/status"], "verbs": ["patch"]},
                {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create"]},
                {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
                {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                 "resourceNames": ["tartan-agent-mac-mini-07"], "verbs": ["get", "patch"]},
                {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["list", "watch"]},
            ])
        );
        let rb = find(&d, "RoleBinding", "tartan-agent-mac-mini-07", Some("ci"));
        assert_eq!(rb["roleRef"]["name"], "tartan-agent-mac-mini-07");
        assert_eq!(
            rb["subjects"],
            json!([{"kind": "ServiceAccount", "name": "tartan-agent-mac-mini-07", "namespace": "ci"}])
        );
        let crb = find(&d, "ClusterRoleBinding", "tartan-agent-mac-mini-07-watch", None);
        assert_eq!(crb["roleRef"]["name"], WATCH_CLUSTER_ROLE);
        assert_eq!(crb["subjects"], rb["subjects"]);
    }

    #[test]
    fn a_separate_lease_namespace_gets_a_lease_only_role() {
        let yaml = render("m1", &["ci".into(), "release".into()], Some("tartan-system"), &[]).unwrap();
        let d = docs(&yaml);
        for ns in ["ci", "release"] {
            let role = find(&d, "Role", "tartan-agent-m1", Some(ns));
            let rules = role["rules"].as_array().unwrap();
            assert_eq!(rules.len(), 3, "MacBuild and event rules only in {ns}: {rules:?}");
            assert!(rules.iter().all(|r| r["apiGroups"][0] != "coordination.k8s.io"));
            let rb = find(&d, "RoleBinding", "tartan-agent-m1", Some(ns));
            assert_eq!(
                rb["subjects"][0]["namespace"], "ci",
                "the ServiceAccount lives in the first namespace"
            );
        }
        let role = find(&d, "Role", "tartan-agent-m1", Some("tartan-system"));
        let rules = role["rules"].as_array().unwrap();
        assert_eq!(rules.len(), 3, "{rules:?}");
        assert_eq!(rules[1]["resourceNames"], json!(["tartan-agent-m1"]));
        assert_eq!(rules[2]["verbs"], json!(["list", "watch"]));
        find(&d, "RoleBinding", "tartan-agent-m1", Some("tartan-system"));
    }

    #[test]
    fn the_watch_cluster_role_is_the_one_in_deploy() {
        let deploy = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/rbac.yaml")).unwrap();
        let ours = docs(&render("m1", &["ci".into()], None, &[]).unwrap());
        let theirs = serde_saphyr::from_multiple::<Value>(&deploy).unwrap();
        let a = find(&ours, "ClusterRole", WATCH_CLUSTER_ROLE, None);
        let b = find(&theirs, "ClusterRole", WATCH_CLUSTER_ROLE, None);
        assert_eq!(
            a["rules"], b["rules"],
            "deploy/rbac.yaml and `tartan-agent rbac` must agree"
        );
    }

    #[test]
    fn the_token_secret_belongs_to_the_agent_s_service_account_in_its_namespace() {
        let yaml = render("m1", &["ci".into()], None, &[]).unwrap() + &token_secret("m1", "ci");
        let d = docs(&yaml);
        let secret = find(&d, "Secret", "tartan-agent-m1-token", Some("ci"));
        assert_eq!(secret["type"], "kubernetes.io/service-account-token");
        let sa = find(&d, "ServiceAccount", "tartan-agent-m1", Some("ci"));
        assert_eq!(
            secret["metadata"]["annotations"]["kubernetes.io/service-account.name"],
            sa["metadata"]["name"]
        );
    }

    #[test]
    fn allowed_secrets_get_a_get_rule_by_name_in_their_namespace_only() {
        let secrets = [
            "ci/asc-key".to_string(),
            "ci/signing".into(),
            "release/asc-key".into(),
            "ci/asc-key".into(),
        ];
        let yaml = render("m1", &["ci".into(), "release".into()], None, &secrets).unwrap();
        let d = docs(&yaml);
        let rule = |ns: &str| {
            let role = find(&d, "Role", "tartan-agent-m1", Some(ns));
            role["rules"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|r| r["resources"] == json!(["secrets"]))
                .cloned()
                .collect::<Vec<_>>()
        };
        assert_eq!(
            rule("ci"),
            vec![
                json!({"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["asc-key", "signing"], "verbs": ["get"]})
            ]
        );
        assert_eq!(rule("release")[0]["resourceNames"], json!(["asc-key"]));
        // No rule anywhere names secrets without resourceNames, or lists or watches them.
        for doc in &d {
            for r in doc["rules"].as_array().into_iter().flatten() {
                if r["resources"].as_array().unwrap().iter().any(|x| x == "secrets") {
                    assert!(r["resourceNames"].is_array() && r["verbs"] == json!(["get"]), "{r}");
                }
            }
        }
        let e = render("m1", &["ci".into()], None, &["prod/x".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"prod\" is not a --namespace"), "{e}");
        let e = render("m1", &["ci".into()], None, &["asc-key".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--secret") && e.contains("not namespace/name"), "{e}");
        let e = render("m1", &["ci".into()], None, &["ci/Bad_Name".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("RFC 1123"), "{e}");
    }

    #[test]
    fn bad_names_are_refused_with_the_flag_named() {
        let e = render("Mac_Mini", &["ci".into()], None, &[]).unwrap_err().to_string();
        assert!(e.contains("--agent-id") && e.contains("Mac_Mini"), "{e}");
        let e = render("m1", &["CI".into()], None, &[]).unwrap_err().to_string();
        assert!(e.contains("\"CI\" is not a namespace name"), "{e}");
        let e = render("m1", &["ci".into()], Some(""), &[]).unwrap_err().to_string();
        assert!(e.contains("not a namespace name"), "{e}");
        let e = render("m1", &[], None, &[]).unwrap_err().to_string();
        assert!(e.contains("--namespace"), "{e}");
    }
}
