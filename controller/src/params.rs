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
//! | `steps` | string: a YAML/JSON list of `{name, run: [argv…], timeoutSeconds?}`; or array: one shell command per element, run as `/bin/sh -c` and named `step-1`, `step-2`, … | `spec.steps` |
//! | `git-url` | string | `spec.source.git` |
//! | `git-revision` | string | `spec.source.revision` |
//! | `test-report` | string (path of a JUnit XML file in the guest) | `spec.testReport` |
//! | `artifact-paths` | array, or a comma-separated string | `spec.artifacts.paths` |
//! | `artifact-destination` | string (e.g. `s3://ci-artifacts/app/`) | `spec.artifacts.destination` |
//! | `max-attempts` | string integer 1–3 (attempts the agent may make; Tekton `retries` are refused) | `spec.maxAttempts` |
//! | `timeout-seconds` | string integer 1–604800 (host execution timeout; capped by the CustomRun timeout) | `spec.timeoutSeconds` |
//! | `cpu` | string integer | `spec.resources.cpu` |
//! | `memory-mib` | string integer | `spec.resources.memoryMiB` |
//! | `host-selector` | object, or `key=value,key=value` string; keys and values as Kubernetes labels allow them | `spec.hostSelector` |
//! | `mounts` | array, or a comma-separated string, of names the agent's `[[mounts]]` declare (at most 16) | `spec.mounts` (`[{name}]`) |
//! | `env` | string: a YAML/JSON map of variable name → string value; or object | `spec.env[].value` |
//! | `secret-env` | string `NAME=secret/key,…`, or array of `NAME=secret/key` | `spec.env[].valueFrom.secretKeyRef` |
//!
//! With `taskSpec` (→ `customSpec.spec`) the embedded object is the MacBuild spec itself in its
//! camelCase form; params given as well override its fields. Unknown param names are refused
//! (a typo must not silently drop a setting).

use crate::customrun::{CustomRunSpec, Param};
use serde_json::{Map, Value, json};
use std::time::Duration;
use tartan_api::MAX_STEPS;

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
    "mounts",
    "env",
    "secret-env",
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

/// Checks a host selector as the MacBuild will carry it: every key and value must be one a
/// Kubernetes label could have (an agent's labels are matched against it; a selector no label
/// can satisfy would leave the build waiting for ever). One check for params and customSpec.spec.
fn check_selector(selector: &Map<String, Value>) -> Result<(), SelectorError> {
    for (k, v) in selector {
        let Some(v) = v.as_str() else {
            return Err(SelectorError::NotAString {
                key: k.clone(),
                value: v.clone(),
            });
        };
        tartan_api::check_label_key(k).map_err(SelectorError::Key)?;
        tartan_api::check_label_value(v).map_err(|why| SelectorError::Value { key: k.clone(), why })?;
    }
    Ok(())
}

/// Why a host selector can match no agent's labels.
#[derive(Debug, thiserror::Error)]
enum SelectorError {
    #[error("value of {key:?} must be a string, got {value}")]
    NotAString { key: String, value: Value },
    /// A key no label can have (the message of [`tartan_api::check_label_key`]).
    #[error("{0}")]
    Key(String),
    #[error("{why} (of key {key:?})")]
    Value { key: String, why: String },
}

fn param_selector(p: &Param) -> Result<Value, SpecError> {
    let invalid = |e: String| SpecError::Params(format!("param \"host-selector\": {e}"));
    let m = match &p.value {
        Value::Object(m) => m.clone(),
        Value::String(s) => {
            let mut m = Map::new();
            for pair in s.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                let (k, v) = pair
                    .split_once('=')
                    .ok_or_else(|| invalid(format!("entry {pair:?} is not key=value")))?;
                let k = k.trim().to_string();
                if m.insert(k.clone(), Value::String(v.trim().to_string())).is_some() {
                    return Err(invalid(format!("key {k:?} is given twice")));
                }
            }
            m
        }
        other => {
            return Err(SpecError::Params(format!(
                "param \"host-selector\" must be an object or k=v,… string, got {other}"
            )));
        }
    };
    check_selector(&m).map_err(|e| invalid(e.to_string()))?;
    Ok(Value::Object(m))
}

/// `mounts`: names (a list, or `a,b`) → `[{name}]`, each checked, none twice. Whether the agent
/// declares them is the agent's to decide (its config).
fn param_mounts(p: &Param) -> Result<Value, SpecError> {
    let requests: Vec<tartan_api::crd::MountRequest> = param_list(p)?
        .into_iter()
        .map(|name| tartan_api::crd::MountRequest { name })
        .collect();
    tartan_api::crd::check_mount_requests(&requests)
        .map_err(|e| SpecError::Params(format!("param \"mounts\": {e}")))?;
    Ok(json!(requests))
}

/// The `env` param: a map of variable name to string value, as an object or a YAML/JSON string.
fn param_env(p: &Param) -> Result<Vec<Value>, SpecError> {
    let invalid = |e: String| SpecError::Params(format!("param \"env\": {e}"));
    let map: Map<String, Value> = match &p.value {
        Value::Object(m) => m.clone(),
        Value::String(text) if text.trim().is_empty() => Map::new(),
        Value::String(text) => serde_saphyr::from_str::<Map<String, Value>>(text)
            .map_err(|e| invalid(format!("must be a YAML or JSON map of NAME: value: {e}")))?,
        other => {
            return Err(invalid(format!(
                "must be a map of NAME: value or a YAML/JSON string of one, got {other}"
            )));
        }
    };
    map.into_iter()
        .map(|(name, value)| match value {
            Value::String(v) => Ok(json!({"name": name, "value": v})),
            other => Err(invalid(format!(
                "the value of {name:?} must be a string, got {other} (quote it: {name}: \"{}\")",
                other.to_string().trim_matches('"')
            ))),
        })
        .collect()
}

/// The `secret-env` param: `NAME=secret/key` entries, comma-separated or as an array.
fn param_secret_env(p: &Param) -> Result<Vec<Value>, SpecError> {
    let invalid = |e: String| SpecError::Params(format!("param \"secret-env\": {e}"));
    param_list(p)?
        .iter()
        .map(|entry| {
            let (name, reference) = entry
                .split_once('=')
                .ok_or_else(|| invalid(format!("entry {entry:?} is not NAME=secret/key")))?;
            let (secret, key) = tartan_api::env::parse_secret_ref(reference.trim())
                .map_err(|e| invalid(format!("entry {entry:?}: {e}")))?;
            Ok(json!({"name": name.trim(), "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}))
        })
        .collect()
}

/// Merges the env entries of the params into `spec.env` (a param entry replaces the spec's entry
/// of the same name; the two params may not both name one variable) and checks the result.
fn merge_env(spec: &mut Map<String, Value>, from_params: Vec<(&'static str, Value)>) -> Result<(), SpecError> {
    let mut env: Vec<Value> = match spec.get("env") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items.clone(),
        Some(other) => {
            return Err(SpecError::Spec(format!(
                "customSpec.spec.env must be a list of {{name, value}} or {{name, valueFrom}}, got {other}"
            )));
        }
    };
    let name_of = |v: &Value| v.get("name").and_then(Value::as_str).map(String::from);
    let mut given = std::collections::BTreeMap::new();
    for (param, entry) in from_params {
        let name = name_of(&entry).unwrap_or_default();
        if let Some(first) = given.insert(name.clone(), param) {
            return Err(SpecError::Params(if first == param {
                format!("param {param:?}: env name {name:?} is given twice")
            } else {
                format!("env name {name:?} is given by both params \"env\" and \"secret-env\"; give it once")
            }));
        }
        env.retain(|e| name_of(e).as_deref() != Some(name.as_str()));
        env.push(entry);
    }
    if env.is_empty() {
        spec.remove("env");
        return Ok(());
    }
    let typed: Vec<tartan_api::EnvVar> = serde_json::from_value(Value::Array(env.clone()))
        .map_err(|e| SpecError::Spec(format!("customSpec.spec.env: {e}")))?;
    tartan_api::env::check_env(&typed).map_err(|e| {
        if given.is_empty() {
            SpecError::Spec(format!("customSpec.spec.env: {e}"))
        } else {
            SpecError::Params(e)
        }
    })?;
    spec.insert("env".into(), Value::Array(env));
    Ok(())
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
    match spec.get("hostSelector") {
        None | Some(Value::Null) => {}
        Some(Value::Object(m)) => {
            check_selector(m).map_err(|e| SpecError::Spec(format!("customSpec.spec.hostSelector: {e}")))?
        }
        Some(other) => {
            return Err(SpecError::Spec(format!(
                "customSpec.spec.hostSelector must be an object of label keys and values, got {other}"
            )));
        }
    }
    let mut seen = std::collections::BTreeSet::new();
    let mut env_params = Vec::new();
    for p in &run.params {
        if !seen.insert(p.name.as_str()) {
            return Err(SpecError::Params(format!("param {:?} is given twice", p.name)));
        }
        match p.name.as_str() {
            "image" => {
                let image = param_string(p)?;
                // The full check (registries, local images) is the agent's, which knows its config;
                // what no image can hold is refused here, before it is shown to anyone.
                if image.chars().any(|c| c.is_whitespace() || c.is_control()) {
                    return Err(SpecError::Params(format!(
                        "param \"image\": {image:?} is not an image reference (a space or a control character)"
                    )));
                }
                spec.insert("image".into(), json!(image));
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
                spec.insert(
                    "timeoutSeconds".into(),
                    json!(param_int(p, 1, i64::from(tartan_api::crd::MAX_TIMEOUT_SECONDS))?),
                );
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
            "mounts" => {
                spec.insert("mounts".into(), param_mounts(p)?);
            }
            "env" => env_params.extend(param_env(p)?.into_iter().map(|v| ("env", v))),
            "secret-env" => env_params.extend(param_secret_env(p)?.into_iter().map(|v| ("secret-env", v))),
            other => {
                return Err(SpecError::Params(format!(
                    "unknown param {other:?}; MacBuild takes {}",
                    PARAM_NAMES.join(", ")
                )));
            }
        }
    }
    merge_env(&mut spec, env_params)?;
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
        // Whole seconds, rounded up, at least 1, and at most what a MacBuild allows: a CustomRun
        // may wait longer (Tekton allows any duration), but one host execution is at most that.
        let cap = limit.as_secs() + u64::from(limit.subsec_nanos() > 0);
        let cap = cap.clamp(1, u64::from(tartan_api::crd::MAX_TIMEOUT_SECONDS));
        let wanted = spec.get("timeoutSeconds").and_then(Value::as_u64);
        let secs = wanted.map_or(cap, |w| w.min(cap));
        spec.insert("timeoutSeconds".into(), json!(secs));
    }
    let from_param = run.params.iter().any(|p| p.name == "steps");
    check_step_count(&spec, from_param)?;
    check_step_timeouts(&spec, from_param)?;
    Ok(Value::Object(spec))
}

/// At most [`MAX_STEPS`] steps, as the CRD's `maxItems` says: refused here with a message that
/// names the param, instead of by the API server when the MacBuild is made.
fn check_step_count(spec: &Map<String, Value>, from_param: bool) -> Result<(), SpecError> {
    let n = spec.get("steps").and_then(Value::as_array).map_or(0, Vec::len);
    if n <= MAX_STEPS {
        return Ok(());
    }
    let why = format!("{n} steps, more than the {MAX_STEPS} a MacBuild may have; join commands into fewer steps");
    Err(if from_param {
        SpecError::Params(format!("param \"steps\": {why}"))
    } else {
        SpecError::Spec(format!("customSpec.spec.steps: {why}"))
    })
}

/// `steps[].timeoutSeconds` against the build's final `timeoutSeconds` (after the CustomRun's
/// cap): a longer one could never fire. Only a spec of the right shape is checked here (a wrong
/// shape is refused when the MacBuild is made).
fn check_step_timeouts(spec: &Map<String, Value>, from_param: bool) -> Result<(), SpecError> {
    let invalid = |e: String| {
        if from_param {
            SpecError::Params(format!("param \"steps\": {e}"))
        } else {
            SpecError::Spec(format!("customSpec.spec.steps: {e}"))
        }
    };
    for step in spec.get("steps").and_then(Value::as_array).into_iter().flatten() {
        let Some(t) = step.get("timeoutSeconds") else { continue };
        if !t.as_u64().is_some_and(|n| (1..=604_800).contains(&n)) {
            let name = step
                .get("name")
                .map_or_else(|| "(unnamed)".to_string(), Value::to_string);
            let shown: String = t.to_string().chars().take(64).collect();
            return Err(invalid(format!(
                "step {name}: timeoutSeconds must be a whole number of seconds from 1 to 604800, got {shown}"
            )));
        }
    }
    let Ok(typed) = serde_json::from_value::<tartan_api::MacBuildSpec>(Value::Object(spec.clone())) else {
        return Ok(());
    };
    tartan_api::crd::check_step_timeouts(&typed).map_err(invalid)
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
    fn an_image_with_a_control_character_or_a_space_is_refused() {
        for image in [
            r#""ghcr.io/x\e]52;c;cHduZWQ=\a""#,
            r#""ghcr.io/x y:1""#,
            r#""ghcr.io/x\n""#,
        ] {
            let err = macbuild_spec(
                &spec(&format!(
                    "{REF}params: [{{name: image, value: {image}}}, {{name: steps, value: [make]}}]"
                )),
                None,
            )
            .unwrap_err()
            .to_string();
            assert!(
                err.contains("param \"image\"") && err.contains("control character"),
                "{image}: {err}"
            );
        }
    }

    #[test]
    fn more_steps_than_a_macbuild_may_have_are_refused_naming_the_limit() {
        let commands = |n: usize| (0..n).map(|i| format!("echo {i}")).collect::<Vec<_>>().join(", ");
        let as_param = |n: usize| {
            spec(&format!(
                "{REF}params: [{{name: image, value: i}}, {{name: steps, value: [{}]}}]",
                commands(n)
            ))
        };
        assert!(macbuild_spec(&as_param(MAX_STEPS), None).is_ok());
        let err = macbuild_spec(&as_param(MAX_STEPS + 1), None).unwrap_err().to_string();
        assert!(
            err.contains("param \"steps\"") && err.contains("65 steps") && err.contains("64"),
            "{err}"
        );
        // The YAML string form and taskSpec.spec count alike.
        let yaml: Vec<String> = (0..100).map(|i| format!("{{name: s{i}, run: [true]}}")).collect();
        let as_text = spec(&format!(
            "{REF}params: [{{name: image, value: i}}, {{name: steps, value: '[{}]'}}]",
            yaml.join(", ")
        ));
        let err = macbuild_spec(&as_text, None).unwrap_err().to_string();
        assert!(err.contains("100 steps"), "{err}");
        let in_spec = spec(&format!(
            "customSpec: {{apiVersion: tartan.dev/v1alpha1, kind: MacBuild, spec: {{image: i, steps: [{}]}}}}",
            yaml.join(", ")
        ));
        let err = macbuild_spec(&in_spec, None).unwrap_err().to_string();
        assert!(
            err.contains("customSpec.spec.steps") && err.contains("100 steps"),
            "{err}"
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

    #[test]
    fn host_selectors_kubernetes_labels_would_refuse_are_refused() {
        for (value, needle) in [
            ("'=x'", "name part must be non-empty"),
            ("'a=b=c'", "label value \"b=c\""),
            ("'a=1, a=2'", "given twice"),
            ("'-x=1'", "must start and end"),
            ("'example.com/=1'", "name part must be non-empty"),
            ("{'a/b/c': '1'}", "more than one '/'"),
            ("{xcode: ' 16'}", "label value"),
        ] {
            let run = spec(&format!(
                "{REF}params: [{{name: image, value: i}}, {{name: steps, value: [x]}}, {{name: host-selector, value: {value}}}]"
            ));
            let err = macbuild_spec(&run, None).unwrap_err();
            assert_eq!(err.reason(), "InvalidParams", "{value}: {err}");
            assert!(
                err.to_string().contains(needle),
                "{value}: {err} should mention {needle}"
            );
        }
        // Kubernetes allows an empty value and a prefixed key.
        let run = spec(&format!(
            "{REF}params: [{{name: image, value: i}}, {{name: steps, value: [x]}}, {{name: host-selector, value: 'tartan.dev/xcode=16,beta='}}]"
        ));
        assert_eq!(
            macbuild_spec(&run, None).unwrap()["hostSelector"],
            json!({"tartan.dev/xcode": "16", "beta": ""})
        );
        // The same check for a selector embedded in customSpec.spec.
        for bad in ["{'': x}", "{a: 'b=c'}", "{a: 1}", "[a]"] {
            let run = spec(&format!(
                "customSpec: {{apiVersion: tartan.dev/v1alpha1, kind: MacBuild, spec: {{image: i, steps: [{{name: b, run: [true]}}], \
                 hostSelector: {bad}}}}}"
            ));
            let err = macbuild_spec(&run, None).unwrap_err();
            assert_eq!(err.reason(), "InvalidMacBuildSpec", "{bad}: {err}");
            assert!(err.to_string().contains("customSpec.spec.hostSelector"), "{bad}: {err}");
        }
    }

    #[test]
    fn env_and_secret_env_params_become_spec_env() {
        let run = spec(&format!(
            r#"{REF}params:
- {{name: image, value: i}}
- {{name: steps, value: [make]}}
- {{name: env, value: "{{CONFIGURATION: Release, QUOTED: \"it's $(x)\"}}"}}
- {{name: secret-env, value: "ASC_KEY=asc/key.p8, TOKEN = registry/token"}}
"#
        ));
        let got = macbuild_spec(&run, None).unwrap();
        assert_eq!(
            got["env"],
            json!([
                {"name": "CONFIGURATION", "value": "Release"},
                {"name": "QUOTED", "value": "it's $(x)"},
                {"name": "ASC_KEY", "valueFrom": {"secretKeyRef": {"name": "asc", "key": "key.p8"}}},
                {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "registry", "key": "token"}}},
            ])
        );
        // The env param as an object, overriding customSpec.spec.env by name.
        let run = spec(&format!(
            "{REF}customSpec: {{spec: {{image: i, steps: [{{name: a, run: [b]}}], env: [{{name: A, value: old}},              {{name: B, value: kept}}]}}}}
params: [{{name: env, value: {{A: new}}}}]"
        ));
        let got = macbuild_spec(&run, None).unwrap();
        assert_eq!(
            got["env"],
            json!([{"name": "B", "value": "kept"}, {"name": "A", "value": "new"}])
        );
    }

    #[test]
    fn malformed_env_params_are_refused_naming_the_param_and_entry() {
        for (param, value, want) in [
            ("env", json!("[a, b]"), "param \"env\": must be a YAML or JSON map"),
            ("env", json!("{A: 1}"), "the value of \"A\" must be a string"),
            ("env", json!({"A": true}), "must be a string"),
            ("env", json!(["A=1"]), "param \"env\": must be a map"),
            ("env", json!({"PATH": "/bin"}), "\"PATH\" is reserved"),
            ("env", json!({"1A": "x"}), "not a shell variable name"),
            ("env", json!({"A": "x\u{0}y"}), "NUL"),
            ("secret-env", json!("TOKEN"), "entry \"TOKEN\" is not NAME=secret/key"),
            ("secret-env", json!("TOKEN=registry"), "is not secret/key"),
            ("secret-env", json!("TOKEN=Registry/token"), "RFC 1123"),
            ("secret-env", json!("TOKEN=registry/to ken"), "not a valid key"),
            ("secret-env", json!("=registry/token"), "empty name"),
            ("secret-env", json!("A=s/k,A=s/j"), "\"A\" is given twice"),
            ("secret-env", json!({"A": "s/k"}), "must be a string or a list"),
        ] {
            let run = CustomRunSpec {
                params: vec![
                    Param {
                        name: "image".into(),
                        value: json!("i"),
                    },
                    Param {
                        name: "steps".into(),
                        value: json!(["make"]),
                    },
                    Param {
                        name: param.into(),
                        value: value.clone(),
                    },
                ],
                ..spec(REF)
            };
            let e = macbuild_spec(&run, None).unwrap_err();
            assert_eq!(e.reason(), "InvalidParams", "{param}={value}: {e}");
            assert!(e.to_string().contains(want), "{param}={value}: {e} lacks {want:?}");
        }
        // Both params naming one variable.
        let run = spec(&format!(
            "{REF}params: [{{name: image, value: i}}, {{name: steps, value: [make]}}, {{name: env, value: {{A: x}}}},              {{name: secret-env, value: A=s/k}}]"
        ));
        let e = macbuild_spec(&run, None).unwrap_err();
        assert!(e.to_string().contains("given by both params"), "{e}");
        // A bad embedded spec.env is the spec's fault.
        let run = spec(&format!(
            "{REF}customSpec: {{spec: {{image: i, steps: [{{name: a, run: [b]}}], env: [{{name: A, value: x,              valueFrom: {{secretKeyRef: {{name: s, key: k}}}}}}]}}}}"
        ));
        let e = macbuild_spec(&run, None).unwrap_err();
        assert_eq!(e.reason(), "InvalidMacBuildSpec", "{e}");
        assert!(e.to_string().contains("both value and valueFrom"), "{e}");
    }

    mod props {
        use super::super::*;
        use crate::customrun::{CustomRef, CustomRunSpec, Param};
        use proptest::prelude::*;

        fn text() -> impl Strategy<Value = String> {
            prop_oneof![
                "[a-z0-9./:_-]{0,12}",
                "[a-z]{1,8}=[a-z0-9]{0,4}(,[ a-z/.]{1,8}=[=a-z0-9. ]{0,4}){0,2}",
                ".{0,12}"
            ]
        }

        fn json() -> impl Strategy<Value = Value> {
            let leaf = prop_oneof![
                Just(Value::Null),
                any::<bool>().prop_map(Value::from),
                any::<i64>().prop_map(Value::from),
                text().prop_map(Value::from),
            ];
            leaf.prop_recursive(2, 8, 4, |inner| {
                prop_oneof![
                    proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                    proptest::collection::btree_map("[a-z./=_-]{0,6}", inner, 0..4)
                        .prop_map(|m| Value::Object(m.into_iter().collect())),
                ]
            })
        }

        /// A plausible value for each param name (often valid), or any JSON.
        fn value(name: String) -> BoxedStrategy<Value> {
            let plausible: BoxedStrategy<Value> = match name.as_str() {
                "max-attempts" | "timeout-seconds" | "cpu" | "memory-mib" => prop_oneof![
                    (-2i64..5).prop_map(|n| n.to_string()),
                    any::<i64>().prop_map(|n| n.to_string())
                ]
                .prop_map(Value::from)
                .boxed(),
                "steps" | "artifact-paths" => proptest::collection::vec("[a-z ./-]{0,10}", 0..4)
                    .prop_map(|v| json!(v))
                    .boxed(),
                "host-selector" => proptest::collection::btree_map("[a-z]{1,3}(/[a-z]{1,3})?", "[a-z0-9]{0,3}", 0..3)
                    .prop_map(|m| json!(m))
                    .boxed(),
                "env" => proptest::collection::btree_map("[A-Za-z_][A-Z0-9_]{0,3}", ".{0,6}", 0..3)
                    .prop_map(|m| json!(m))
                    .boxed(),
                "secret-env" => "[A-Z_]{1,3}=[a-z]{1,3}/[a-z.]{1,3}(,[A-Z_]{1,3}=[a-z]{0,3}/[a-z.]{0,3}){0,2}"
                    .prop_map(Value::from)
                    .boxed(),
                _ => text().prop_map(Value::from).boxed(),
            };
            prop_oneof![3 => plausible, 1 => json()].boxed()
        }

        fn params() -> impl Strategy<Value = Vec<Param>> {
            let name = prop_oneof![
                8 => proptest::sample::select(PARAM_NAMES).prop_map(String::from),
                1 => "[a-z-]{1,12}",
            ];
            let param = name.prop_flat_map(|n| {
                value(n.clone()).prop_map(move |v| Param {
                    name: n.clone(),
                    value: v,
                })
            });
            proptest::collection::vec(param, 0..8).prop_map(|mut ps| {
                // Most lists carry the required params, so that acceptance is common.
                if ps.len() % 2 == 0 {
                    ps.insert(
                        0,
                        Param {
                            name: "image".into(),
                            value: json!("img"),
                        },
                    );
                    ps.insert(
                        1,
                        Param {
                            name: "steps".into(),
                            value: json!(["make"]),
                        },
                    );
                }
                ps
            })
        }

        fn run(params: Vec<Param>) -> CustomRunSpec {
            CustomRunSpec {
                custom_ref: Some(CustomRef {
                    api_version: Some("tartan.dev/v1alpha1".into()),
                    kind: Some("MacBuild".into()),
                    ..CustomRef::default()
                }),
                params,
                ..CustomRunSpec::default()
            }
        }

        proptest! {
            #[test]
            fn param_lists_never_panic_and_accepted_specs_round_trip(
                params in params(),
                timeout in proptest::option::of(1u64..100_000),
            ) {
                let got = macbuild_spec(&run(params.clone()), timeout.map(Duration::from_secs));
                let unknown = params.iter().find(|p| !PARAM_NAMES.contains(&p.name.as_str()));
                let Ok(spec) = got else {
                    return Ok(());
                };
                prop_assert!(unknown.is_none(), "unknown param {:?} accepted", unknown);
                for p in &params {
                    let text = p.value.as_str();
                    let int = text.and_then(|t| t.trim().parse::<i64>().ok());
                    match p.name.as_str() {
                        "image" => prop_assert_eq!(spec["image"].as_str(), text),
                        "git-url" => prop_assert_eq!(spec["source"]["git"].as_str(), text),
                        "git-revision" => prop_assert_eq!(spec["source"]["revision"].as_str(), text),
                        "test-report" => prop_assert_eq!(spec["testReport"].as_str(), text),
                        "artifact-destination" => prop_assert_eq!(spec["artifacts"]["destination"].as_str(), text),
                        "max-attempts" => prop_assert_eq!(spec["maxAttempts"].as_i64(), int),
                        "cpu" => prop_assert_eq!(spec["resources"]["cpu"].as_i64(), int),
                        "memory-mib" => prop_assert_eq!(spec["resources"]["memoryMiB"].as_i64(), int),
                        "timeout-seconds" => {
                            let want = int.map(|n| timeout.map_or(n, |t| n.min(t as i64)));
                            prop_assert_eq!(spec["timeoutSeconds"].as_i64(), want);
                        }
                        "host-selector" => {
                            let sel = spec["hostSelector"].as_object().expect("an object");
                            for (k, v) in sel {
                                prop_assert!(tartan_api::check_label_key(k).is_ok(), "key {:?}", k);
                                prop_assert!(tartan_api::check_label_value(v.as_str().unwrap()).is_ok(), "value {:?}", v);
                            }
                            if let Value::Object(m) = &p.value {
                                prop_assert_eq!(sel, m);
                            }
                        }
                        "steps" => {
                            if let Value::Array(cmds) = &p.value {
                                let steps = spec["steps"].as_array().expect("steps");
                                prop_assert_eq!(steps.len(), cmds.len());
                                for (step, cmd) in steps.iter().zip(cmds) {
                                    prop_assert_eq!(&step["run"][2], cmd);
                                }
                            }
                        }
                        "artifact-paths" => {
                            prop_assert!(spec["artifacts"]["paths"].is_array());
                        }
                        "mounts" => {
                            let mounts = spec["mounts"].as_array().expect("mounts");
                            prop_assert!(mounts.len() <= tartan_api::crd::MAX_MOUNTS);
                            for m in mounts {
                                prop_assert!(tartan_api::crd::check_mount_name(m["name"].as_str().unwrap()).is_ok(), "{}", m);
                            }
                        }
                        "env" | "secret-env" => {
                            // An accepted env is one the agent accepts too.
                            if let Some(env) = spec.get("env") {
                                let typed: Vec<tartan_api::EnvVar> = serde_json::from_value(env.clone()).unwrap();
                                prop_assert_eq!(tartan_api::env::check_env(&typed), Ok(()));
                            }
                        }
                        other => prop_assert!(false, "unexpected param {other}"),
                    }
                }
                if let Some(t) = timeout {
                    prop_assert!(spec["timeoutSeconds"].as_u64().is_some_and(|s| s <= t));
                }
            }

            #[test]
            fn unknown_param_names_are_refused(name in "[a-z-]{1,12}", value in json()) {
                prop_assume!(!PARAM_NAMES.contains(&name.as_str()));
                let params = vec![
                    Param { name: "image".into(), value: json!("img") },
                    Param { name: "steps".into(), value: json!(["make"]) },
                    Param { name: name.clone(), value },
                ];
                let err = macbuild_spec(&run(params), None).unwrap_err();
                prop_assert_eq!(err.reason(), "InvalidParams");
                prop_assert!(err.to_string().contains(&format!("unknown param {name:?}")), "{}", err);
            }
        }
    }

    #[test]
    fn step_timeouts_ride_in_the_steps_param_and_hostile_ones_are_refused() {
        let with = |steps: &str, timeout: Option<u64>| {
            let run = spec(&format!(
                "{REF}params: [{{name: image, value: img}}, {{name: steps, value: '{steps}'}}]"
            ));
            macbuild_spec(&run, timeout.map(Duration::from_secs))
        };
        let got = with("[{name: build, run: [make], timeoutSeconds: 600}]", None).unwrap();
        assert_eq!(got["steps"][0]["timeoutSeconds"], 600);
        for (steps, timeout, want) in [
            (
                "[{name: b, run: [x], timeoutSeconds: 0}]",
                None,
                "from 1 to 604800, got 0",
            ),
            ("[{name: b, run: [x], timeoutSeconds: -5}]", None, "got -5"),
            ("[{name: b, run: [x], timeoutSeconds: 1.5}]", None, "got 1.5"),
            ("[{name: b, run: [x], timeoutSeconds: \"10m\"}]", None, "got \"10m\""),
            (
                "[{name: b, run: [x], timeoutSeconds: 99999999999999999999}]",
                None,
                "timeoutSeconds must be",
            ),
            ("[{name: b, run: [x], timeoutSeconds: 604801}]", None, "got 604801"),
            ("[{name: b, run: [x], timeoutSeconds: null}]", None, "got null"),
            (
                "[{name: b, run: [x], timeoutSeconds: 7200}]",
                None,
                "step \"b\": timeoutSeconds 7200 is longer than the build's timeoutSeconds 3600",
            ),
            // The CustomRun's timeout caps the build's; the step's must fit under that.
            (
                "[{name: b, run: [x], timeoutSeconds: 600}]",
                Some(300),
                "timeoutSeconds 600 is longer than the build's timeoutSeconds 300",
            ),
        ] {
            let e = with(steps, timeout).unwrap_err();
            assert_eq!(e.reason(), "InvalidParams", "{steps}");
            assert!(e.to_string().contains(want), "{steps}: {e}");
            assert!(e.to_string().starts_with("param \"steps\": step"), "{e}");
        }
        // In an embedded spec it is the spec that is invalid.
        let run = spec(
            "customSpec: {apiVersion: tartan.dev/v1alpha1, kind: MacBuild, spec: {image: i, timeoutSeconds: 60, \
             steps: [{name: b, run: [x], timeoutSeconds: 61}]}}",
        );
        let e = macbuild_spec(&run, None).unwrap_err();
        assert_eq!(e.reason(), "InvalidMacBuildSpec");
        assert!(
            e.to_string().contains("longer than the build's timeoutSeconds 60"),
            "{e}"
        );
    }

    #[test]
    fn mounts_are_names_checked_before_a_macbuild_exists() {
        let with = |value: &str| {
            let run = spec(&format!(
                "{REF}params: [{{name: image, value: i}}, {{name: steps, value: [x]}}, {{name: mounts, value: {value}}}]"
            ));
            macbuild_spec(&run, None)
        };
        assert_eq!(
            with("'spm, pods'").unwrap()["mounts"],
            json!([{"name": "spm"}, {"name": "pods"}])
        );
        assert_eq!(with("[spm]").unwrap()["mounts"], json!([{"name": "spm"}]));
        for (value, want) in [
            ("'spm,spm'", "mount \"spm\" is asked for twice"),
            ("'../etc'", "mount name \"../etc\" must be"),
            ("'spm:/etc'", "mount name \"spm:/etc\" must be"),
            ("'SPM'", "mount name \"SPM\" must be"),
            ("[1]", "must list strings"),
            ("{a: b}", "must be a string or a list of strings"),
        ] {
            let e = with(value).unwrap_err();
            assert_eq!(e.reason(), "InvalidParams", "{value}");
            assert!(e.to_string().contains(want), "{value}: {e}");
        }
        let many = (0..17).map(|i| format!("m{i}")).collect::<Vec<_>>().join(",");
        assert!(
            with(&format!("'{many}'"))
                .unwrap_err()
                .to_string()
                .contains("at most 16")
        );
    }
}
