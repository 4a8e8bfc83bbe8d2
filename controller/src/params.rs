//! CustomRun params / `customSpec.spec` → MacBuild spec (as JSON in the MacBuild CRD's
//! camelCase shape; the I/O layer turns it into the api crate's typed spec).
//!
//! # Parameters
//!
//! A pipeline task `taskRef: {apiVersion: tartan.dev/v1alpha1, kind: MacBuild}` takes these
//! params (all optional except `image` and `steps`, unless `taskSpec.spec` supplies them):
//!
//! | param | type | MacBuild field |
//! |---|---|---|
//! | `image` | string | `spec.image` (tart image to clone, e.g. `ghcr.io/cirruslabs/macos-sequoia-xcode:16`) |
//! | `steps` | string: a YAML/JSON list of `{name, run: [argv…]}`; or array: one shell command per element, run as `/bin/sh -c` and named `step-1`, `step-2`, … | `spec.steps` |
//! | `git-url` | string | `spec.source.git` |
//! | `git-revision` | string | `spec.source.revision` |
//! | `test-report` | string (path of a JUnit XML file in the guest) | `spec.testReport` |
//! | `artifact-paths` | array, or a comma-separated string | `spec.artifacts.paths` |
//! | `artifact-destination` | string (e.g. `s3://ci-artifacts/app/`) | `spec.artifacts.destination` |
//! | `max-attempts` | string integer 1–3 (attempts the agent may make; Tekton `retries` are refused) | `spec.maxAttempts` |
//! | `timeout-seconds` | string integer (host execution timeout; capped by the CustomRun timeout) | `spec.timeoutSeconds` |
//! | `cpu` | string integer | `spec.resources.cpu` |
//! | `memory-mib` | string integer | `spec.resources.memoryMiB` |
//! | `host-selector` | object, or `key=value,key=value` string | `spec.hostSelector` |
//!
//! With `taskSpec` (→ `customSpec.spec`) the embedded object is the MacBuild spec itself in its
//! camelCase form; params given as well override its fields. Unknown param names are refused
//! (a typo must not silently drop a setting).

use crate::customrun::{CustomRunSpec, Param};
use serde_json::{Map, Value, json};
use std::time::Duration;

/// Every param name this task understands.
pub const PARAM_NAMES: &[&str] = &[
    "image",
    "steps",
    "git-url",
    "git-revision",
    "test-report",
    "artifact-paths",
    "artifact-destination",
    "max-attempts",
    "timeout-seconds",
    "cpu",
    "memory-mib",
    "host-selector",
];

/// Why a CustomRun cannot become a MacBuild. Each maps to a specific `Succeeded=False` reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    #[error("{0}")]
    CustomRef(String),
    #[error("{0}")]
    Params(String),
    #[error("{0}")]
    Spec(String),
}

impl SpecError {
    /// The CustomRun `Succeeded=False` reason.
    pub fn reason(&self) -> &'static str {
        match self {
            SpecError::CustomRef(_) => "InvalidCustomRef",
            SpecError::Params(_) => "InvalidParams",
            SpecError::Spec(_) => "InvalidMacBuildSpec",
        }
    }
}

fn param_string(p: &Param) -> Result<&str, SpecError> {
    p.value
        .as_str()
        .ok_or_else(|| SpecError::Params(format!("param {:?} must be a string, got {}", p.name, p.value)))
}

fn param_int(p: &Param, min: i64, max: i64) -> Result<i64, SpecError> {
    let text = param_string(p)?;
    let n: i64 = text
        .trim()
        .parse()
        .map_err(|_| SpecError::Params(format!("param {:?} must be an integer, got {text:?}", p.name)))?;
    if n < min || n > max {
        return Err(SpecError::Params(format!(
            "param {:?} must be between {min} and {max}, got {n}",
            p.name
        )));
    }
    Ok(n)
}

fn param_list(p: &Param) -> Result<Vec<String>, SpecError> {
    match &p.value {
        Value::String(s) => Ok(s
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect()),
        Value::Array(items) => items
            .iter()
            .map(|v| {
                v.as_str()
                    .map(String::from)
                    .ok_or_else(|| SpecError::Params(format!("param {:?} must list strings, got {v}", p.name)))
            })
            .collect(),
        other => Err(SpecError::Params(format!(
            "param {:?} must be a string or a list of strings, got {other}",
            p.name
        ))),
    }
}

fn param_steps(p: &Param) -> Result<Value, SpecError> {
    match &p.value {
        Value::String(text) => {
            let steps: Vec<Value> = serde_saphyr::from_str::<Vec<Value>>(text).map_err(|e| {
                SpecError::Params(format!(
                    "param \"steps\" must be a YAML or JSON list of {{name, run: [argv...]}}: {e}"
                ))
            })?;
            if steps.is_empty() {
                return Err(SpecError::Params("param \"steps\" lists no step".into()));
            }
            Ok(Value::Array(steps))
        }
        Value::Array(_) => {
            let commands = param_list(p)?;
            if commands.is_empty() {
                return Err(SpecError::Params("param \"steps\" lists no step".into()));
            }
            Ok(Value::Array(
                commands
                    .into_iter()
                    .enumerate()
                    .map(|(i, cmd)| json!({"name": format!("step-{}", i + 1), "run": ["/bin/sh", "-c", cmd]}))
                    .collect(),
            ))
        }
        other => Err(SpecError::Params(format!(
            "param \"steps\" must be a string or a list of strings, got {other}"
        ))),
    }
}

fn param_selector(p: &Param) -> Result<Value, SpecError> {
    match &p.value {
        Value::Object(m) => {
            if let Some((k, v)) = m.iter().find(|(_, v)| !v.is_string()) {
                return Err(SpecError::Params(format!(
                    "param \"host-selector\" value of {k:?} must be a string, got {v}"
                )));
            }
            Ok(Value::Object(m.clone()))
        }
        Value::String(s) => {
            let mut m = Map::new();
            for pair in s.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                let (k, v) = pair.split_once('=').ok_or_else(|| {
                    SpecError::Params(format!("param \"host-selector\" entry {pair:?} is not key=value"))
                })?;
                m.insert(k.trim().to_string(), Value::String(v.trim().to_string()));
            }
            Ok(Value::Object(m))
        }
        other => Err(SpecError::Params(format!(
            "param \"host-selector\" must be an object or k=v,… string, got {other}"
        ))),
    }
}

fn object_at<'a>(spec: &'a mut Map<String, Value>, key: &str) -> &'a mut Map<String, Value> {
    let slot = spec.entry(key.to_string()).or_insert_with(|| Value::Object(Map::new()));
    if !slot.is_object() {
        *slot = Value::Object(Map::new());
    }
    slot.as_object_mut().expect("just made an object")
}

/// Builds the MacBuild spec for a CustomRun whose filter already matched. `timeout` is the
/// CustomRun's effective timeout (`None` = no timeout): the MacBuild's `timeoutSeconds` never
/// exceeds it, so the host deadline cannot outlive the CustomRun deadline.
pub fn macbuild_spec(run: &CustomRunSpec, timeout: Option<Duration>) -> Result<Value, SpecError> {
    if let Some(r) = &run.custom_ref {
        if let Some(name) = r.name.as_deref().filter(|n| !n.is_empty()) {
            return Err(SpecError::CustomRef(format!(
                "customRef.name {name:?} is not supported: MacBuild has no stored templates; pass the build \
                 through params or an embedded taskSpec"
            )));
        }
        if r.resolver.is_some() || r.bundle.is_some() || !r.params.is_empty() {
            return Err(SpecError::CustomRef(
                "customRef.resolver/bundle/params are not supported for MacBuild; pass the build through params".into(),
            ));
        }
    }
    let mut spec = match run.custom_spec.as_ref().and_then(|s| s.spec.clone()) {
        None => Map::new(),
        Some(Value::Object(m)) => m,
        Some(other) => {
            return Err(SpecError::Spec(format!(
                "customSpec.spec must be an object, got {other}"
            )));
        }
    };
    let mut seen = std::collections::BTreeSet::new();
    for p in &run.params {
        if !seen.insert(p.name.as_str()) {
            return Err(SpecError::Params(format!("param {:?} is given twice", p.name)));
        }
        match p.name.as_str() {
            "image" => {
                spec.insert("image".into(), json!(param_string(p)?));
            }
            "steps" => {
                spec.insert("steps".into(), param_steps(p)?);
            }
            "git-url" => {
                object_at(&mut spec, "source").insert("git".into(), json!(param_string(p)?));
            }
            "git-revision" => {
                object_at(&mut spec, "source").insert("revision".into(), json!(param_string(p)?));
            }
            "test-report" => {
                spec.insert("testReport".into(), json!(param_string(p)?));
            }
            "artifact-paths" => {
                object_at(&mut spec, "artifacts").insert("paths".into(), json!(param_list(p)?));
            }
            "artifact-destination" => {
                object_at(&mut spec, "artifacts").insert("destination".into(), json!(param_string(p)?));
            }
            "max-attempts" => {
                spec.insert("maxAttempts".into(), json!(param_int(p, 1, 3)?));
            }
            "timeout-seconds" => {
                spec.insert("timeoutSeconds".into(), json!(param_int(p, 1, i64::from(u32::MAX))?));
            }
            "cpu" => {
                object_at(&mut spec, "resources").insert("cpu".into(), json!(param_int(p, 1, 1024)?));
            }
            "memory-mib" => {
                object_at(&mut spec, "resources").insert("memoryMiB".into(), json!(param_int(p, 1, 1 << 24)?));
            }
            "host-selector" => {
                spec.insert("hostSelector".into(), param_selector(p)?);
            }
            other => {
                return Err(SpecError::Params(format!(
                    "unknown param {other:?}; MacBuild takes {}",
                    PARAM_NAMES.join(", ")
                )));
            }
        }
    }
    for required in ["image", "steps"] {
        if !spec.contains_key(required) {
            let param = required;
            return Err(SpecError::Params(format!(
                "missing {required:?}: give param {param:?} or taskSpec.spec.{required}"
            )));
        }
    }
    // Only the shape: whether the destination is allowed is the agent's to decide (its config).
    if let Some(dest) = spec
        .get("artifacts")
        .and_then(|a| a.get("destination"))
        .and_then(Value::as_str)
        && !dest.is_empty()
    {
        tartan_api::destination::Destination::parse(dest)
            .map_err(|e| SpecError::Params(format!("param \"artifact-destination\": {e}")))?;
    }
    if let Some(limit) = timeout {
        // Whole seconds, rounded up, at least 1.
        let cap = limit.as_secs() + u64::from(limit.subsec_nanos() > 0);
        let cap = cap.max(1);
        let wanted = spec.get("timeoutSeconds").and_then(Value::as_u64);
        let secs = wanted.map_or(cap, |w| w.min(cap));
        spec.insert("timeoutSeconds".into(), json!(secs));
    }
    Ok(Value::Object(spec))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(yaml: &str) -> CustomRunSpec {
        serde_saphyr::from_str(yaml).unwrap()
    }

    const REF: &str = "customRef: {apiVersion: tartan.dev/v1alpha1, kind: MacBuild}\n";

    #[test]
    fn malformed_artifact_destinations_are_refused_before_a_macbuild_exists() {
        for (dest, why) in [
            ("https://x/y", "neither s3://"),
            ("file://relative/dir", "absolute path"),
            ("file:///srv/../etc/", "'..'"),
            ("file:///srv/%2e%2e/etc/", "percent-escapes"),
            ("s3://Bad_Bucket/x", "bucket name"),
        ] {
            let run = spec(&format!(
                "{REF}params: [{{name: image, value: i}}, {{name: steps, value: [make]}}, \
                 {{name: artifact-destination, value: {dest:?}}}]"
            ));
            let e = macbuild_spec(&run, None).unwrap_err();
            assert_eq!(e.reason(), "InvalidParams");
            assert!(
                e.to_string().contains(why) && e.to_string().contains(dest),
                "{dest}: {e}"
            );
        }
        // Through an embedded spec too, and with a NUL.
        let run = spec(&format!(
            "{REF}customSpec: {{spec: {{image: i, steps: [{{name: a, run: [b]}}], artifacts: {{paths: [x], \
             destination: \"file:///srv/a\\0b/\"}}}}}}"
        ));
        let e = macbuild_spec(&run, None).unwrap_err();
        assert!(e.to_string().contains("control characters"), "{e}");
        // Well-formed ones pass; whether they are allowed is the agent's decision.
        let run = spec(&format!(
            "{REF}params: [{{name: image, value: i}}, {{name: steps, value: [make]}}, \
             {{name: artifact-destination, value: \"file:///anywhere/\"}}]"
        ));
        assert!(macbuild_spec(&run, None).is_ok());
    }

    #[test]
    fn every_param_maps_to_its_field() {
        let run = spec(&format!(
            r#"{REF}params:
- {{name: image, value: "ghcr.io/cirruslabs/macos-sequoia-xcode:16"}}
- {{name: steps, value: "[{{name: build, run: [xcodebuild, -scheme, App, build]}}]"}}
- {{name: git-url, value: "https://github.com/acme/app.git"}}
- {{name: git-revision, value: 3f2c9e1}}
- {{name: test-report, value: out/junit.xml}}
- {{name: artifact-paths, value: [out/App.ipa, out/App.dSYM]}}
- {{name: artifact-destination, value: "s3://ci-artifacts/app/"}}
- {{name: max-attempts, value: "2"}}
- {{name: timeout-seconds, value: "1200"}}
- {{name: cpu, value: "4"}}
- {{name: memory-mib, value: "8192"}}
- {{name: host-selector, value: "xcode=16, arch=arm64"}}
"#
        ));
        let got = macbuild_spec(&run, Some(Duration::from_secs(1800))).unwrap();
        assert_eq!(
            got,
            json!({
                "image": "ghcr.io/cirruslabs/macos-sequoia-xcode:16",
                "steps": [{"name": "build", "run": ["xcodebuild", "-scheme", "App", "build"]}],
                "source": {"git": "https://github.com/acme/app.git", "revision": "3f2c9e1"},
                "testReport": "out/junit.xml",
                "artifacts": {"paths": ["out/App.ipa", "out/App.dSYM"], "destination": "s3://ci-artifacts/app/"},
                "maxAttempts": 2,
                "timeoutSeconds": 1200,
                "resources": {"cpu": 4, "memoryMiB": 8192},
                "hostSelector": {"xcode": "16", "arch": "arm64"},
            })
        );
    }

    #[test]
    fn array_steps_become_shell_steps_and_timeout_comes_from_the_customrun() {
        let run = spec(&format!(
            "{REF}params: [{{name: image, value: img}}, {{name: steps, value: [make build, make test]}}, \
             {{name: artifact-paths, value: 'a.ipa, b.dSYM'}}, {{name: host-selector, value: {{xcode: '16'}}}}]"
        ));
        let got = macbuild_spec(&run, Some(Duration::from_millis(100_500))).unwrap();
        assert_eq!(
            got["steps"][1],
            json!({"name": "step-2", "run": ["/bin/sh", "-c", "make test"]})
        );
        assert_eq!(got["timeoutSeconds"], 101, "rounded up to whole seconds");
        assert_eq!(got["artifacts"]["paths"], json!(["a.ipa", "b.dSYM"]));
        assert_eq!(got["hostSelector"], json!({"xcode": "16"}));
        // No CustomRun timeout: the host timeout is left to the spec (here: unset).
        assert!(macbuild_spec(&run, None).unwrap().get("timeoutSeconds").is_none());
    }

    #[test]
    fn timeout_param_is_capped_by_the_customrun_timeout() {
        let run = spec(&format!(
            "{REF}params: [{{name: image, value: i}}, {{name: steps, value: [x]}}, {{name: timeout-seconds, value: '9000'}}]"
        ));
        assert_eq!(
            macbuild_spec(&run, Some(Duration::from_secs(100))).unwrap()["timeoutSeconds"],
            100
        );
        assert_eq!(macbuild_spec(&run, None).unwrap()["timeoutSeconds"], 9000);
    }

    #[test]
    fn custom_spec_is_the_base_and_params_override() {
        let run = spec(
            "customSpec: {apiVersion: tartan.dev/v1alpha1, kind: MacBuild, spec: {image: base, steps: [{name: b, run: [true]}], \
             source: {git: g, revision: r1}}}\nparams: [{name: git-revision, value: r2}]",
        );
        let got = macbuild_spec(&run, None).unwrap();
        assert_eq!(got["image"], "base");
        assert_eq!(got["source"], json!({"git": "g", "revision": "r2"}));
    }

    #[test]
    fn invalid_inputs_fail_with_specific_reasons() {
        let cases: &[(&str, &str, &str)] = &[
            (
                "customRef: {apiVersion: tartan.dev/v1alpha1, kind: MacBuild, name: tmpl}",
                "InvalidCustomRef",
                "customRef.name",
            ),
            (
                "customRef: {apiVersion: tartan.dev/v1alpha1, kind: MacBuild, resolver: git}",
                "InvalidCustomRef",
                "resolver",
            ),
            (
                "customSpec: {apiVersion: tartan.dev/v1alpha1, kind: MacBuild, spec: [1]}",
                "InvalidMacBuildSpec",
                "object",
            ),
            (
                &format!("{REF}params: [{{name: steps, value: [x]}}]"),
                "InvalidParams",
                "missing \"image\"",
            ),
            (
                &format!("{REF}params: [{{name: image, value: i}}]"),
                "InvalidParams",
                "missing \"steps\"",
            ),
            (
                &format!("{REF}params: [{{name: image, value: [i]}}]"),
                "InvalidParams",
                "must be a string",
            ),
            (
                &format!("{REF}params: [{{name: imagee, value: i}}]"),
                "InvalidParams",
                "unknown param \"imagee\"",
            ),
            (
                &format!("{REF}params: [{{name: image, value: i}}, {{name: image, value: j}}]"),
                "InvalidParams",
                "given twice",
            ),
            (
                &format!("{REF}params: [{{name: max-attempts, value: '4'}}]"),
                "InvalidParams",
                "between 1 and 3",
            ),
            (
                &format!("{REF}params: [{{name: max-attempts, value: two}}]"),
                "InvalidParams",
                "integer",
            ),
            (
                &format!("{REF}params: [{{name: steps, value: '{{a: 1}}'}}]"),
                "InvalidParams",
                "YAML or JSON list",
            ),
            (
                &format!("{REF}params: [{{name: steps, value: []}}]"),
                "InvalidParams",
                "no step",
            ),
            (
                &format!("{REF}params: [{{name: host-selector, value: 'xcode'}}]"),
                "InvalidParams",
                "key=value",
            ),
            (
                &format!("{REF}params: [{{name: host-selector, value: {{a: [1]}}}}]"),
                "InvalidParams",
                "must be a string",
            ),
            (
                &format!("{REF}params: [{{name: artifact-paths, value: [1]}}]"),
                "InvalidParams",
                "list strings",
            ),
        ];
        for (yaml, reason, needle) in cases {
            let err = macbuild_spec(&spec(yaml), None).unwrap_err();
            assert_eq!(err.reason(), *reason, "{yaml}: {err}");
            assert!(
                err.to_string().contains(needle),
                "{yaml}: {err} should mention {needle}"
            );
        }
    }
}
