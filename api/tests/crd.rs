//! The MacBuild resource as the apiserver and kubectl see it: serde shape, defaults, and the
//! generated CRD (structural schema, validation, printer columns).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube_core::CustomResourceExt;
use serde_json::{Value, json};
use tartan_api::{
    AttemptRecord, AttemptState, BuildResults, Claim, Condition, ConditionStatus, ConditionType, MacBuild,
    MacBuildSpec, MacBuildStatus, Outcome, Phase, Reason,
};

/// A MacBuild with every spec field and a Running status with a claim.
const DESIGN_EXAMPLE: &str = r#"
apiVersion: tartan.dev/v1alpha1
kind: MacBuild
metadata:
  name: build-42-mac-build
  namespace: ci
  finalizers: [tartan.dev/vm-cleanup]
spec:
  image: ghcr.io/cirruslabs/macos-sequoia-xcode:16
  source: {git: "https://github.com/acme/app.git", revision: 3f2c9e1}
  steps:
  - {name: build, run: [xcodebuild, -scheme, App, build]}
  - {name: test,  run: [xcodebuild, -scheme, App, test]}
  testReport: out/junit.xml
  artifacts: {paths: [out/App.ipa], destination: "s3://ci-artifacts/app/"}
  timeoutSeconds: 1800
  maxAttempts: 2
  resources: {cpu: 4, memoryMiB: 8192}
  hostSelector: {xcode: "16"}
status:
  phase: Running
  claim: {holder: mac-mini-07, attempt: "build-42-mac-build#1", epoch: 1}
  vm: mb-ci-build-42-mac-build-c49f62f4
  journalSeq: 120
  conditions:
  - {type: Claimed, status: "True", reason: SlotFree, lastTransitionTime: "2026-10-05T02:41:00Z"}
  - {type: VMReady, status: "True", reason: GuestReady, message: "tart exec ready after 13.91s",
     lastTransitionTime: "2026-10-05T02:41:26Z"}
  - {type: VMDeleted, status: "False", reason: Running, lastTransitionTime: "2026-10-05T02:41:26Z"}
"#;

fn time(s: &str) -> Time {
    Time(s.parse::<Timestamp>().unwrap())
}

fn crd_json() -> Value {
    serde_json::to_value(MacBuild::crd()).unwrap()
}

fn schema() -> Value {
    crd_json()["spec"]["versions"][0]["schema"]["openAPIV3Schema"].clone()
}

#[test]
fn the_design_example_parses_into_typed_fields() {
    let mb: MacBuild = serde_saphyr::from_str(DESIGN_EXAMPLE).unwrap();
    let spec = &mb.spec;
    assert_eq!(spec.image, "ghcr.io/cirruslabs/macos-sequoia-xcode:16");
    assert_eq!(spec.source.as_ref().unwrap().revision, "3f2c9e1");
    assert_eq!(spec.steps.len(), 2);
    assert_eq!(spec.steps[0].run, ["xcodebuild", "-scheme", "App", "build"]);
    assert_eq!(spec.test_report.as_deref(), Some("out/junit.xml"));
    assert_eq!(spec.artifacts.as_ref().unwrap().destination, "s3://ci-artifacts/app/");
    assert_eq!((spec.timeout_seconds, spec.max_attempts), (1800, 2));
    let resources = spec.resources.as_ref().unwrap();
    assert_eq!((resources.cpu, resources.memory_mib), (Some(4), Some(8192)));
    assert_eq!(spec.host_selector.get("xcode").map(String::as_str), Some("16"));
    assert!(!spec.cancel_requested);

    let status = mb.status.as_ref().unwrap();
    assert_eq!(status.phase, Some(Phase::Running));
    assert_eq!(
        status.claim,
        Some(Claim {
            holder: "mac-mini-07".into(),
            attempt: "build-42-mac-build#1".into(),
            epoch: 1
        })
    );
    assert_eq!(status.journal_seq, Some(120));
    let deleted = status.condition(ConditionType::VMDeleted).unwrap();
    assert_eq!(
        (deleted.status, deleted.reason.as_str()),
        (ConditionStatus::False, "Running")
    );
    assert_eq!(
        status.condition(ConditionType::VMReady).unwrap().message,
        "tart exec ready after 13.91s"
    );
}

#[test]
fn a_minimal_spec_gets_the_documented_defaults_and_serializes_without_nulls() {
    let spec: MacBuildSpec =
        serde_json::from_value(json!({"image": "img", "steps": [{"name": "build", "run": ["make"]}]})).unwrap();
    assert_eq!(spec.max_attempts, 2);
    assert_eq!(spec.timeout_seconds, 3600);
    assert!(!spec.cancel_requested && spec.host_selector.is_empty());
    assert!(spec.source.is_none() && spec.artifacts.is_none() && spec.resources.is_none());
    assert_eq!(
        serde_json::to_value(&spec).unwrap(),
        json!({"image": "img", "steps": [{"name": "build", "run": ["make"]}], "timeoutSeconds": 3600, "maxAttempts": 2})
    );
}

#[test]
fn spec_round_trips_with_camel_case_names() {
    let mb: MacBuild = serde_saphyr::from_str(DESIGN_EXAMPLE).unwrap();
    let mut spec = mb.spec.clone();
    spec.cancel_requested = true;
    let json = serde_json::to_value(&spec).unwrap();
    for key in [
        "image",
        "source",
        "steps",
        "testReport",
        "artifacts",
        "timeoutSeconds",
        "maxAttempts",
        "resources",
        "hostSelector",
        "cancelRequested",
    ] {
        assert!(json.get(key).is_some(), "spec key {key} missing in {json}");
    }
    assert_eq!(json["resources"], json!({"cpu": 4, "memoryMiB": 8192}));
    assert_eq!(serde_json::from_value::<MacBuildSpec>(json).unwrap(), spec);
}

#[test]
fn status_round_trips_with_camel_case_names() {
    let now: Timestamp = "2026-10-05T02:56:06Z".parse().unwrap();
    let mut status = MacBuildStatus {
        phase: Some(Phase::Succeeded),
        outcome: Some(Outcome::Succeeded),
        claim: Some(Claim {
            holder: "mac-mini-07".into(),
            attempt: "build-42#2".into(),
            epoch: 2,
        }),
        attempts: vec![AttemptRecord {
            number: 2,
            id: "build-42#2".into(),
            vm: "mb-ci-build-42-0a1b2c3d".into(),
            host: "mac-mini-07".into(),
            outcome: Some(Outcome::Succeeded),
            reason: Some(Reason::TestsPassed),
            started_at: Some(time("2026-10-05T02:44:00Z")),
            finished_at: Some(time("2026-10-05T02:56:06Z")),
            message: Some("2/2 tests passed".into()),
        }],
        journal_seq: Some(130),
        vm: Some("mb-ci-build-42-0a1b2c3d".into()),
        deadline: Some(time("2026-10-05T02:56:06Z")),
        results: Some(BuildResults {
            tests_passed: Some(2),
            tests_total: Some(2),
            artifact_url: Some("s3://ci-artifacts/app/App.ipa".into()),
        }),
        message: Some("done".into()),
        ..MacBuildStatus::default()
    };
    status.set_condition(Condition::new(
        ConditionType::VMDeleted,
        ConditionStatus::True,
        Reason::VMDeleted,
        "",
        now,
    ));
    let json = serde_json::to_value(&status).unwrap();
    let keys: Vec<&str> = json.as_object().unwrap().keys().map(String::as_str).collect();
    for key in [
        "phase",
        "outcome",
        "conditions",
        "claim",
        "attempts",
        "journalSeq",
        "vm",
        "deadline",
        "results",
        "message",
    ] {
        assert!(keys.contains(&key), "status key {key} missing in {keys:?}");
    }
    assert_eq!(
        json["attempts"][0],
        json!({"number": 2, "id": "build-42#2", "vm": "mb-ci-build-42-0a1b2c3d", "host": "mac-mini-07",
               "outcome": "Succeeded", "reason": "TestsPassed", "startedAt": "2026-10-05T02:44:00Z",
               "finishedAt": "2026-10-05T02:56:06Z", "message": "2/2 tests passed"})
    );
    assert_eq!(
        json["results"],
        json!({"testsPassed": 2, "testsTotal": 2, "artifactUrl": "s3://ci-artifacts/app/App.ipa"})
    );
    assert_eq!(serde_json::from_value::<MacBuildStatus>(json).unwrap(), status);
    assert_eq!(serde_json::to_value(MacBuildStatus::default()).unwrap(), json!({}));
}

#[test]
fn unknown_enum_spellings_are_rejected_on_read() {
    let err = serde_json::from_value::<MacBuildStatus>(json!({"phase": "Sleeping"})).unwrap_err();
    assert!(err.to_string().contains("Sleeping"), "{err}");
}

#[test]
fn phase_follows_the_latest_attempt() {
    use AttemptState as S;
    use Outcome as O;
    let table = [
        (S::Requested, None, false, Phase::Pending),
        (S::Admitted, None, false, Phase::Admitted),
        (S::Booting, None, false, Phase::Booting),
        (S::Running, None, false, Phase::Running),
        (S::Collecting, None, false, Phase::Collecting),
        (S::Retiring, Some(O::Succeeded), false, Phase::Retiring),
        (S::Retiring, Some(O::Interrupted), true, Phase::Retiring),
        // The source: an interrupted attempt's VM quarantined before a retry shows Pending.
        (S::Quarantined, Some(O::Interrupted), true, Phase::Pending),
        (S::Quarantined, Some(O::Interrupted), false, Phase::Retiring),
        (S::Quarantined, Some(O::Succeeded), false, Phase::Retiring),
        (S::Retired, Some(O::Succeeded), false, Phase::Succeeded),
        (S::Retired, Some(O::Failed), false, Phase::Failed),
        (S::Retired, Some(O::Cancelled), false, Phase::Cancelled),
        (S::Retired, Some(O::Interrupted), true, Phase::Pending),
        (S::Retired, Some(O::Interrupted), false, Phase::Failed),
        (S::Retired, None, false, Phase::Pending),
    ];
    for (state, outcome, retry, expected) in table {
        assert_eq!(
            Phase::for_attempt(state, outcome, retry),
            expected,
            "{state} {outcome:?} retry={retry}"
        );
    }
    let terminal: Vec<Phase> = Phase::ALL.iter().copied().filter(|p| p.is_terminal()).collect();
    assert_eq!(terminal, [Phase::Succeeded, Phase::Failed, Phase::Cancelled]);
}

#[test]
fn crd_names_scope_and_subresources() {
    let crd = crd_json();
    assert_eq!(crd["metadata"]["name"], "macbuilds.tartan.dev");
    assert_eq!(crd["spec"]["group"], "tartan.dev");
    assert_eq!(crd["spec"]["scope"], "Namespaced");
    assert_eq!(
        crd["spec"]["names"],
        json!({"kind": "MacBuild", "plural": "macbuilds", "singular": "macbuild", "shortNames": ["mb"],
               "categories": ["ci"]})
    );
    let version = &crd["spec"]["versions"][0];
    assert_eq!(
        (version["name"].as_str(), version["served"].as_bool()),
        (Some("v1alpha1"), Some(true))
    );
    assert_eq!(version["storage"], true);
    assert_eq!(version["subresources"], json!({"status": {}}));
}

#[test]
fn printer_columns_serve_kubectl_get_mb() {
    let columns = crd_json()["spec"]["versions"][0]["additionalPrinterColumns"].clone();
    let shown: Vec<(String, String, String)> = columns
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c.get("priority").is_none_or(|p| p == 0))
        .map(|c| {
            let field = |k: &str| c[k].as_str().unwrap().to_string();
            (field("name"), field("type"), field("jsonPath"))
        })
        .collect();
    let expected = [
        ("Phase", "string", ".status.phase"),
        ("Attempt", "string", ".status.claim.attempt"),
        ("Host", "string", ".status.claim.holder"),
        ("Outcome", "string", ".status.outcome"),
        ("Age", "date", ".metadata.creationTimestamp"),
    ];
    let expected: Vec<(String, String, String)> = expected
        .iter()
        .map(|(a, b, c)| (a.to_string(), b.to_string(), c.to_string()))
        .collect();
    assert_eq!(shown, expected);
}

#[test]
fn printer_column_paths_exist_in_the_schema() {
    let schema = schema();
    for column in crd_json()["spec"]["versions"][0]["additionalPrinterColumns"]
        .as_array()
        .unwrap()
    {
        let path = column["jsonPath"].as_str().unwrap();
        if path.starts_with(".metadata.") {
            continue;
        }
        let mut node = &schema;
        for segment in path.trim_start_matches('.').split('.') {
            node = &node["properties"][segment];
            assert!(
                node.is_object(),
                "printer column path {path} is not in the schema at {segment}"
            );
        }
        assert_eq!(node["type"], "string", "{path}");
    }
}

#[test]
fn spec_validation_is_in_the_schema() {
    let spec = &schema()["properties"]["spec"];
    assert_eq!(spec["required"], json!(["image", "steps"]));
    let p = &spec["properties"];
    assert_eq!(p["image"]["minLength"], 1);
    assert_eq!(p["steps"]["minItems"], 1);
    assert_eq!(p["steps"]["x-kubernetes-list-type"], "map");
    assert_eq!(p["steps"]["x-kubernetes-list-map-keys"], json!(["name"]));
    assert_eq!(p["steps"]["items"]["required"], json!(["name", "run"]));
    assert_eq!(p["steps"]["items"]["properties"]["run"]["minItems"], 1);
    assert_eq!(p["steps"]["items"]["properties"]["run"]["items"]["minLength"], 1);
    assert!(p["steps"]["items"]["properties"]["name"]["pattern"].is_string());
    assert_eq!(p["source"]["required"], json!(["git", "revision"]));
    assert_eq!(
        p["artifacts"]["required"],
        json!(["paths"]),
        "an unset destination means the agent's configured default"
    );
    assert_eq!(p["artifacts"]["properties"]["paths"]["minItems"], 1);
    let destination = p["artifacts"]["properties"]["destination"]["pattern"].as_str().unwrap();
    assert!(
        destination.starts_with("^(s3://") && destination.contains("|file:///"),
        "{destination}"
    );
    assert_eq!(p["timeoutSeconds"]["default"], 3600);
    assert_eq!(p["timeoutSeconds"]["minimum"], 1.0);
    assert_eq!(p["maxAttempts"]["default"], 2);
    assert_eq!(
        (
            p["maxAttempts"]["minimum"].as_f64(),
            p["maxAttempts"]["maximum"].as_f64()
        ),
        (Some(1.0), Some(3.0))
    );
    assert_eq!(p["resources"]["properties"]["cpu"]["minimum"], 1.0);
    assert_eq!(p["resources"]["properties"]["memoryMiB"]["minimum"], 2048.0);
    assert_eq!(p["hostSelector"]["additionalProperties"], json!({"type": "string"}));
    assert_eq!(p["cancelRequested"]["type"], "boolean");
}

#[test]
fn status_enums_are_listed_in_the_schema() {
    let status = &schema()["properties"]["status"]["properties"];
    let names = |v: &Value| -> Vec<String> {
        v["enum"]
            .as_array()
            .unwrap_or_else(|| panic!("no enum in {v}"))
            .iter()
            .map(|s| s.as_str().unwrap().into())
            .collect()
    };
    let phases: Vec<String> = Phase::ALL.iter().map(|p| p.to_string()).collect();
    assert_eq!(names(&status["phase"]), phases);
    let outcomes: Vec<String> = Outcome::ALL.iter().map(|o| o.to_string()).collect();
    assert_eq!(names(&status["outcome"]), outcomes);
    assert_eq!(names(&status["attempts"]["items"]["properties"]["outcome"]), outcomes);
    let condition = &status["conditions"]["items"]["properties"];
    assert_eq!(names(&condition["status"]), ["True", "False", "Unknown"]);
    assert_eq!(
        names(&condition["type"]),
        ["Claimed", "VMReady", "VMDeleted", "Succeeded"]
    );
    assert!(names(&condition["reason"]).contains(&"Running".to_string()));
    assert!(names(&condition["reason"]).contains(&"SlotFree".to_string()));
    assert_eq!(status["conditions"]["x-kubernetes-list-map-keys"], json!(["type"]));
    assert_eq!(
        status["conditions"]["items"]["required"],
        json!(["lastTransitionTime", "reason", "status", "type"])
    );
}

#[test]
fn optional_fields_keep_their_own_description() {
    let status = &schema()["properties"]["status"]["properties"];
    assert!(
        status["phase"]["description"]
            .as_str()
            .unwrap()
            .contains("holding agent")
    );
    assert!(
        status["outcome"]["description"]
            .as_str()
            .unwrap()
            .contains("latest attempt")
    );
}

/// The rules kube-apiserver applies to a CRD schema (structural schema, plus what it accepts for
/// list maps, formats and defaults), checked on every node.
fn check_structural(path: &str, node: &Value, problems: &mut Vec<String>) {
    let Some(object) = node.as_object() else {
        problems.push(format!("{path}: schema is not an object"));
        return;
    };
    for forbidden in [
        "$ref",
        "anyOf",
        "oneOf",
        "allOf",
        "not",
        "definitions",
        "$defs",
        "$schema",
    ] {
        if object.contains_key(forbidden) {
            problems.push(format!("{path}: has {forbidden}"));
        }
    }
    if object.contains_key("x-kubernetes-preserve-unknown-fields") {
        problems.push(format!(
            "{path}: preserves unknown fields, nothing in MacBuild needs that"
        ));
    }
    let Some(type_) = object.get("type").and_then(Value::as_str) else {
        problems.push(format!("{path}: no type"));
        return;
    };
    if let Some(format) = object.get("format").and_then(Value::as_str) {
        let known = match type_ {
            "integer" => ["int32", "int64"].contains(&format),
            "string" => ["date-time", "date", "byte", "uri"].contains(&format),
            _ => false,
        };
        if !known {
            problems.push(format!(
                "{path}: format {format} on {type_} is not one the apiserver knows"
            ));
        }
    }
    if let Some(values) = object.get("enum").and_then(Value::as_array)
        && (type_ != "string" || !values.iter().all(Value::is_string))
    {
        problems.push(format!("{path}: enum values must be strings of a string schema"));
    }
    if let Some(default) = object.get("default") {
        let fits = match type_ {
            "integer" => default.is_i64() || default.is_u64(),
            "string" => default.is_string(),
            "boolean" => default.is_boolean(),
            "array" => default.is_array(),
            "object" => default.is_object(),
            _ => false,
        };
        if !fits {
            problems.push(format!("{path}: default {default} does not fit type {type_}"));
        }
    }
    match type_ {
        "object" => {
            let properties = object.get("properties").and_then(Value::as_object);
            if properties.is_some() && object.contains_key("additionalProperties") {
                problems.push(format!("{path}: both properties and additionalProperties"));
            }
            if let Some(required) = object.get("required").and_then(Value::as_array) {
                for name in required {
                    let name = name.as_str().unwrap_or_default();
                    if !properties.is_some_and(|p| p.contains_key(name)) {
                        problems.push(format!("{path}: required {name} is not a property"));
                    }
                }
            }
            for (name, child) in properties.into_iter().flatten() {
                check_structural(&format!("{path}.{name}"), child, problems);
            }
            if let Some(additional) = object.get("additionalProperties") {
                check_structural(&format!("{path}[*]"), additional, problems);
            }
        }
        "array" => {
            let Some(items) = object.get("items") else {
                problems.push(format!("{path}: array without items"));
                return;
            };
            if object.get("x-kubernetes-list-type").and_then(Value::as_str) == Some("map") {
                let required = items
                    .get("required")
                    .and_then(Value::as_array)
                    .cloned()
                    .unwrap_or_default();
                for key in object
                    .get("x-kubernetes-list-map-keys")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    if !required.contains(key) {
                        problems.push(format!("{path}: list-map key {key} is not required in the items"));
                    }
                }
            }
            check_structural(&format!("{path}[]"), items, problems);
        }
        "string" | "integer" | "number" | "boolean" => {}
        other => problems.push(format!("{path}: unknown type {other}")),
    }
}

#[test]
fn the_schema_is_structural_as_kube_apiserver_requires() {
    let mut problems = Vec::new();
    check_structural("openAPIV3Schema", &schema(), &mut problems);
    assert!(
        problems.is_empty(),
        "the MacBuild schema would be refused or misread:\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_structural_check_catches_what_kube_derive_could_emit() {
    let mut problems = Vec::new();
    let bad = json!({"type": "object", "properties": {
        "a": {"anyOf": [{"type": "string"}, {"enum": [null]}]},
        "b": {"type": "integer", "format": "uint32"},
        "c": {"type": "object", "x-kubernetes-preserve-unknown-fields": true},
        "d": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}},
              "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["k"]},
    }, "required": ["e"]});
    check_structural("t", &bad, &mut problems);
    assert_eq!(problems.len(), 6, "{problems:#?}");
}
