//! Tekton's `CustomRun` (`tekton.dev/v1beta1`), written to match the fields of Tekton's own CRD
//! that Tartan reads or writes (the tests' CRD is `testkit/fixtures/customrun-crd.yaml`).
//!
//! The derive is used only as a client type: Tartan never installs this CRD, so the schema is
//! disabled. Fields whose CRD schema keeps unknown fields (`params[].value`, `customSpec.spec`,
//! `workspaces`, `status.extraFields`, `status.retriesStatus`) are kept as raw JSON so that no
//! CustomRun Tekton accepts can fail to deserialize here: a CustomRun we cannot read is a
//! CustomRun we cannot fail with a helpful reason.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::CustomResource;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// `spec.status` value Tekton patches in to cancel a CustomRun.
pub const SPEC_STATUS_CANCELLED: &str = "RunCancelled";

/// Tekton's reason constants for the `Succeeded` condition (`customrun_types.go`).
pub mod reason {
    pub const STARTED: &str = "Started";
    pub const RUNNING: &str = "Running";
    pub const CANCELLED: &str = "CustomRunCancelled";
    pub const TIMED_OUT: &str = "CustomRunTimedOut";
}

/// The only top-level condition of a CustomRun (knative's batch condition set).
pub const SUCCEEDED: &str = "Succeeded";

/// Labels Tekton puts on a CustomRun it creates, and the one custom task controllers add to children.
pub mod label {
    pub const PIPELINE: &str = "tekton.dev/pipeline";
    pub const PIPELINE_RUN: &str = "tekton.dev/pipelineRun";
    pub const PIPELINE_RUN_UID: &str = "tekton.dev/pipelineRunUID";
    pub const PIPELINE_TASK: &str = "tekton.dev/pipelineTask";
    pub const MEMBER_OF: &str = "tekton.dev/memberOf";
    pub const CUSTOM_RUN: &str = "tekton.dev/customRun";
}

/// `CustomRunSpec` (`pkg/apis/pipeline/v1beta1/customrun_types.go`).
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "tekton.dev",
    version = "v1beta1",
    kind = "CustomRun",
    namespaced,
    status = "CustomRunStatus",
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
pub struct CustomRunSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub custom_ref: Option<CustomRef>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub custom_spec: Option<EmbeddedCustomRunSpec>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub params: Vec<Param>,
    /// `RunCancelled` when Tekton cancels the run. Written by Tekton only, never by us.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status_message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retries: Option<i64>,
    #[serde(default)]
    pub service_account_name: String,
    /// A Go duration string (`1h0m0s`); absent means the default (60 m), `0s` means none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub workspaces: Vec<serde_json::Value>,
}

/// `TaskRef` as used in `spec.customRef`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CustomRef {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolver: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub params: Vec<Param>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bundle: Option<String>,
}

/// `EmbeddedCustomRunSpec`: a pipeline task's `taskSpec` for a custom task.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct EmbeddedCustomRunSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<EmbeddedMetadata>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<serde_json::Value>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct EmbeddedMetadata {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// A parameter: `value` is a string, a list of strings or a map of strings (kept raw).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Param {
    pub name: String,
    pub value: serde_json::Value,
}

/// `CustomRunStatus`: knative `duckv1.Status` inlined with `CustomRunStatusFields`. Only these
/// keys survive Tekton's structural schema; everything of ours goes into `extra_fields`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CustomRunStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_time: Option<Time>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub results: Vec<CustomRunResult>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retries_status: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extra_fields: Option<serde_json::Value>,
}

/// A knative condition. `lastTransitionTime` is knative's `VolatileTime`, a plain string in the
/// schema; it is kept verbatim so a read-modify-write never changes its spelling.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub severity: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<String>,
}

/// A result; both fields are required strings in Tekton's schema.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct CustomRunResult {
    pub name: String,
    pub value: String,
}

impl CustomRunSpec {
    /// The `apiVersion`/`kind` this run asks for: `customRef`'s, or `customSpec`'s when there is
    /// no `customRef` (Tekton's `FilterCustomRunRef`).
    pub fn task_type(&self) -> Option<(&str, &str)> {
        match (&self.custom_ref, &self.custom_spec) {
            (Some(r), _) => Some((r.api_version.as_deref().unwrap_or(""), r.kind.as_deref().unwrap_or(""))),
            (None, Some(s)) => Some((s.api_version.as_deref().unwrap_or(""), s.kind.as_deref().unwrap_or(""))),
            (None, None) => None,
        }
    }

    /// Whether this run is a Tartan MacBuild (exact `group/version` and kind match). Runs of
    /// other custom tasks are never touched.
    pub fn is_macbuild(&self) -> bool {
        self.task_type() == Some((tartan_api::API_VERSION, tartan_api::KIND))
    }

    /// Tekton's `IsCancelled()`.
    pub fn is_cancelled(&self) -> bool {
        self.status.as_deref() == Some(SPEC_STATUS_CANCELLED)
    }
}

impl CustomRunStatus {
    /// The `Succeeded` condition, if any.
    pub fn succeeded(&self) -> Option<&Condition> {
        self.conditions.iter().find(|c| c.type_ == SUCCEEDED)
    }

    /// Tekton's `IsDone()`: `Succeeded` present and not `Unknown`.
    pub fn is_done(&self) -> bool {
        self.succeeded().is_some_and(|c| c.status != "Unknown")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_from_yaml(yaml: &str) -> CustomRun {
        serde_saphyr::from_str(yaml).expect("fixture parses")
    }

    /// The object Tekton's PipelineRun reconciler creates for a custom task, with a list param.
    const TEKTON_CREATED: &str = r#"
apiVersion: tekton.dev/v1beta1
kind: CustomRun
metadata:
  name: build-42-mac-build
  namespace: ci
  labels:
    tekton.dev/pipeline: build-42
    tekton.dev/pipelineRun: build-42
    tekton.dev/pipelineTask: mac-build
    tekton.dev/memberOf: tasks
  ownerReferences:
  - {apiVersion: tekton.dev/v1, kind: PipelineRun, name: build-42, uid: 6f1c0e2a, controller: true, blockOwnerDeletion: true}
spec:
  customRef: {apiVersion: tartan.dev/v1alpha1, kind: MacBuild}
  params: [{name: image, value: "ghcr.io/cirruslabs/macos:16"}, {name: destinations, value: ["a","b"]},
           {name: meta, value: {k: v}}]
  retries: 1
  serviceAccountName: default
  timeout: 30m0s
"#;

    #[test]
    fn tekton_created_run_parses_with_every_param_shape() {
        let run = run_from_yaml(TEKTON_CREATED);
        assert!(run.spec.is_macbuild());
        assert_eq!(run.spec.retries, Some(1));
        assert_eq!(run.spec.timeout.as_deref(), Some("30m0s"));
        assert_eq!(run.spec.params.len(), 3);
        assert_eq!(run.spec.params[1].value, serde_json::json!(["a", "b"]));
        assert!(run.status.is_none());
        assert!(!run.spec.is_cancelled());
    }

    #[test]
    fn filter_matches_exact_group_version_and_kind_only() {
        let cases: &[(&str, bool)] = &[
            ("customRef: {apiVersion: tartan.dev/v1alpha1, kind: MacBuild}", true),
            (
                "customSpec: {apiVersion: tartan.dev/v1alpha1, kind: MacBuild, spec: {image: x}}",
                true,
            ),
            ("customRef: {apiVersion: tartan.dev/v1beta1, kind: MacBuild}", false),
            ("customRef: {apiVersion: tartan.dev, kind: MacBuild}", false),
            ("customRef: {apiVersion: tartan.dev/v1alpha1, kind: Wait}", false),
            ("customRef: {apiVersion: example.dev/v1, kind: MacBuild}", false),
            // customRef wins over customSpec, as in Tekton's FilterCustomRunRef.
            (
                "{customRef: {apiVersion: example.dev/v1, kind: Wait}, customSpec: {apiVersion: tartan.dev/v1alpha1, kind: MacBuild}}",
                false,
            ),
            ("{}", false),
        ];
        for (spec, want) in cases {
            let spec: CustomRunSpec = serde_saphyr::from_str(spec).unwrap();
            assert_eq!(spec.is_macbuild(), *want, "{spec:?}");
        }
    }

    #[test]
    fn status_round_trips_and_keeps_transition_time_spelling() {
        let yaml = r#"
observedGeneration: 1
startTime: "2026-08-20T10:00:00Z"
conditions: [{type: Succeeded, status: "Unknown", reason: Running, message: m, lastTransitionTime: "2026-08-20T10:00:01.5Z"}]
extraFields: {macBuild: build-42-mac-build}
results: [{name: vmRetirement, value: deleted}]
"#;
        let st: CustomRunStatus = serde_saphyr::from_str(yaml).unwrap();
        assert!(!st.is_done());
        let json = serde_json::to_value(&st).unwrap();
        assert_eq!(json["conditions"][0]["lastTransitionTime"], "2026-08-20T10:00:01.5Z");
        assert_eq!(json["startTime"], "2026-08-20T10:00:00Z");
        let back: CustomRunStatus = serde_json::from_value(json).unwrap();
        assert_eq!(back, st);
    }

    #[test]
    fn done_means_succeeded_not_unknown() {
        let cond = |s: &str| Condition {
            type_: SUCCEEDED.into(),
            status: s.into(),
            ..Default::default()
        };
        let mut st = CustomRunStatus::default();
        assert!(!st.is_done());
        st.conditions = vec![cond("Unknown")];
        assert!(!st.is_done());
        st.conditions = vec![cond("True")];
        assert!(st.is_done());
        st.conditions = vec![cond("False")];
        assert!(st.is_done());
        st.conditions = vec![Condition {
            type_: "HostUnreachable".into(),
            status: "True".into(),
            ..Default::default()
        }];
        assert!(!st.is_done());
    }

    #[test]
    fn cancel_is_exactly_run_cancelled() {
        let mut spec = CustomRunSpec {
            status: Some("RunCancelled".into()),
            ..Default::default()
        };
        assert!(spec.is_cancelled());
        spec.status = Some("Cancelled".into());
        assert!(!spec.is_cancelled());
    }
}
