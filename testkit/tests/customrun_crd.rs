//! The project's own CustomRun CRD (`testkit/fixtures/customrun-crd.yaml`) against Tekton's, when
//! a copy of Tekton's is at hand (`../shared/fixtures/tekton-customrun-crd.yaml` beside the
//! workspace, or `$TEKTON_CUSTOMRUN_CRD`): ours must prune nothing Tekton's keeps. Checked twice:
//! by walking both schemas, and by a CustomRun holding every field Tekton's schema names, which
//! must come back whole from the emulator serving our CRD. Without a copy both skip visibly.

use std::path::PathBuf;

use serde_json::{Value, json};

fn tekton_crd() -> Option<Value> {
    let path = std::env::var_os("TEKTON_CUSTOMRUN_CRD")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures/tekton-customrun-crd.yaml")
        });
    let Ok(text) = std::fs::read_to_string(&path) else {
        tartan_testkit::real::skip(
            "skipped: no copy of Tekton's CustomRun CRD (set TEKTON_CUSTOMRUN_CRD=FILE)",
            "customrun_crd",
        );
        return None;
    };
    Some(serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
}

fn ours() -> Value {
    let text = std::fs::read_to_string(tartan_testkit::customrun_crd()).unwrap();
    serde_saphyr::from_str(&text).unwrap()
}

fn schema(crd: &Value) -> &Value {
    let versions = crd["spec"]["versions"].as_array().unwrap();
    let v1beta1 = versions
        .iter()
        .find(|v| v["name"] == "v1beta1")
        .expect("a v1beta1 version");
    &v1beta1["schema"]["openAPIV3Schema"]
}

fn preserves(node: &Value) -> bool {
    node["x-kubernetes-preserve-unknown-fields"] == json!(true)
}

/// Paths Tekton's schema keeps that ours would prune.
fn pruned(tekton: &Value, ours: &Value, path: &str, out: &mut Vec<String>) {
    if preserves(ours) && ours.get("properties").is_none() && ours.get("items").is_none() {
        return; // everything below is kept as it is
    }
    if preserves(tekton) && !preserves(ours) {
        out.push(format!("{path}: Tekton keeps unknown fields here, ours prunes them"));
    }
    if let Some(props) = tekton["properties"].as_object() {
        for (key, below) in props {
            let here = format!("{path}.{key}");
            match ours["properties"].get(key) {
                Some(mine) => pruned(below, mine, &here, out),
                None if preserves(ours) => {}
                None => out.push(format!("{here}: in Tekton's schema, pruned by ours")),
            }
        }
    }
    if tekton.get("items").is_some() {
        match ours.get("items") {
            Some(mine) => pruned(&tekton["items"], mine, &format!("{path}[]"), out),
            None => out.push(format!("{path}[]: Tekton's items are pruned by ours")),
        }
    }
    if tekton["additionalProperties"].is_object() {
        match ours.get("additionalProperties") {
            Some(mine) if mine.is_object() => {
                pruned(&tekton["additionalProperties"], mine, &format!("{path}{{*}}"), out)
            }
            _ => out.push(format!("{path}{{*}}: Tekton keeps any key here, ours prunes them")),
        }
    }
}

#[test]
fn our_schema_prunes_nothing_tektons_keeps() {
    let Some(tekton) = tekton_crd() else { return };
    let mut out = vec![];
    pruned(schema(&tekton), schema(&ours()), "", &mut out);
    assert!(
        out.is_empty(),
        "our CustomRun CRD prunes what Tekton's keeps:\n{}",
        out.join("\n")
    );
}

#[test]
fn the_walk_finds_a_field_ours_would_prune() {
    // The check itself can fail: a schema without `timeout` prunes Tekton's.
    let mut mine = ours();
    let spec = &mut mine["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"];
    spec.as_object_mut().unwrap().remove("timeout");
    let tekton = json!({"properties": {"spec": {"type": "object", "properties": {"timeout": {"type": "string"}}}}});
    let mut out = vec![];
    pruned(&tekton, schema(&mine), "", &mut out);
    assert_eq!(out, vec![".spec.timeout: in Tekton's schema, pruned by ours"]);
}

/// A value for every field `schema` names (one item per array, one key per map).
fn sample(schema: &Value) -> Value {
    if let Some(props) = schema["properties"].as_object() {
        return Value::Object(props.iter().map(|(k, v)| (k.clone(), sample(v))).collect());
    }
    match schema["type"].as_str() {
        Some("array") => json!([sample(&schema["items"])]),
        Some("object") if schema["additionalProperties"].is_object() => {
            json!({"some-key": sample(&schema["additionalProperties"])})
        }
        Some("object") => json!({"kept": "as it is"}),
        Some("integer") => json!(3),
        Some("boolean") => json!(true),
        Some("string") if schema["format"] == "date-time" => json!("2026-12-05T10:00:00Z"),
        Some("string") => json!("text"),
        _ => json!({"any": ["shape", 1]}),
    }
}

#[tokio::test]
async fn a_customrun_with_every_field_tekton_names_comes_back_whole() {
    let Some(tekton) = tekton_crd() else { return };
    let emu = tartan_testkit::start(tartan_testkit::Options::default().crd_file(tartan_testkit::customrun_crd()))
        .await
        .unwrap();
    let mut object = sample(schema(&tekton));
    object["apiVersion"] = json!("tekton.dev/v1beta1");
    object["kind"] = json!("CustomRun");
    object["metadata"] = json!({"name": "every-field", "namespace": "default"});
    let ar = kube::api::ApiResource {
        group: "tekton.dev".into(),
        version: "v1beta1".into(),
        api_version: "tekton.dev/v1beta1".into(),
        kind: "CustomRun".into(),
        plural: "customruns".into(),
    };
    let api: kube::Api<kube::api::DynamicObject> = kube::Api::namespaced_with(emu.client(), "default", &ar);
    let created = api
        .create(&Default::default(), &serde_json::from_value(object.clone()).unwrap())
        .await
        .unwrap();
    // The status subresource: status is written apart from the object.
    let status = json!({"status": object["status"].clone()});
    let patched = api
        .patch_status("every-field", &Default::default(), &kube::api::Patch::Merge(&status))
        .await
        .unwrap();
    let stored = serde_json::to_value(&patched).unwrap();
    assert_eq!(stored["spec"], object["spec"], "spec came back as written");
    assert_eq!(stored["status"], object["status"], "status came back as written");
    assert_eq!(created.metadata.name.as_deref(), Some("every-field"));
}
