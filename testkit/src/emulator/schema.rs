//! Structural-schema handling for custom resources, in the order the apiserver applies it:
//! pruning of unknown fields (and of `null` where not `nullable`), `default:`, then validation
//! (types, enum, bounds, lengths, item and property counts, `required`, `pattern`, `date-time`),
//! then the uniqueness of `x-kubernetes-list-type: map` keys and `set` items.

use std::fmt;

use serde_json::{Map, Value};

/// The fields of `ObjectMeta` a client may send; anything else under `metadata` is dropped on decode.
const OBJECT_META_FIELDS: &[&str] = &[
    "name",
    "generateName",
    "namespace",
    "selfLink",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "labels",
    "annotations",
    "ownerReferences",
    "finalizers",
    "managedFields",
];

/// One field error, as `field.Error` renders it.
#[derive(Debug, Clone, PartialEq)]
pub struct FieldError {
    pub kind: ErrorKind,
    pub field: String,
    pub value: Option<Value>,
    pub detail: String,
}

#[derive(Debug, Clone, PartialEq)]
pub enum ErrorKind {
    Required,
    Invalid,
    TypeInvalid,
    NotSupported,
    TooMany,
    TooLong,
    Forbidden,
    Duplicate,
}

impl FieldError {
    pub fn new(kind: ErrorKind, field: impl Into<String>, value: Option<Value>, detail: impl Into<String>) -> Self {
        FieldError {
            kind,
            field: field.into(),
            value,
            detail: detail.into(),
        }
    }

    pub fn required(field: impl Into<String>, detail: impl Into<String>) -> Self {
        Self::new(ErrorKind::Required, field, None, detail)
    }

    pub fn invalid(field: impl Into<String>, value: Value, detail: impl Into<String>) -> Self {
        Self::new(ErrorKind::Invalid, field, Some(value), detail)
    }

    pub fn forbidden(field: impl Into<String>, detail: impl Into<String>) -> Self {
        Self::new(ErrorKind::Forbidden, field, None, detail)
    }

    pub fn reason(&self) -> &'static str {
        match self.kind {
            ErrorKind::Required => "FieldValueRequired",
            ErrorKind::Invalid => "FieldValueInvalid",
            ErrorKind::TypeInvalid => "FieldValueTypeInvalid",
            ErrorKind::NotSupported => "FieldValueNotSupported",
            ErrorKind::TooMany => "FieldValueTooMany",
            ErrorKind::TooLong => "FieldValueTooLong",
            ErrorKind::Forbidden => "FieldValueForbidden",
            ErrorKind::Duplicate => "FieldValueDuplicate",
        }
    }

    fn type_str(&self) -> &'static str {
        match self.kind {
            ErrorKind::Required => "Required value",
            ErrorKind::Invalid | ErrorKind::TypeInvalid => "Invalid value",
            ErrorKind::NotSupported => "Unsupported value",
            ErrorKind::TooMany => "Too many",
            ErrorKind::TooLong => "Too long",
            ErrorKind::Forbidden => "Forbidden",
            ErrorKind::Duplicate => "Duplicate value",
        }
    }

    /// `ErrorBody()`: the message without the field path.
    pub fn body(&self) -> String {
        let mut s = match self.kind {
            ErrorKind::Required | ErrorKind::Forbidden | ErrorKind::TooLong => self.type_str().to_string(),
            // The apiserver's Duplicate values are Go maps, printed with %#v.
            ErrorKind::Duplicate => format!(
                "{}: {}",
                self.type_str(),
                go_sharp_v(self.value.as_ref().unwrap_or(&Value::Null))
            ),
            _ => format!(
                "{}: {}",
                self.type_str(),
                render_value(self.value.as_ref().unwrap_or(&Value::Null))
            ),
        };
        if !self.detail.is_empty() {
            s.push_str(": ");
            s.push_str(&self.detail);
        }
        s
    }
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.body())
    }
}

fn render_value(v: &Value) -> String {
    match v {
        Value::Null => "\"null\"".into(),
        Value::String(s) => format!("{s:?}"),
        Value::Number(n) => n.to_string(),
        Value::Bool(b) => b.to_string(),
        other => other.to_string(),
    }
}

/// Go's `%#v` of a decoded JSON value (`map[string]interface {}{"name":"build"}`): map keys sorted,
/// strings quoted, numbers as Go prints int64 and float64.
fn go_sharp_v(v: &Value) -> String {
    fn inner(v: &Value) -> String {
        match v {
            Value::Null => "interface {}(nil)".into(),
            Value::Bool(b) => b.to_string(),
            Value::Number(n) => n.to_string(),
            Value::String(s) => format!("{s:?}"),
            Value::Array(items) => format!(
                "[]interface {{}}{{{}}}",
                items.iter().map(inner).collect::<Vec<_>>().join(", ")
            ),
            Value::Object(m) => {
                let mut entries: Vec<(&String, &Value)> = m.iter().collect();
                entries.sort_by(|a, b| a.0.cmp(b.0));
                format!(
                    "map[string]interface {{}}{{{}}}",
                    entries
                        .iter()
                        .map(|(k, v)| format!("{k:?}:{}", inner(v)))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            }
        }
    }
    inner(v)
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        // The apiserver decodes JSON numbers into int64 or float64: an integer beyond int64 is a
        // "number" to it, and refused where the schema wants an integer.
        Value::Number(n) if n.is_i64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn child(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

fn flag(schema: &Value, key: &str) -> bool {
    schema.get(key).and_then(Value::as_bool).unwrap_or(false)
}

/// Prunes `obj` (a whole custom resource) against the CRD's `openAPIV3Schema`, drops non-nullable
/// nulls, and applies defaults. Returns the paths of pruned unknown fields.
pub fn prune_and_default(obj: &mut Value, schema: &Value) -> Vec<String> {
    let mut pruned = Vec::new();
    if let Some(map) = obj.as_object_mut() {
        if let Some(meta) = map.get_mut("metadata").and_then(Value::as_object_mut) {
            let unknown: Vec<String> = meta
                .keys()
                .filter(|k| !OBJECT_META_FIELDS.contains(&k.as_str()))
                .cloned()
                .collect();
            for k in unknown {
                meta.remove(&k);
                pruned.push(format!("metadata.{k}"));
            }
        }
        let props = schema.get("properties").and_then(Value::as_object);
        let preserve = flag(schema, "x-kubernetes-preserve-unknown-fields");
        let keys: Vec<String> = map.keys().cloned().collect();
        for k in keys {
            if matches!(k.as_str(), "apiVersion" | "kind" | "metadata") {
                continue;
            }
            match props.and_then(|p| p.get(&k)) {
                Some(sub) => {
                    if map[&k].is_null() && !flag(sub, "nullable") {
                        map.remove(&k);
                        continue;
                    }
                    prune_value(map.get_mut(&k).expect("key present"), sub, &k, &mut pruned);
                }
                None if preserve => {}
                None => {
                    map.remove(&k);
                    pruned.push(k);
                }
            }
        }
        if let Some(props) = props {
            apply_defaults(map, props, "", &mut pruned);
        }
    }
    pruned
}

fn apply_defaults(map: &mut Map<String, Value>, props: &Map<String, Value>, path: &str, pruned: &mut Vec<String>) {
    for (k, sub) in props {
        if matches!(k.as_str(), "apiVersion" | "kind" | "metadata") && path.is_empty() {
            continue;
        }
        if !map.contains_key(k)
            && let Some(d) = sub.get("default")
        {
            let mut d = d.clone();
            prune_value(&mut d, sub, &child(path, k), pruned);
            map.insert(k.clone(), d);
        }
    }
}

fn prune_value(v: &mut Value, schema: &Value, path: &str, pruned: &mut Vec<String>) {
    let preserve = flag(schema, "x-kubernetes-preserve-unknown-fields");
    let embedded = flag(schema, "x-kubernetes-embedded-resource");
    match v {
        Value::Object(map) => {
            let props = schema.get("properties").and_then(Value::as_object);
            let additional = schema.get("additionalProperties").filter(|a| a.is_object());
            let keys: Vec<String> = map.keys().cloned().collect();
            for k in keys {
                let sub = props.and_then(|p| p.get(&k)).or(additional);
                match sub {
                    Some(sub) => {
                        if map[&k].is_null() && !flag(sub, "nullable") {
                            map.remove(&k);
                            continue;
                        }
                        prune_value(map.get_mut(&k).expect("key present"), sub, &child(path, &k), pruned);
                    }
                    None if preserve => {}
                    None if embedded && matches!(k.as_str(), "apiVersion" | "kind" | "metadata") => {}
                    None if props.is_none() && additional.is_none() && schema.get("type").is_none() => {}
                    None => {
                        map.remove(&k);
                        pruned.push(child(path, &k));
                    }
                }
            }
            if let Some(props) = props {
                apply_defaults(map, props, path, pruned);
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for (i, item) in items.iter_mut().enumerate() {
                    prune_value(item, item_schema, &format!("{path}[{i}]"), pruned);
                }
            }
        }
        _ => {}
    }
}

/// Validates a (pruned, defaulted) custom resource against its schema. `status` is left out
/// of the root when `skip_status` (the main endpoint of a resource with a status subresource
/// keeps the stored status, which was validated when written).
pub fn validate(obj: &Value, schema: &Value) -> Vec<FieldError> {
    let mut errs = Vec::new();
    let Some(map) = obj.as_object() else {
        return errs;
    };
    let props = schema.get("properties").and_then(Value::as_object);
    for (k, v) in map {
        if matches!(k.as_str(), "apiVersion" | "kind" | "metadata") {
            continue;
        }
        if let Some(sub) = props.and_then(|p| p.get(k)) {
            validate_value(v, sub, k, &mut errs);
        }
    }
    if let Some(req) = schema.get("required").and_then(Value::as_array) {
        for r in req.iter().filter_map(Value::as_str) {
            if !map.contains_key(r) {
                errs.push(FieldError::required(r, ""));
            }
        }
    }
    for (k, v) in map {
        if matches!(k.as_str(), "apiVersion" | "kind" | "metadata") {
            continue;
        }
        if let Some(sub) = props.and_then(|p| p.get(k)) {
            validate_lists(v, sub, k, &mut errs);
        }
    }
    errs
}

/// The apiserver's `ValidateListSetsAndMaps`: in every array marked `x-kubernetes-list-type: set`
/// no item repeats, in every `map` no two items share their `x-kubernetes-list-map-keys` values.
/// Each repeated value is reported once, at its second index, as `Duplicate value`.
fn validate_lists(v: &Value, schema: &Value, path: &str, errs: &mut Vec<FieldError>) {
    match v {
        Value::Object(map) => {
            if let Some(additional) = schema.get("additionalProperties").filter(|a| a.is_object()) {
                for (k, sub) in map {
                    validate_lists(sub, additional, &format!("{path}[{k}]"), errs);
                }
            }
            if let Some(props) = schema.get("properties").and_then(Value::as_object) {
                for (k, sub) in map {
                    if let Some(s) = props.get(k) {
                        validate_lists(sub, s, &child(path, k), errs);
                    }
                }
            }
        }
        Value::Array(items) => {
            match schema.get("x-kubernetes-list-type").and_then(Value::as_str) {
                Some("set") => {
                    for i in second_occurrences(items) {
                        errs.push(FieldError::new(
                            ErrorKind::Duplicate,
                            format!("{path}[{i}]"),
                            Some(items[i].clone()),
                            "",
                        ));
                    }
                }
                Some("map") => validate_list_map(items, schema, path, errs),
                _ => {}
            }
            if let Some(item_schema) = schema.get("items") {
                for (i, item) in items.iter().enumerate() {
                    validate_lists(item, item_schema, &format!("{path}[{i}]"), errs);
                }
            }
        }
        _ => {}
    }
}

fn validate_list_map(items: &[Value], schema: &Value, path: &str, errs: &mut Vec<FieldError>) {
    // Only objects (and null) may be items of a list-type map.
    if let Some((i, x)) = items.iter().enumerate().find(|(_, x)| !x.is_object() && !x.is_null()) {
        errs.push(FieldError::invalid(
            format!("{path}[{i}]"),
            x.clone(),
            "must be an object for an array of list-type map",
        ));
        return;
    }
    let key_fields: Vec<&str> = schema
        .get("x-kubernetes-list-map-keys")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    // An item's key: the key fields it has (an absent field, or a null item, has none; two
    // items without a key are duplicates of each other).
    let keys: Vec<Value> = items
        .iter()
        .map(|x| {
            let fields = key_fields
                .iter()
                .filter_map(|f| x.get(*f).map(|v| (f.to_string(), v.clone())))
                .collect();
            Value::Object(fields)
        })
        .collect();
    for i in second_occurrences(&keys) {
        errs.push(FieldError::new(
            ErrorKind::Duplicate,
            format!("{path}[{i}]"),
            Some(keys[i].clone()),
            "",
        ));
    }
}

/// Indices of the second occurrence of each value that occurs more than once.
fn second_occurrences(items: &[Value]) -> Vec<usize> {
    let mut out = Vec::new();
    for (i, x) in items.iter().enumerate() {
        let before = items[..i].iter().filter(|y| *y == x).count();
        if before == 1 {
            out.push(i);
        }
    }
    out
}

fn validate_value(v: &Value, schema: &Value, path: &str, errs: &mut Vec<FieldError>) {
    if v.is_null() {
        if flag(schema, "nullable") {
            return;
        }
        if let Some(t) = schema.get("type").and_then(Value::as_str) {
            errs.push(FieldError::new(
                ErrorKind::TypeInvalid,
                path,
                Some(Value::Null),
                format!("{path} in body must be of type {t}: \"null\""),
            ));
        }
        return;
    }
    let int_or_string = flag(schema, "x-kubernetes-int-or-string");
    if int_or_string {
        if !matches!(type_name(v), "integer" | "string") {
            errs.push(FieldError::new(
                ErrorKind::TypeInvalid,
                path,
                Some(v.clone()),
                format!("{path} in body must be of type integer,string: {:?}", type_name(v)),
            ));
            return;
        }
    } else if let Some(t) = schema.get("type").and_then(Value::as_str) {
        let actual = type_name(v);
        let ok = match t {
            "number" => matches!(actual, "number" | "integer"),
            other => other == actual,
        };
        if !ok {
            errs.push(FieldError::new(
                ErrorKind::TypeInvalid,
                path,
                Some(v.clone()),
                format!("{path} in body must be of type {t}: {actual:?}"),
            ));
            return;
        }
    }
    if let Some(allowed) = schema.get("enum").and_then(Value::as_array)
        && !allowed.contains(v)
    {
        let values: Vec<String> = allowed
            .iter()
            .map(|a| match a {
                Value::String(s) => format!("{s:?}"),
                other => format!("{:?}", other.to_string()),
            })
            .collect();
        errs.push(FieldError::new(
            ErrorKind::NotSupported,
            path,
            Some(v.clone()),
            format!("supported values: {}", values.join(", ")),
        ));
    }
    match v {
        Value::Number(n) => {
            let x = n.as_f64().unwrap_or(0.0);
            if let Some(min) = schema.get("minimum").and_then(Value::as_f64) {
                let excl = flag(schema, "exclusiveMinimum");
                if (excl && x <= min) || (!excl && x < min) {
                    let rel = if excl {
                        "greater than"
                    } else {
                        "greater than or equal to"
                    };
                    errs.push(FieldError::invalid(
                        path,
                        v.clone(),
                        format!("{path} in body should be {rel} {}", fmt_num(min)),
                    ));
                }
            }
            if let Some(max) = schema.get("maximum").and_then(Value::as_f64) {
                let excl = flag(schema, "exclusiveMaximum");
                if (excl && x >= max) || (!excl && x > max) {
                    let rel = if excl { "less than" } else { "less than or equal to" };
                    errs.push(FieldError::invalid(
                        path,
                        v.clone(),
                        format!("{path} in body should be {rel} {}", fmt_num(max)),
                    ));
                }
            }
        }
        Value::String(s) => {
            let len = s.chars().count() as u64;
            if let Some(max) = schema.get("maxLength").and_then(Value::as_u64)
                && len > max
            {
                errs.push(FieldError::new(
                    ErrorKind::TooLong,
                    path,
                    Some(v.clone()),
                    format!("may not be more than {max} bytes"),
                ));
            }
            if let Some(min) = schema.get("minLength").and_then(Value::as_u64)
                && len < min
            {
                errs.push(FieldError::invalid(
                    path,
                    v.clone(),
                    format!("{path} in body should be at least {min} chars long"),
                ));
            }
            if let Some(p) = schema.get("pattern").and_then(Value::as_str)
                && let Ok(re) = regex::Regex::new(p)
                && !re.is_match(s)
            {
                errs.push(FieldError::invalid(
                    path,
                    v.clone(),
                    format!("{path} in body should match '{p}'"),
                ));
            }
            if schema.get("format").and_then(Value::as_str) == Some("date-time")
                && s.parse::<k8s_openapi::jiff::Timestamp>().is_err()
            {
                errs.push(FieldError::invalid(
                    path,
                    v.clone(),
                    format!("{path} in body must be of type date-time: {s:?}"),
                ));
            }
        }
        Value::Array(items) => {
            let n = items.len() as u64;
            if let Some(max) = schema.get("maxItems").and_then(Value::as_u64)
                && n > max
            {
                errs.push(FieldError::new(
                    ErrorKind::TooMany,
                    path,
                    Some(Value::from(n)),
                    format!("must have at most {max} items"),
                ));
            }
            if let Some(min) = schema.get("minItems").and_then(Value::as_u64)
                && n < min
            {
                errs.push(FieldError::invalid(
                    path,
                    v.clone(),
                    format!("{path} in body should have at least {min} items"),
                ));
            }
            if let Some(item_schema) = schema.get("items") {
                for (i, item) in items.iter().enumerate() {
                    validate_value(item, item_schema, &format!("{path}[{i}]"), errs);
                }
            }
        }
        Value::Object(map) => {
            let props = schema.get("properties").and_then(Value::as_object);
            let additional = schema.get("additionalProperties").filter(|a| a.is_object());
            for (k, sub_v) in map {
                if let Some(sub) = props.and_then(|p| p.get(k)).or(additional) {
                    validate_value(sub_v, sub, &child(path, k), errs);
                }
            }
            if let Some(req) = schema.get("required").and_then(Value::as_array) {
                for r in req.iter().filter_map(Value::as_str) {
                    if !map.contains_key(r) {
                        errs.push(FieldError::required(child(path, r), ""));
                    }
                }
            }
            let n = map.len() as u64;
            if let Some(max) = schema.get("maxProperties").and_then(Value::as_u64)
                && n > max
            {
                errs.push(FieldError::invalid(
                    path,
                    v.clone(),
                    format!("{path} in body should have at most {max} properties"),
                ));
            }
            if let Some(min) = schema.get("minProperties").and_then(Value::as_u64)
                && n < min
            {
                errs.push(FieldError::invalid(
                    path,
                    v.clone(),
                    format!("{path} in body should have at least {min} properties"),
                ));
            }
        }
        _ => {}
    }
}

fn fmt_num(x: f64) -> String {
    if x.fract() == 0.0 && x.abs() < 1e15 {
        format!("{}", x as i64)
    } else {
        x.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Found by the real-cluster pass: kube-apiserver refused `status.claim.epoch: u64::MAX`
    /// ("must be of type integer: \"number\"") where the emulator stored it.
    #[test]
    fn an_integer_beyond_int64_is_a_number_as_the_apiserver_decodes_it() {
        assert_eq!(type_name(&json!(i64::MAX)), "integer");
        assert_eq!(type_name(&json!(i64::MIN)), "integer");
        assert_eq!(type_name(&json!(u64::MAX)), "number");
        assert_eq!(type_name(&json!(1.5)), "number");
    }

    fn schema() -> Value {
        json!({"type": "object", "properties": {
            "spec": {"type": "object", "required": ["image"], "properties": {
                "image": {"type": "string"},
                "attempts": {"type": "integer", "minimum": 1, "maximum": 3, "default": 2},
                "mode": {"type": "string", "enum": ["a", "b"]},
                "tags": {"type": "array", "maxItems": 2, "items": {"type": "string"}},
                "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": true},
                "opt": {"type": "string", "nullable": true}
            }}
        }})
    }

    #[test]
    fn prunes_defaults_and_validates() {
        let mut obj = json!({"apiVersion": "x/v1", "kind": "K", "metadata": {"name": "a", "bogus": 1},
            "spec": {"image": "i", "junk": true, "free": {"any": {"thing": 1}}, "opt": null, "mode": null},
            "extra": 1});
        let pruned = prune_and_default(&mut obj, &schema());
        assert_eq!(pruned, vec!["metadata.bogus", "extra", "spec.junk"]);
        assert_eq!(obj["spec"]["attempts"], json!(2));
        assert_eq!(obj["spec"]["free"]["any"]["thing"], json!(1));
        assert!(obj["spec"]["opt"].is_null() && obj["spec"].get("opt").is_some());
        assert!(obj["spec"].get("mode").is_none());
        assert!(validate(&obj, &schema()).is_empty());

        let bad = json!({"spec": {"attempts": 9, "mode": "c", "tags": ["x", "y", "z"]}});
        let errs: Vec<String> = validate(&bad, &schema()).iter().map(ToString::to_string).collect();
        assert_eq!(
            errs,
            vec![
                "spec.attempts: Invalid value: 9: spec.attempts in body should be less than or equal to 3",
                "spec.mode: Unsupported value: \"c\": supported values: \"a\", \"b\"",
                "spec.tags: Too many: 3: must have at most 2 items",
                "spec.image: Required value",
            ]
        );
        let wrong_type = json!({"spec": {"image": 5}});
        let errs: Vec<String> = validate(&wrong_type, &schema())
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            errs,
            vec!["spec.image: Invalid value: 5: spec.image in body must be of type string: \"integer\""]
        );
    }

    #[test]
    fn list_type_map_keys_and_set_items_must_be_unique() {
        let schema = json!({"type": "object", "properties": {
            "spec": {"type": "object", "properties": {
                "steps": {"type": "array", "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
                    "items": {"type": "object", "properties": {"name": {"type": "string"}, "run": {"type": "array",
                        "x-kubernetes-list-type": "set", "items": {"type": "string"}}}}},
                "ports": {"type": "array", "x-kubernetes-list-type": "map",
                    "x-kubernetes-list-map-keys": ["port", "protocol"], "items": {"type": "object"}},
                "byHost": {"type": "object", "additionalProperties": {"type": "array",
                    "x-kubernetes-list-type": "set", "items": {"type": "integer"}}}
            }}
        }});
        let errs = |obj: Value| -> Vec<String> { validate(&obj, &schema).iter().map(ToString::to_string).collect() };
        assert!(
            errs(json!({"spec": {"steps": [{"name": "a"}, {"name": "b"}], "ports": [{"port": 1}, {"port": 2}]}}))
                .is_empty()
        );
        // A third occurrence is not reported again; items with no key repeat each other.
        assert_eq!(
            errs(json!({"spec": {"steps": [
                {"name": "build", "run": ["x"]}, {"name": "build"}, {"name": "build"}, {"run": ["y", "y"]}, {}
            ]}})),
            vec![
                "spec.steps[1]: Duplicate value: map[string]interface {}{\"name\":\"build\"}",
                "spec.steps[4]: Duplicate value: map[string]interface {}{}",
                "spec.steps[3].run[1]: Duplicate value: \"y\"",
            ]
        );
        assert_eq!(
            errs(
                json!({"spec": {"ports": [{"port": 80, "protocol": "TCP"}, {"port": 80, "protocol": "UDP"},
                {"protocol": "TCP", "port": 80, "x": 1}]}})
            ),
            vec!["spec.ports[2]: Duplicate value: map[string]interface {}{\"port\":80, \"protocol\":\"TCP\"}"]
        );
        assert_eq!(
            errs(json!({"spec": {"ports": [{"port": 1}, 5]}})),
            vec![
                // The schema's own error, then the list's (the apiserver reports both, in this order).
                "spec.ports[1]: Invalid value: 5: spec.ports[1] in body must be of type object: \"integer\"",
                "spec.ports[1]: Invalid value: 5: must be an object for an array of list-type map",
            ]
        );
        assert_eq!(
            errs(json!({"spec": {"byHost": {"m1": [1, 2, 1]}}})),
            vec!["spec.byHost[m1][2]: Duplicate value: 1"]
        );
        let dup = &validate(&json!({"spec": {"steps": [{"name": "a"}, {"name": "a"}]}}), &schema)[0];
        assert_eq!(dup.reason(), "FieldValueDuplicate");
    }
}
