//! Legacy discovery documents (`/api`, `/apis`, `/apis/<group>`, resource lists) and `/version`.

use std::cmp::Ordering;
use std::sync::Arc;

use serde_json::{Value, json};

use super::types::ResourceType;

pub fn version() -> Value {
    json!({
        "major": "1",
        "minor": "33",
        "gitVersion": "v1.33.0-tartan-emulator",
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2025-01-01T00:00:00Z",
        "goVersion": "go1.24.0",
        "compiler": "gc",
        "platform": "linux/amd64"
    })
}

pub fn api_versions(addr: &str) -> Value {
    json!({
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": addr}]
    })
}

/// Kubernetes version priority: GA > beta > alpha, higher numbers first, then others alphabetically.
pub fn version_order(a: &str, b: &str) -> Ordering {
    fn key(v: &str) -> (u8, i64, i64, String) {
        let parse = |s: &str| -> Option<(i64, u8, i64)> {
            let rest = s.strip_prefix('v')?;
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            let major = digits.parse().ok()?;
            let tail = &rest[digits.len()..];
            if tail.is_empty() {
                return Some((major, 3, 0));
            }
            let (level, n) = if let Some(n) = tail.strip_prefix("beta") {
                (2, n)
            } else if let Some(n) = tail.strip_prefix("alpha") {
                (1, n)
            } else {
                return None;
            };
            Some((major, level, n.parse().ok()?))
        };
        match parse(v) {
            Some((major, level, minor)) => (level, major, minor, String::new()),
            None => (0, 0, 0, v.to_string()),
        }
    }
    let (ka, kb) = (key(a), key(b));
    kb.0.cmp(&ka.0)
        .then(kb.1.cmp(&ka.1))
        .then(kb.2.cmp(&ka.2))
        .then(ka.3.cmp(&kb.3))
}

fn versions_of(types: &[Arc<ResourceType>], group: &str) -> Vec<String> {
    let mut vs: Vec<String> = types
        .iter()
        .filter(|t| t.group == group)
        .map(|t| t.version.clone())
        .collect();
    vs.sort_by(|a, b| version_order(a, b));
    vs.dedup();
    vs
}

fn group_doc(types: &[Arc<ResourceType>], group: &str) -> Value {
    let vs = versions_of(types, group);
    let versions: Vec<Value> = vs
        .iter()
        .map(|v| json!({"groupVersion": format!("{group}/{v}"), "version": v}))
        .collect();
    json!({
        "name": group,
        "versions": versions,
        "preferredVersion": versions.first().cloned().unwrap_or_default()
    })
}

pub fn group_list(types: &[Arc<ResourceType>]) -> Value {
    let mut groups: Vec<&str> = Vec::new();
    for t in types {
        if !t.group.is_empty() && !groups.contains(&t.group.as_str()) {
            groups.push(&t.group);
        }
    }
    let docs: Vec<Value> = groups.iter().map(|g| group_doc(types, g)).collect();
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": docs})
}

pub fn group(types: &[Arc<ResourceType>], group: &str) -> Option<Value> {
    if !types.iter().any(|t| t.group == group) {
        return None;
    }
    let mut g = group_doc(types, group);
    g["kind"] = json!("APIGroup");
    g["apiVersion"] = json!("v1");
    Some(g)
}

pub fn resource_list(types: &[Arc<ResourceType>], group: &str, version: &str) -> Option<Value> {
    let mut resources = Vec::new();
    for t in types.iter().filter(|t| t.group == group && t.version == version) {
        let mut r = json!({
            "name": t.plural,
            "singularName": t.singular,
            "namespaced": t.namespaced,
            "kind": t.kind,
            "verbs": t.verbs(),
        });
        if !t.short_names.is_empty() {
            r["shortNames"] = json!(t.short_names);
        }
        if !t.categories.is_empty() {
            r["categories"] = json!(t.categories);
        }
        resources.push(r);
        if t.status_subresource {
            resources.push(json!({
                "name": format!("{}/status", t.plural),
                "singularName": "",
                "namespaced": t.namespaced,
                "kind": t.kind,
                "verbs": ["get", "patch", "update"],
            }));
        }
    }
    if resources.is_empty() {
        return None;
    }
    let gv = if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    };
    Some(json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kube_version_priority() {
        let mut v = vec!["v1alpha1", "v2", "v1beta2", "v1", "v1beta1", "foo"];
        v.sort_by(|a, b| version_order(a, b));
        assert_eq!(v, vec!["v2", "v1", "v1beta2", "v1beta1", "v1alpha1", "foo"]);
    }
}
