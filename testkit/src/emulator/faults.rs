//! Injectable faults: deny rules standing in for a ValidatingAdmissionPolicy, unavailability and latency.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Whether the API answers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Availability {
    /// Serving normally.
    #[default]
    Up,
    /// Every API request gets `503 ServiceUnavailable` (the `/emulator` control endpoints still work).
    Unavailable,
    /// The listening socket is closed and open connections (including watches) are dropped, so
    /// clients see "connection refused". Over HTTP, use `forMs` or the control port to come back.
    Refuse,
}

/// Which object a predicate looks at, as in a ValidatingAdmissionPolicy's CEL.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Target {
    /// The object after the write (`object`); absent for DELETE.
    #[default]
    Object,
    /// The stored object before the write (`oldObject`); absent for CREATE.
    OldObject,
}

/// A test on one dotted field path, e.g. `status.phase in [Succeeded, Failed]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Predicate {
    #[serde(default)]
    pub target: Target,
    /// Dotted path such as `status.phase` or `metadata.labels.app`.
    pub path: String,
    pub op: PredicateOp,
    #[serde(default)]
    pub values: Vec<Value>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum PredicateOp {
    In,
    NotIn,
    Exists,
    NotExists,
}

impl Predicate {
    pub fn matches(&self, object: Option<&Value>, old: Option<&Value>) -> bool {
        let Some(obj) = (match self.target {
            Target::Object => object,
            Target::OldObject => old,
        }) else {
            return false;
        };
        let mut cur = Some(obj);
        for seg in self.path.split('.') {
            cur = cur.and_then(|c| c.get(seg));
        }
        let present = cur.is_some_and(|v| !v.is_null());
        match self.op {
            PredicateOp::Exists => present,
            PredicateOp::NotExists => !present,
            PredicateOp::In => present && self.values.iter().any(|v| Some(v) == cur),
            PredicateOp::NotIn => !self.values.iter().any(|v| Some(v) == cur),
        }
    }
}

/// A rule that refuses matching writes the way a ValidatingAdmissionPolicy with `validationActions: [Deny]` does.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DenyRule {
    /// Policy name quoted in the message, e.g. `mac-ci-deny-terminal-status`.
    pub policy: String,
    /// Binding name; defaults to the policy name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub binding: Option<String>,
    /// Admission operations: `CREATE`, `UPDATE` (PUT and PATCH), `DELETE`; empty = all.
    #[serde(default)]
    pub operations: Vec<String>,
    /// API group; `None` = any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Resource plural, e.g. `macbuilds`; `None` = any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource: Option<String>,
    /// `Some("status")` = only the status subresource, `Some("")` = only the main resource, `None` = both.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subresource: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// All must hold for the rule to deny.
    #[serde(default)]
    pub when: Vec<Predicate>,
    /// The validation's message; defaults to `failed expression: <rule>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// `Invalid` (422, the VAP default) or `Forbidden` (403).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl DenyRule {
    pub fn new(policy: impl Into<String>) -> Self {
        DenyRule {
            policy: policy.into(),
            binding: None,
            operations: vec![],
            group: None,
            resource: None,
            subresource: None,
            namespace: None,
            name: None,
            when: vec![],
            message: None,
            reason: None,
        }
    }

    pub fn operations(mut self, ops: &[&str]) -> Self {
        self.operations = ops.iter().map(|s| s.to_uppercase()).collect();
        self
    }

    pub fn resource(mut self, group: &str, plural: &str) -> Self {
        self.group = Some(group.into());
        self.resource = Some(plural.into());
        self
    }

    pub fn subresource(mut self, sub: &str) -> Self {
        self.subresource = Some(sub.into());
        self
    }

    pub fn object(mut self, namespace: &str, name: &str) -> Self {
        self.namespace = Some(namespace.into());
        self.name = Some(name.into());
        self
    }

    pub fn when(mut self, target: Target, path: &str, op: PredicateOp, values: &[Value]) -> Self {
        self.when.push(Predicate {
            target,
            path: path.into(),
            op,
            values: values.to_vec(),
        });
        self
    }

    pub fn message(mut self, m: impl Into<String>) -> Self {
        self.message = Some(m.into());
        self
    }

    pub fn forbidden(mut self) -> Self {
        self.reason = Some("Forbidden".into());
        self
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn applies(
        &self,
        operation: &str,
        group: &str,
        plural: &str,
        subresource: &str,
        namespace: &str,
        name: &str,
        object: Option<&Value>,
        old: Option<&Value>,
    ) -> bool {
        let op_ok = self.operations.is_empty()
            || self
                .operations
                .iter()
                .any(|o| o.eq_ignore_ascii_case(operation) || (o == "PATCH" && operation == "UPDATE"));
        op_ok
            && self.group.as_deref().is_none_or(|g| g == group)
            && self.resource.as_deref().is_none_or(|r| r == plural)
            && self.subresource.as_deref().is_none_or(|s| s == subresource)
            && self.namespace.as_deref().is_none_or(|n| n == namespace)
            && self.name.as_deref().is_none_or(|n| n == name)
            && self.when.iter().all(|p| p.matches(object, old))
    }

    pub(crate) fn denial_message(&self) -> String {
        let binding = self.binding.clone().unwrap_or_else(|| self.policy.clone());
        let msg = self.message.clone().unwrap_or_else(|| {
            let exprs: Vec<String> = self
                .when
                .iter()
                .map(|p| {
                    let root = if p.target == Target::Object {
                        "object"
                    } else {
                        "oldObject"
                    };
                    format!("{root}.{} {:?} {:?}", p.path, p.op, p.values)
                })
                .collect();
            format!("failed expression: !({})", exprs.join(" && "))
        });
        format!(
            "ValidatingAdmissionPolicy '{}' with binding '{}' denied request: {}",
            self.policy, binding, msg
        )
    }
}

/// All injected faults; `Faults::default()` is a healthy server.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Faults {
    #[serde(default)]
    pub deny: Vec<DenyRule>,
    #[serde(default)]
    pub availability: Availability,
    /// Added before every API request is handled.
    #[serde(default)]
    pub latency_ms: u64,
    /// Every API request occupies the server this long, one request at a time (first come, first
    /// served): an overloaded apiserver, where a burst of writes delays every later request.
    #[serde(default)]
    pub busy_ms: u64,
    /// Watches deliver nothing (no events, no bookmarks) while set, as a watch on a stuck
    /// connection does; other requests are served. When lifted, each stalled watch ends, and its
    /// client watches again from the last version it saw (so it gets the held events then).
    #[serde(default)]
    pub watches_stalled: bool,
    /// Users cut off from the API while every other client is served, as a network partition
    /// between one host and the apiserver: each request of theirs gets no answer (its connection
    /// is closed, which the client sees as a reset), and their open watches are cut the same way.
    /// The emulator authenticates nobody, so a request's user is its bearer token.
    #[serde(default)]
    pub partitioned: Vec<String>,
    /// Writes held before they are applied (see [`HeldWrites`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub held_writes: Vec<HeldWrites>,
}

/// Holds the next `count` matching writes (POST, PUT, PATCH, DELETE) for `hold_ms` each, then
/// applies them whether or not their client still waits: a real apiserver does the same with a
/// request it has read (queued by API Priority and Fairness, behind a slow etcd, on a replica that
/// stalled), so a client that timed out and wrote again can see its newer write land first and
/// the held one after it. Reads are never held.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HeldWrites {
    /// Resource plural, e.g. `macbuilds`; `None` = any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource: Option<String>,
    /// `Some("status")` = only the status subresource, `Some("")` = only the main resource, `None` = both.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subresource: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// How long each held write waits before it is applied.
    pub hold_ms: u64,
    /// How many more writes are held; each held write takes one.
    pub count: u32,
}

impl HeldWrites {
    /// Holds the next `count` writes to the status of `namespace/name` of `resource` for `hold`.
    pub fn status_of(resource: &str, namespace: &str, name: &str, hold: std::time::Duration, count: u32) -> Self {
        HeldWrites {
            resource: Some(resource.into()),
            subresource: Some("status".into()),
            namespace: Some(namespace.into()),
            name: Some(name.into()),
            hold_ms: hold.as_millis() as u64,
            count,
        }
    }

    /// Whether a write to `plural`/`subresource` of `namespace/name` is one this rule holds.
    pub(crate) fn matches(&self, plural: &str, subresource: &str, namespace: &str, name: &str) -> bool {
        self.count > 0
            && self.resource.as_deref().is_none_or(|r| r == plural)
            && self.subresource.as_deref().is_none_or(|s| s == subresource)
            && self.namespace.as_deref().is_none_or(|n| n == namespace)
            && self.name.as_deref().is_none_or(|n| n == name)
    }
}

impl Faults {
    /// Whether requests carrying `token` are cut off (see [`Faults::partitioned`]).
    pub fn is_partitioned(&self, token: Option<&str>) -> bool {
        token.is_some_and(|t| self.partitioned.iter().any(|p| p == t))
    }
}

/// Body of `POST /emulator/faults`: any field given replaces that part of the faults.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FaultsUpdate {
    pub deny: Option<Vec<DenyRule>>,
    pub availability: Option<Availability>,
    /// With `availability`: restore `up` after this long.
    pub for_ms: Option<u64>,
    pub latency_ms: Option<u64>,
    pub busy_ms: Option<u64>,
    pub watches_stalled: Option<bool>,
    pub partitioned: Option<Vec<String>>,
    pub held_writes: Option<Vec<HeldWrites>>,
}
