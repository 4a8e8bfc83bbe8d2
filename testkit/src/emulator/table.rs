//! `meta.k8s.io/v1` Table responses, as the apiserver builds them from `additionalPrinterColumns`.

use serde_json::{Value, json};

use super::jsonpath;
use super::types::ResourceType;

/// `duration.HumanDuration`: how `kubectl get` shows ages.
pub fn human_duration(secs: i64) -> String {
    if secs < -1 {
        return "<invalid>".into();
    }
    if secs < 0 {
        return "0s".into();
    }
    if secs < 120 {
        return format!("{secs}s");
    }
    let minutes = secs / 60;
    if minutes < 10 {
        let s = secs % 60;
        return if s == 0 {
            format!("{minutes}m")
        } else {
            format!("{minutes}m{s}s")
        };
    }
    if minutes < 180 {
        return format!("{minutes}m");
    }
    let hours = secs / 3600;
    if hours < 8 {
        let m = minutes % 60;
        return if m == 0 {
            format!("{hours}h")
        } else {
            format!("{hours}h{m}m")
        };
    }
    if hours < 48 {
        return format!("{hours}h");
    }
    if hours < 24 * 8 {
        let h = hours % 24;
        return if h == 0 {
            format!("{}d", hours / 24)
        } else {
            format!("{}d{}h", hours / 24, h)
        };
    }
    if hours < 24 * 365 * 2 {
        return format!("{}d", hours / 24);
    }
    if hours < 24 * 365 * 8 {
        let dy = (hours / 24) % 365;
        return if dy == 0 {
            format!("{}y", hours / 24 / 365)
        } else {
            format!("{}y{}d", hours / 24 / 365, dy)
        };
    }
    format!("{}y", hours / 24 / 365)
}

fn age(ts: &str) -> String {
    match ts.parse::<k8s_openapi::jiff::Timestamp>() {
        Ok(t) => human_duration(k8s_openapi::jiff::Timestamp::now().as_second() - t.as_second()),
        Err(_) => "<unknown>".into(),
    }
}

fn cell(type_: &str, results: &[Value]) -> Value {
    let Some(first) = results.first() else {
        return Value::Null;
    };
    match type_ {
        "string" => {
            let parts: Vec<String> = results
                .iter()
                .map(|v| match v {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                })
                .collect();
            json!(parts.join(" "))
        }
        "date" => match first.as_str() {
            Some(s) => json!(age(s)),
            None => json!("<unknown>"),
        },
        "integer" => first.as_i64().map(Value::from).unwrap_or(Value::Null),
        "number" => first.as_f64().map(Value::from).unwrap_or(Value::Null),
        "boolean" => first.as_bool().map(Value::from).unwrap_or(Value::Null),
        _ => first.clone(),
    }
}

pub fn table(rt: &ResourceType, items: &[Value], rv: &str, include_object: Option<&str>) -> Value {
    let mut defs = vec![json!({
        "name": "Name", "type": "string", "format": "name", "priority": 0,
        "description": "Name must be unique within a namespace. Is required when creating resources, although some resources may allow a client to request the generation of an appropriate name automatically. Name is primarily intended for creation idempotence and configuration definition. Cannot be updated. More info: https://kubernetes.io/docs/concepts/overview/working-with-objects/names#names"
    })];
    for c in &rt.columns {
        defs.push(json!({
            "name": c.name, "type": c.type_, "format": c.format, "description": c.description, "priority": c.priority
        }));
    }
    let rows: Vec<Value> = items
        .iter()
        .map(|o| {
            let mut cells = vec![o.pointer("/metadata/name").cloned().unwrap_or_default()];
            for c in &rt.columns {
                let results = jsonpath::eval(&c.json_path, o).unwrap_or_default();
                // Built-in printers show "Created At" as the timestamp itself.
                let type_ = if c.name == "Created At" {
                    "string"
                } else {
                    c.type_.as_str()
                };
                cells.push(cell(type_, &results));
            }
            let mut row = json!({"cells": cells});
            match include_object {
                Some("None") => {}
                Some("Object") => row["object"] = o.clone(),
                _ => {
                    row["object"] = json!({
                        "kind": "PartialObjectMetadata",
                        "apiVersion": "meta.k8s.io/v1",
                        "metadata": o.get("metadata").cloned().unwrap_or_default()
                    })
                }
            }
            row
        })
        .collect();
    json!({
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": rv},
        "columnDefinitions": defs,
        "rows": rows
    })
}

#[cfg(test)]
mod tests {
    use super::human_duration;

    #[test]
    fn ages_like_kubectl() {
        assert_eq!(human_duration(5), "5s");
        assert_eq!(human_duration(119), "119s");
        assert_eq!(human_duration(150), "2m30s");
        assert_eq!(human_duration(600), "10m");
        assert_eq!(human_duration(3 * 3600 + 120), "3h2m");
        assert_eq!(human_duration(30 * 3600), "30h");
        assert_eq!(human_duration(50 * 3600), "2d2h");
    }
}
