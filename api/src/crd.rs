//! The MacBuild custom resource (`tartan.dev/v1alpha1`, short name `mb`).
//!
//! Ownership: the controller writes `.spec` (at creation, and `cancelRequested` later); only the
//! agent named in `status.claim.holder` writes `.status`, with writes fenced on that claim.

use crate::condition::{Condition, find_condition, set_condition};
use crate::vocab::{AttemptState, ConditionType, Outcome, Reason, UnknownName, vocabulary};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube_derive::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

/// The longest `spec.timeoutSeconds` (and step `timeoutSeconds`) a MacBuild may have: 7 days (the
/// schema's `maximum`; the controller caps a longer CustomRun timeout to it).
pub const MAX_TIMEOUT_SECONDS: u32 = 604_800;

/// `timeoutSeconds` when the spec leaves it out.
pub const DEFAULT_TIMEOUT_SECONDS: u32 = 3600;
/// `maxAttempts` when the spec leaves it out.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 2;
/// The most attempts a MacBuild may ask for.
pub const MAX_ATTEMPTS_LIMIT: u32 = 3;

/// Most steps one MacBuild may have (`spec.steps`, the CRD's `maxItems`): each step has a log
/// file, a guest job and status entries, and the host's disk and the status size are bounded by
/// this times the per-step caps.
pub const MAX_STEPS: usize = 64;

/// What to build: the controller writes it when it creates the MacBuild from a CustomRun.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(transform = kubernetes_schema_fixes)]
// Every printer column repeats `type_ = "string"`; clippy takes that for a duplicated attribute.
#[allow(clippy::duplicated_attributes)]
#[kube(
    group = "tartan.dev",
    version = "v1alpha1",
    kind = "MacBuild",
    plural = "macbuilds",
    shortname = "mb",
    category = "ci",
    namespaced,
    status = "MacBuildStatus",
    derive = "PartialEq",
    crates(kube_core = "::kube_core"),
    doc = "A macOS build for a Tekton CustomRun, run by a Tartan agent in a throw-away tart VM.",
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Attempt", type_ = "string", json_path = ".status.claim.attempt"),
    printcolumn(name = "Host", type_ = "string", json_path = ".status.claim.holder"),
    printcolumn(name = "Outcome", type_ = "string", json_path = ".status.outcome"),
    printcolumn(name = "VM", type_ = "string", json_path = ".status.vm", priority = 1),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct MacBuildSpec {
    /// The tart image to clone, e.g. `ghcr.io/cirruslabs/macos-sequoia-xcode:16`.
    #[schemars(length(min = 1))]
    pub image: String,

    /// Source to check out in the guest before the steps run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<Source>,

    /// Commands run in the guest through `tart exec`, in order; the first failure ends the build.
    /// At most 64 (`MAX_STEPS`).
    #[schemars(length(min = 1, max = MAX_STEPS), extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub steps: Vec<Step>,

    /// Path of a JUnit XML report in the guest, relative to the build directory, read after the
    /// steps; its failures fail the build.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub test_report: Option<String>,

    /// Files to publish once the steps succeed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifacts: Option<Artifacts>,

    /// Host execution time limit, counted from the first admission; retries keep that deadline.
    #[serde(default = "default_timeout_seconds")]
    #[schemars(range(min = 1, max = 604800))]
    pub timeout_seconds: u32,

    /// How many attempts may run; only an interrupted attempt is followed by another.
    #[serde(default = "default_max_attempts")]
    #[schemars(range(min = 1, max = 3))]
    pub max_attempts: u32,

    /// CPU and memory for the VM; what is left out keeps the image's own setting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<Resources>,

    /// Only an agent whose host labels include all of these may claim the build.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub host_selector: BTreeMap<String, String>,

    /// Set by the controller when the CustomRun is cancelled; the holding agent stops the build,
    /// records `Cancelled` and never retries.
    #[serde(default, skip_serializing_if = "is_false")]
    pub cancel_requested: bool,

    /// Host folders shared into the VM (`tart run --dir`), by the names the agent's config
    /// declares (`[[mounts]]`); a name the agent does not declare fails the build before any VM
    /// is cloned. In a macOS guest each appears at `/Volumes/My Shared Files/<name>`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16), extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub mounts: Vec<MountRequest>,
    /// Environment of every step (and the checkout), as in a Pod: a literal `value`, or
    /// `valueFrom.secretKeyRef` naming a key of a Secret in the MacBuild's namespace that the
    /// agent is allowed to read. Secret values are masked (`***`) in the step logs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 100), extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub env: Vec<EnvVar>,
}

impl MacBuildSpec {
    /// A spec with `image` and `steps` and every optional field at its default (no source, test
    /// report or artifacts; `timeoutSeconds` and `maxAttempts` defaulted; no host selector).
    pub fn new(image: impl Into<String>, steps: Vec<Step>) -> MacBuildSpec {
        MacBuildSpec {
            image: image.into(),
            source: None,
            steps,
            test_report: None,
            artifacts: None,
            timeout_seconds: DEFAULT_TIMEOUT_SECONDS,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            resources: None,
            host_selector: BTreeMap::new(),
            cancel_requested: false,
            mounts: Vec::new(),
            env: Vec::new(),
        }
    }
}

fn default_timeout_seconds() -> u32 {
    DEFAULT_TIMEOUT_SECONDS
}

fn default_max_attempts() -> u32 {
    DEFAULT_MAX_ATTEMPTS
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// A git checkout done in the guest before the first step.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Source {
    /// Repository URL.
    #[schemars(length(min = 1))]
    pub git: String,
    /// Commit (or tag) to check out. Required so that a retry builds the same code as the attempt
    /// it replaces.
    #[schemars(length(min = 1))]
    pub revision: String,
}

/// One command run in the guest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Step {
    /// Unique within the build; names the step in logs and messages.
    #[schemars(length(min = 1, max = 63), regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"))]
    pub name: String,
    /// argv, run directly (no shell), e.g. `[xcodebuild, -scheme, App, build]`.
    #[schemars(length(min = 1), inner(length(min = 1)))]
    pub run: Vec<String>,
    /// Longest the step may run, in seconds, counted from its start (also across an agent
    /// restart); a step still running then is killed in the guest and the build fails with
    /// `StepTimedOut`. At most the build's `timeoutSeconds`, whose deadline bounds every step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 604800))]
    pub timeout_seconds: Option<u32>,
}

impl Step {
    /// A step named `name` running `run`, without a timeout of its own.
    pub fn new(name: impl Into<String>, run: Vec<String>) -> Step {
        Step {
            name: name.into(),
            run,
            timeout_seconds: None,
        }
    }
}

/// The most mounts a MacBuild may ask for.
pub const MAX_MOUNTS: usize = 16;

/// A host folder the build asks for, by the name the agent's config gives it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MountRequest {
    /// A `[[mounts]] name` of the agent's config.
    #[schemars(length(min = 1, max = 63), regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"))]
    pub name: String,
}

/// Checks a mount name: 1–63 of `a-z`, `0-9` and `-`, starting and ending with a letter or digit
/// (as a step name). tart takes it as the folder's name in the guest (`/Volumes/My Shared
/// Files/<name>`) and splits `--dir name:path:options` at `:`, so nothing else may appear in it.
pub fn check_mount_name(name: &str) -> Result<(), String> {
    let shown: String = name.chars().take(80).collect();
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "mount name {shown:?} must be 1-63 characters of a-z, 0-9 and '-', starting and ending with a letter or digit"
        ))
    }
}

/// Checks a spec's `mounts`: at most [`MAX_MOUNTS`], each name well formed and named once.
pub fn check_mount_requests(mounts: &[MountRequest]) -> Result<(), String> {
    if mounts.len() > MAX_MOUNTS {
        return Err(format!("{} mounts asked for; at most {MAX_MOUNTS}", mounts.len()));
    }
    let mut seen = std::collections::BTreeSet::new();
    for m in mounts {
        check_mount_name(&m.name)?;
        if !seen.insert(m.name.as_str()) {
            return Err(format!("mount {:?} is asked for twice", m.name));
        }
    }
    Ok(())
}

/// Checks every step's `timeoutSeconds`: more than 0 and at most the build's `timeoutSeconds`
/// (a longer one could never fire: the build's deadline ends the step first). Returns what is
/// wrong, naming the step.
pub fn check_step_timeouts(spec: &MacBuildSpec) -> Result<(), String> {
    for step in &spec.steps {
        match step.timeout_seconds {
            None => {}
            Some(0) => {
                return Err(format!(
                    "step {:?}: timeoutSeconds must be at least 1, got 0",
                    step.name
                ));
            }
            Some(t) if t > spec.timeout_seconds => {
                return Err(format!(
                    "step {:?}: timeoutSeconds {t} is longer than the build's timeoutSeconds {}; \
                     the build's deadline would end the step first",
                    step.name, spec.timeout_seconds
                ));
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// Files to publish after the steps succeed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Artifacts {
    /// Paths in the guest, relative to the build directory.
    #[schemars(length(min = 1), inner(length(min = 1)))]
    pub paths: Vec<String>,
    /// Where they go: `s3://bucket/prefix/` or `file:///absolute/dir/` on the host; unset = the
    /// agent's configured default destination.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(regex(pattern = r"^(s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?|file:///.*)$"))]
    pub destination: String,
}

/// VM size; each field left out keeps the image's setting (`tart set` is not called for it).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Resources {
    /// Virtual CPUs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 64))]
    pub cpu: Option<u32>,
    /// Memory in MiB; macOS guests need at least 2 GiB to boot usefully.
    #[serde(rename = "memoryMiB", default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 2048, max = 1048576))]
    pub memory_mib: Option<u32>,
}

/// One environment variable of the steps (`spec.env[]`); see [`crate::env::check_env`] for
/// what is accepted.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EnvVar {
    /// A shell variable name (`[A-Za-z_][A-Za-z0-9_]*`), unique within the build.
    #[schemars(length(min = 1, max = 128), regex(pattern = r"^[A-Za-z_][A-Za-z0-9_]*$"))]
    pub name: String,
    /// A literal value (not secret: it is part of the MacBuild). Exactly one of `value` and
    /// `valueFrom` is given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32768))]
    pub value: Option<String>,
    /// Where the value comes from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value_from: Option<EnvVarSource>,
}

impl EnvVar {
    /// `name` from key `key` of Secret `secret` (`valueFrom.secretKeyRef`).
    pub fn from_secret(name: &str, secret: &str, key: &str) -> EnvVar {
        EnvVar {
            name: name.into(),
            value: None,
            value_from: Some(EnvVarSource {
                secret_key_ref: SecretKeySelector {
                    name: secret.into(),
                    key: key.into(),
                },
            }),
        }
    }
}

/// The source of an environment value.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EnvVarSource {
    /// A key of a Secret in the MacBuild's namespace.
    pub secret_key_ref: SecretKeySelector,
}

/// A key of a Secret in the MacBuild's namespace.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeySelector {
    /// The Secret's name; the agent's `[secrets] allowed` list (and its RBAC) must name it.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The key within the Secret's `data`.
    #[schemars(length(min = 1, max = 253), regex(pattern = r"^[-._a-zA-Z0-9]+$"))]
    pub key: String,
}

vocabulary! {
    /// The build as a whole, for `kubectl get mb` and the controller's CustomRun mapping.
    Phase {
        /// Waiting for an agent or a slot; also while an interrupted attempt's VM is quarantined
        /// before a retry (the message names the VM).
        Pending => "Pending",
        /// An attempt holds a slot; its VM is about to be cloned.
        Admitted => "Admitted",
        /// The VM is being cloned and started.
        Booting => "Booting",
        /// The steps run in the guest.
        Running => "Running",
        /// Test report and artifacts are being gathered.
        Collecting => "Collecting",
        /// The outcome is fixed (see `outcome`); the VM is being deleted.
        Retiring => "Retiring",
        /// Build and tests passed; the VM is gone.
        Succeeded => "Succeeded",
        /// A step or the tests failed, the deadline passed, or attempts ran out; the VM is gone.
        Failed => "Failed",
        /// Cancelled or owner deleted; the VM is gone.
        Cancelled => "Cancelled",
    }
}

impl Phase {
    /// Succeeded, Failed and Cancelled: set only once the last VM's deletion is confirmed.
    pub fn is_terminal(self) -> bool {
        matches!(self, Phase::Succeeded | Phase::Failed | Phase::Cancelled)
    }

    /// The phase to show for the latest attempt, from its journal state and outcome.
    ///
    /// `retry_follows` says whether the agent will admit another attempt (outcome `Interrupted`,
    /// attempts left, enough time before the deadline). A quarantined VM keeps the build
    /// `Pending` when a retry waits for its slot, and `Retiring` when the outcome is final.
    pub fn for_attempt(state: AttemptState, outcome: Option<Outcome>, retry_follows: bool) -> Phase {
        let retry_pending = outcome == Some(Outcome::Interrupted) && retry_follows;
        match state {
            AttemptState::Requested => Phase::Pending,
            AttemptState::Admitted => Phase::Admitted,
            AttemptState::Booting => Phase::Booting,
            AttemptState::Running => Phase::Running,
            AttemptState::Collecting => Phase::Collecting,
            AttemptState::Retiring => Phase::Retiring,
            AttemptState::Quarantined if retry_pending => Phase::Pending,
            AttemptState::Quarantined => Phase::Retiring,
            AttemptState::Retired => match outcome {
                Some(Outcome::Succeeded) => Phase::Succeeded,
                Some(Outcome::Failed) => Phase::Failed,
                Some(Outcome::Cancelled) => Phase::Cancelled,
                Some(Outcome::Interrupted) if retry_follows => Phase::Pending,
                Some(Outcome::Interrupted) => Phase::Failed,
                // Retired without an outcome: the attempt never ran (e.g. the claim was lost).
                None => Phase::Pending,
            },
        }
    }
}

/// What the claiming agent reports. Every field has one writer: the agent in `claim.holder`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(transform = kubernetes_schema_fixes)]
#[serde(rename_all = "camelCase")]
pub struct MacBuildStatus {
    /// Where the build stands. Written by the holding agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,

    /// Outcome of the latest attempt, once fixed at `Retiring`. Written by the holding agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<Outcome>,

    /// `Claimed`, `VMReady`, `VMDeleted`, `Succeeded`; one entry per type. Written by the holding
    /// agent.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,

    /// Who holds the build and which attempt runs. Written by the claiming agent (the claim is a
    /// fenced write; later writes test `holder` and `attempt`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim: Option<Claim>,

    /// Every attempt so far, oldest first. Written by the holding agent.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attempts: Vec<AttemptRecord>,

    /// Sequence number of the last journal record this status reflects; recovery redelivers when
    /// the journal is ahead. Written by the holding agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub journal_seq: Option<u64>,

    /// The current attempt's tart VM (also while quarantined). Written by the holding agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm: Option<String>,

    /// Host execution deadline: first admission + `timeoutSeconds`. Written by the holding agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline: Option<Time>,

    /// Test counts and artifact location. Written by the holding agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub results: Option<BuildResults>,

    /// One line on the current state, e.g. why the build is `Pending`. Written by the holding agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,

    /// Where the current attempt's step logs are shipped while it runs and once it ended:
    /// `<destination>/<vm>/logs/` (`s3://…` or `file://…`; the layout is in `tartan_api::logs`).
    /// Set when shipping starts; absent when neither the MacBuild nor the agent config names an
    /// artifact destination. Written by the holding agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logs: Option<String>,
}

impl MacBuildStatus {
    /// The condition of type `type_`, if present.
    pub fn condition(&self, type_: ConditionType) -> Option<&Condition> {
        find_condition(&self.conditions, type_)
    }

    /// Sets a condition, keeping its transition time if the status is unchanged; see
    /// [`set_condition`]. Returns whether anything changed.
    pub fn set_condition(&mut self, condition: Condition) -> bool {
        set_condition(&mut self.conditions, condition)
    }

    /// The latest attempt, if any.
    pub fn current_attempt(&self) -> Option<&AttemptRecord> {
        self.attempts.last()
    }
}

/// The fenced claim on a MacBuild.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Claim {
    /// Agent name, also the holder of its Lease.
    #[schemars(length(min = 1))]
    pub holder: String,
    /// Attempt id `<macbuild>#<n>`, e.g. `build-42#1`; later status writes test it.
    #[schemars(length(min = 1))]
    pub attempt: String,
    /// Increases with every claim of this MacBuild, so a stale holder's write cannot match.
    pub epoch: u64,
}

/// One attempt of the build.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AttemptRecord {
    /// 1, 2 or 3.
    #[schemars(range(min = 1, max = 3))]
    pub number: u32,
    /// Attempt id `<macbuild>#<n>`.
    pub id: String,
    /// Its tart VM.
    pub vm: String,
    /// The agent that ran it.
    pub host: String,
    /// How it ended, once fixed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<Outcome>,
    /// The reason recorded with the outcome, e.g. `TestsPassed` or `AgentRestarted`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<Reason>,
    /// Admission time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Time>,
    /// When its VM's deletion was confirmed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Time>,
    /// Detail, e.g. `found Running at agent start; killed 0 tart process(es)`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// What the build produced.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BuildResults {
    /// Passed test cases in the test report.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tests_passed: Option<u32>,
    /// All test cases in the test report.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tests_total: Option<u32>,
    /// Where the artifacts were published (under `spec.artifacts.destination`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact_url: Option<String>,
}

/// Adjusts what schemars derives to what kube-apiserver expects, for the whole (inlined) tree:
///
/// - OpenAPI 3.0 has no unsigned formats and recent apiservers warn about `uint32`/`uint64`, so
///   they become `int64` with the unsigned range as `minimum`/`maximum` (the Rust side stays
///   unsigned and can always decode what the apiserver accepted).
/// - An optional field whose type has its own doc comment would otherwise show the type's
///   description instead of the field's, once kube hoists the `anyOf` of an `Option`.
fn kubernetes_schema_fixes(schema: &mut schemars::Schema) {
    fn visit(value: &mut serde_json::Value) {
        match value {
            serde_json::Value::Object(object) => {
                // `Some(None)`: unsigned without an extra bound (int64 already bounds a u64 field
                // at what the apiserver can store).
                let unsigned_max: Option<Option<u64>> = match object.get("format").and_then(|f| f.as_str()) {
                    Some("uint8") => Some(Some(u8::MAX.into())),
                    Some("uint16") => Some(Some(u16::MAX.into())),
                    Some("uint32" | "uint") => Some(Some(u32::MAX.into())),
                    Some("uint64") => Some(None),
                    _ => None,
                };
                if let Some(max) = unsigned_max {
                    object.insert("format".into(), "int64".into());
                    object.entry("minimum").or_insert(0.into());
                    if let Some(max) = max {
                        object.entry("maximum").or_insert(max.into());
                    }
                }
                if object.contains_key("description")
                    && let Some(serde_json::Value::Array(branches)) = object.get_mut("anyOf")
                {
                    for branch in branches.iter_mut().filter_map(|b| b.as_object_mut()) {
                        branch.remove("description");
                    }
                }
                object.values_mut().for_each(visit);
            }
            serde_json::Value::Array(items) => items.iter_mut().for_each(visit),
            _ => {}
        }
    }
    if let Some(root) = schema.as_object_mut() {
        let mut value = serde_json::Value::Object(std::mem::take(root));
        visit(&mut value);
        if let serde_json::Value::Object(fixed) = value {
            *root = fixed;
        }
    }
}

#[cfg(test)]
mod step_timeout_tests {
    use super::*;

    #[test]
    fn step_timeouts_must_fit_in_the_build_timeout() {
        let mut spec = MacBuildSpec::new("img", vec![Step::new("build", vec!["make".into()])]);
        spec.timeout_seconds = 600;
        assert_eq!(check_step_timeouts(&spec), Ok(()));
        for (t, ok) in [(1, true), (600, true), (601, false), (0, false), (u32::MAX, false)] {
            spec.steps[0].timeout_seconds = Some(t);
            assert_eq!(check_step_timeouts(&spec).is_ok(), ok, "{t}");
        }
        spec.steps[0].timeout_seconds = Some(601);
        assert_eq!(
            check_step_timeouts(&spec).unwrap_err(),
            "step \"build\": timeoutSeconds 601 is longer than the build's timeoutSeconds 600; \
             the build's deadline would end the step first"
        );
        // Left out, it is not written back.
        let json = serde_json::to_value(Step::new("b", vec!["x".into()])).unwrap();
        assert_eq!(json, serde_json::json!({"name": "b", "run": ["x"]}));
    }
}

#[cfg(test)]
mod mount_tests {
    use super::*;

    #[test]
    fn mount_names_are_plain_labels_and_asked_for_once() {
        for good in ["spm", "cocoapods-cache", "a", "0", &"x".repeat(63)] {
            assert_eq!(check_mount_name(good), Ok(()), "{good}");
        }
        for bad in [
            "",
            "SPM",
            "-a",
            "a-",
            "a:b",
            "a/b",
            "..",
            "a b",
            "a,ro",
            "tag=x",
            "é",
            "a\n",
            "a\0b",
            &"x".repeat(64),
        ] {
            let e = check_mount_name(bad).unwrap_err();
            assert!(e.starts_with("mount name "), "{bad:?}: {e}");
        }
        // A hostile name is shown cut, not whole.
        assert!(check_mount_name(&"X".repeat(100_000)).unwrap_err().len() < 300);
        let m = |n: &str| MountRequest { name: n.into() };
        assert_eq!(check_mount_requests(&[m("spm"), m("pods")]), Ok(()));
        assert_eq!(
            check_mount_requests(&[m("spm"), m("spm")]).unwrap_err(),
            "mount \"spm\" is asked for twice"
        );
        let many: Vec<_> = (0..17).map(|i| m(&format!("m{i}"))).collect();
        assert_eq!(
            check_mount_requests(&many).unwrap_err(),
            "17 mounts asked for; at most 16"
        );
    }
}
