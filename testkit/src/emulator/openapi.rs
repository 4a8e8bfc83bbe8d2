//! OpenAPI documents built from the served types: `/openapi/v2` (JSON, and protobuf for kubectl's
//! client-side validation) and `/openapi/v3` (root index plus one document per group/version, with
//! the `fieldValidation` parameter kubectl looks for before relying on server-side validation).

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use serde_json::{Map, Value, json};

use super::types::{Flavor, ResourceType};

const OBJECT_META: &str = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta";

fn definition_name(rt: &ResourceType) -> String {
    let group = if rt.group.is_empty() {
        "io.k8s.api.core".to_string()
    } else {
        let mut parts: Vec<&str> = rt.group.split('.').collect();
        parts.reverse();
        parts.join(".")
    };
    format!("{group}.{}.{}", rt.version, rt.kind)
}

fn gvk(rt: &ResourceType) -> Value {
    json!({"group": rt.group, "version": rt.version, "kind": rt.kind})
}

fn object_meta_schema() -> Value {
    let s = json!({"type": "string"});
    let smap = json!({"type": "object", "additionalProperties": {"type": "string"}});
    json!({
        "description": "ObjectMeta is metadata that all persisted resources must have.",
        "type": "object",
        "properties": {
            "name": s, "generateName": s, "namespace": s, "selfLink": s, "uid": s, "resourceVersion": s,
            "generation": {"type": "integer", "format": "int64"},
            "creationTimestamp": {"type": "string", "format": "date-time"},
            "deletionTimestamp": {"type": "string", "format": "date-time"},
            "deletionGracePeriodSeconds": {"type": "integer", "format": "int64"},
            "labels": smap, "annotations": smap,
            "finalizers": {"type": "array", "items": {"type": "string"}},
            "ownerReferences": {"type": "array", "items": {"type": "object", "required": ["apiVersion", "kind", "name", "uid"], "properties": {
                "apiVersion": s, "kind": s, "name": s, "uid": s,
                "controller": {"type": "boolean"}, "blockOwnerDeletion": {"type": "boolean"}
            }}},
            "managedFields": {"type": "array", "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}
        }
    })
}

/// The schema published for a type; `v2` strips what Swagger 2.0 cannot express.
fn type_schema(rt: &ResourceType, v2: bool) -> Value {
    let meta_ref = if v2 {
        format!("#/definitions/{OBJECT_META}")
    } else {
        format!("#/components/schemas/{OBJECT_META}")
    };
    let mut s = match &rt.schema {
        Some(s) => s.clone(),
        // Built-ins are published without a schema: kubectl's client-side validation then treats
        // them as arbitrary objects instead of rejecting every field it was not told about.
        None if v2 => return json!({"description": rt.kind, "x-kubernetes-group-version-kind": [gvk(rt)]}),
        None => json!({"type": "object", "x-kubernetes-preserve-unknown-fields": true}),
    };
    if v2 {
        to_v2(&mut s);
    }
    if !s.get("properties").is_some_and(Value::is_object) {
        s["properties"] = json!({});
    }
    s["properties"]["apiVersion"] = json!({"type": "string"});
    s["properties"]["kind"] = json!({"type": "string"});
    s["properties"]["metadata"] = if v2 {
        json!({"$ref": meta_ref})
    } else {
        json!({"allOf": [{"$ref": meta_ref}]})
    };
    s["type"] = json!("object");
    s["x-kubernetes-group-version-kind"] = json!([gvk(rt)]);
    s
}

/// What the apiserver drops when publishing a CRD schema as Swagger 2.0.
fn to_v2(s: &mut Value) {
    if let Some(m) = s.as_object_mut() {
        for k in ["nullable", "anyOf", "oneOf", "allOf", "not", "x-kubernetes-validations"] {
            m.remove(k);
        }
        if m.get("x-kubernetes-int-or-string").and_then(Value::as_bool) == Some(true) {
            m.remove("type");
        }
        if m.get("x-kubernetes-preserve-unknown-fields").and_then(Value::as_bool) == Some(true) {
            m.remove("type");
            m.remove("properties");
            m.remove("items");
        }
        if let Some(props) = m.get_mut("properties").and_then(Value::as_object_mut) {
            for p in props.values_mut() {
                to_v2(p);
            }
        }
        if let Some(items) = m.get_mut("items") {
            to_v2(items);
        }
        if let Some(ap) = m.get_mut("additionalProperties")
            && ap.is_object()
        {
            to_v2(ap);
        }
    }
}

struct Op<'a> {
    action: &'a str,
    method: &'a str,
    body: bool,
    list: bool,
}

fn operation(rt: &ResourceType, op: &Op, v2: bool, name: &str) -> Value {
    let target = if op.list && op.method == "get" {
        json!({"type": "object", "description": format!("{} is a list of {}", rt.list_kind(), rt.kind)})
    } else if v2 {
        json!({"$ref": format!("#/definitions/{}", definition_name(rt))})
    } else {
        json!({"$ref": format!("#/components/schemas/{}", definition_name(rt))})
    };
    let mut params = vec![json!({"name": "pretty", "in": "query", "schema": {"type": "string"}})];
    if matches!(op.method, "post" | "put" | "patch") {
        for p in ["dryRun", "fieldManager", "fieldValidation"] {
            params.push(json!({"name": p, "in": "query", "schema": {"type": "string"}, "description": p}));
        }
    }
    if op.method == "patch" {
        params.push(json!({"name": "force", "in": "query", "schema": {"type": "boolean"}}));
    }
    if v2 {
        for p in params.iter_mut() {
            if let Some(m) = p.as_object_mut()
                && let Some(s) = m.remove("schema")
            {
                m.insert("type".into(), s["type"].clone());
            }
        }
    }
    let mut o = json!({
        "operationId": format!("{}{}{}", op.method, rt.kind, name),
        "parameters": params,
        "x-kubernetes-action": op.action,
        "x-kubernetes-group-version-kind": gvk(rt),
    });
    if v2 {
        o["responses"] = json!({"200": {"description": "OK", "schema": target}});
        o["consumes"] = json!(["*/*"]);
        o["produces"] = json!(["application/json"]);
    } else {
        o["responses"] = json!({"200": {"description": "OK", "content": {"application/json": {"schema": target}}}});
        if op.body {
            let types: Vec<&str> = if op.method == "patch" {
                let mut t = vec![
                    "application/json-patch+json",
                    "application/merge-patch+json",
                    "application/apply-patch+yaml",
                ];
                if rt.flavor != Flavor::Custom {
                    t.push("application/strategic-merge-patch+json");
                }
                t
            } else {
                vec!["application/json"]
            };
            let schema = if op.method == "patch" {
                json!({"type": "object"})
            } else {
                target.clone()
            };
            let content: Map<String, Value> = types
                .iter()
                .map(|t| (t.to_string(), json!({"schema": schema})))
                .collect();
            o["requestBody"] = json!({"content": content, "required": true});
        }
    }
    o
}

fn paths_for(rt: &ResourceType, v2: bool, paths: &mut Map<String, Value>) {
    let base = if rt.group.is_empty() {
        format!("/api/{}", rt.version)
    } else {
        format!("/apis/{}/{}", rt.group, rt.version)
    };
    let coll = if rt.namespaced {
        format!("{base}/namespaces/{{namespace}}/{}", rt.plural)
    } else {
        format!("{base}/{}", rt.plural)
    };
    let item = format!("{coll}/{{name}}");
    let ops = |list: &[(&str, &str, bool)], is_list: bool, suffix: &str| -> Value {
        let mut m = Map::new();
        for (method, action, body) in list {
            let op = Op {
                action,
                method,
                body: *body,
                list: is_list,
            };
            m.insert(method.to_string(), operation(rt, &op, v2, suffix));
        }
        Value::Object(m)
    };
    paths.insert(
        coll,
        ops(
            &[
                ("get", "list", false),
                ("post", "post", true),
                ("delete", "deletecollection", false),
            ],
            true,
            "List",
        ),
    );
    paths.insert(
        item.clone(),
        ops(
            &[
                ("get", "get", false),
                ("put", "put", true),
                ("patch", "patch", true),
                ("delete", "delete", false),
            ],
            false,
            "",
        ),
    );
    if rt.status_subresource {
        paths.insert(
            format!("{item}/status"),
            ops(
                &[("get", "get", false), ("put", "put", true), ("patch", "patch", true)],
                false,
                "Status",
            ),
        );
    }
    if rt.namespaced {
        paths.insert(
            format!("{base}/{}", rt.plural),
            ops(&[("get", "list", false)], true, "ForAllNamespaces"),
        );
    }
}

/// The Swagger 2.0 document of everything served.
pub fn v2(types: &[Arc<ResourceType>]) -> Value {
    let mut paths = Map::new();
    let mut defs = Map::new();
    defs.insert(OBJECT_META.into(), object_meta_schema());
    for rt in types {
        paths_for(rt, true, &mut paths);
        defs.insert(definition_name(rt), type_schema(rt, true));
    }
    json!({
        "swagger": "2.0",
        "info": {"title": "Kubernetes", "version": "v1.33.0"},
        "paths": paths,
        "definitions": defs
    })
}

fn gv_key(rt: &ResourceType) -> String {
    if rt.group.is_empty() {
        format!("api/{}", rt.version)
    } else {
        format!("apis/{}/{}", rt.group, rt.version)
    }
}

/// The OpenAPI v3 document of one group/version (`api/v1`, `apis/<group>/<version>`).
pub fn v3_group_version(types: &[Arc<ResourceType>], gv: &str) -> Option<Value> {
    let members: Vec<&Arc<ResourceType>> = types.iter().filter(|t| gv_key(t) == gv).collect();
    if members.is_empty() {
        return None;
    }
    let mut paths = Map::new();
    let mut schemas = Map::new();
    schemas.insert(OBJECT_META.into(), object_meta_schema());
    for rt in members {
        paths_for(rt, false, &mut paths);
        schemas.insert(definition_name(rt), type_schema(rt, false));
    }
    Some(json!({
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": "v1.33.0"},
        "paths": paths,
        "components": {"schemas": schemas}
    }))
}

/// `/openapi/v3`: the index of group/version documents with content hashes.
pub fn v3_root(types: &[Arc<ResourceType>]) -> Value {
    let mut keys: Vec<String> = types.iter().map(|t| gv_key(t)).collect();
    keys.sort();
    keys.dedup();
    let mut paths = Map::new();
    for k in keys {
        let doc = v3_group_version(types, &k).unwrap_or_default();
        let mut h = DefaultHasher::new();
        doc.to_string().hash(&mut h);
        paths.insert(
            k.clone(),
            json!({"serverRelativeURL": format!("/openapi/v3/{k}?hash={:016X}", h.finish())}),
        );
    }
    json!({"paths": paths})
}
