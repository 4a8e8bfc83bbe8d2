//! Served resource types: the built-ins Tartan needs, and those learned from CRDs.

use serde_json::{Value, json};

use super::status::GroupResource;

/// One `additionalPrinterColumns` entry.
#[derive(Debug, Clone)]
pub struct Column {
    pub name: String,
    pub type_: String,
    pub format: String,
    pub description: String,
    pub priority: i64,
    pub json_path: String,
}

impl Column {
    fn new(name: &str, type_: &str, json_path: &str) -> Self {
        Column {
            name: name.into(),
            type_: type_.into(),
            format: String::new(),
            description: String::new(),
            priority: 0,
            json_path: json_path.into(),
        }
    }
}

/// How a type is stored and converted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    /// A custom resource: schema-driven, generation-tracked.
    Custom,
    /// A built-in kept as-is.
    Builtin,
    /// `events.k8s.io/v1` Event: stored as a core `v1` Event and converted on the way in and out.
    EventsV1,
}

/// A served group/version/resource.
#[derive(Debug, Clone)]
pub struct ResourceType {
    pub group: String,
    pub version: String,
    pub kind: String,
    pub plural: String,
    pub singular: String,
    pub namespaced: bool,
    pub short_names: Vec<String>,
    pub categories: Vec<String>,
    pub status_subresource: bool,
    pub schema: Option<Value>,
    pub columns: Vec<Column>,
    /// Name of the CRD that defines this type.
    pub crd: Option<String>,
    /// (group, plural) the objects are stored under; shared by every version of a resource.
    pub storage: (String, String),
    pub flavor: Flavor,
    /// Field selectors accepted beyond `metadata.name` / `metadata.namespace`.
    pub selectable: Vec<String>,
    /// Whether `metadata.generation` is maintained.
    pub tracks_generation: bool,
}

impl ResourceType {
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    pub fn gr(&self) -> GroupResource<'_> {
        GroupResource {
            group: &self.group,
            resource: &self.plural,
        }
    }

    pub fn list_kind(&self) -> String {
        format!("{}List", self.kind)
    }

    pub fn verbs(&self) -> Vec<&'static str> {
        vec![
            "create",
            "delete",
            "deletecollection",
            "get",
            "list",
            "patch",
            "update",
            "watch",
        ]
    }

    fn builtin(group: &str, version: &str, kind: &str, plural: &str, namespaced: bool, short: &[&str]) -> Self {
        ResourceType {
            group: group.into(),
            version: version.into(),
            kind: kind.into(),
            plural: plural.into(),
            singular: kind.to_lowercase(),
            namespaced,
            short_names: short.iter().map(|s| s.to_string()).collect(),
            categories: vec![],
            status_subresource: false,
            schema: None,
            columns: vec![],
            crd: None,
            storage: (group.into(), plural.into()),
            flavor: Flavor::Builtin,
            selectable: vec![],
            tracks_generation: false,
        }
    }
}

pub const CRD_CLEANUP_FINALIZER: &str = "customresourcecleanup.apiextensions.k8s.io";

/// The built-in types served from start.
pub fn builtins() -> Vec<ResourceType> {
    let age = || Column::new("Age", "date", ".metadata.creationTimestamp");
    let mut ns = ResourceType::builtin("", "v1", "Namespace", "namespaces", false, &["ns"]);
    ns.status_subresource = true;
    ns.columns = vec![Column::new("Status", "string", ".status.phase"), age()];
    ns.selectable = vec!["status.phase".into()];

    let mut secret = ResourceType::builtin("", "v1", "Secret", "secrets", true, &[]);
    secret.columns = vec![Column::new("Type", "string", ".type"), age()];
    secret.selectable = vec!["type".into()];

    let event_fields = [
        "involvedObject.kind",
        "involvedObject.namespace",
        "involvedObject.name",
        "involvedObject.uid",
        "involvedObject.apiVersion",
        "involvedObject.resourceVersion",
        "involvedObject.fieldPath",
        "reason",
        "reportingComponent",
        "source",
        "type",
    ];
    let mut ev = ResourceType::builtin("", "v1", "Event", "events", true, &["ev"]);
    ev.columns = vec![
        Column::new("Last Seen", "date", ".lastTimestamp"),
        Column::new("Type", "string", ".type"),
        Column::new("Reason", "string", ".reason"),
        Column::new("Object", "string", ".involvedObject.name"),
        Column::new("Message", "string", ".message"),
    ];
    ev.selectable = event_fields.iter().map(|s| s.to_string()).collect();

    let mut ev2 = ResourceType::builtin("events.k8s.io", "v1", "Event", "events", true, &["ev"]);
    ev2.storage = (String::new(), "events".into());
    ev2.flavor = Flavor::EventsV1;
    ev2.columns = ev.columns.clone();
    ev2.selectable = event_fields.iter().map(|s| s.to_string()).collect();

    let mut lease = ResourceType::builtin("coordination.k8s.io", "v1", "Lease", "leases", true, &[]);
    lease.columns = vec![Column::new("Holder", "string", ".spec.holderIdentity"), age()];

    let mut crd = ResourceType::builtin(
        "apiextensions.k8s.io",
        "v1",
        "CustomResourceDefinition",
        "customresourcedefinitions",
        false,
        &["crd", "crds"],
    );
    crd.status_subresource = true;
    crd.tracks_generation = true;
    crd.columns = vec![Column::new("Created At", "date", ".metadata.creationTimestamp")];
    crd.categories = vec!["api-extensions".into()];

    vec![ns, secret, ev, ev2, lease, crd]
}

/// Reads the served versions of a CRD (`apiextensions.k8s.io/v1`) into resource types.
pub fn from_crd(crd: &Value) -> Result<Vec<ResourceType>, String> {
    let name = crd
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let spec = crd.get("spec").ok_or("spec: Required value")?;
    let s = |p: &str| spec.pointer(p).and_then(Value::as_str).map(str::to_string);
    let strs = |p: &str| -> Vec<String> {
        spec.pointer(p)
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).map(str::to_string).collect())
            .unwrap_or_default()
    };
    let group = s("/group").ok_or("spec.group: Required value")?;
    let kind = s("/names/kind").ok_or("spec.names.kind: Required value")?;
    let plural = s("/names/plural").ok_or("spec.names.plural: Required value")?;
    let singular = s("/names/singular").unwrap_or_else(|| kind.to_lowercase());
    let namespaced = match s("/scope").as_deref() {
        Some("Namespaced") => true,
        Some("Cluster") => false,
        other => {
            return Err(format!(
                "spec.scope: Unsupported value: {other:?}: supported values: \"Cluster\", \"Namespaced\""
            ));
        }
    };
    let versions = spec
        .get("versions")
        .and_then(Value::as_array)
        .ok_or("spec.versions: Required value")?;
    let mut out = Vec::new();
    for v in versions {
        if !v.get("served").and_then(Value::as_bool).unwrap_or(false) {
            continue;
        }
        let version = v
            .get("name")
            .and_then(Value::as_str)
            .ok_or("spec.versions[].name: Required value")?;
        let columns = v
            .get("additionalPrinterColumns")
            .and_then(Value::as_array)
            .map(|cols| {
                cols.iter()
                    .map(|c| Column {
                        name: c.get("name").and_then(Value::as_str).unwrap_or_default().into(),
                        type_: c.get("type").and_then(Value::as_str).unwrap_or("string").into(),
                        format: c.get("format").and_then(Value::as_str).unwrap_or_default().into(),
                        description: c.get("description").and_then(Value::as_str).unwrap_or_default().into(),
                        priority: c.get("priority").and_then(Value::as_i64).unwrap_or(0),
                        json_path: c.get("jsonPath").and_then(Value::as_str).unwrap_or_default().into(),
                    })
                    .collect()
            })
            .unwrap_or_else(|| vec![Column::new("Age", "date", ".metadata.creationTimestamp")]);
        let selectable = v
            .get("selectableFields")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|f| f.get("jsonPath").and_then(Value::as_str))
                    .map(|p| p.trim_start_matches('.').to_string())
                    .collect()
            })
            .unwrap_or_default();
        out.push(ResourceType {
            group: group.clone(),
            version: version.into(),
            kind: kind.clone(),
            plural: plural.clone(),
            singular: singular.clone(),
            namespaced,
            short_names: strs("/names/shortNames"),
            categories: strs("/names/categories"),
            status_subresource: v.pointer("/subresources/status").is_some(),
            schema: v.pointer("/schema/openAPIV3Schema").cloned(),
            columns,
            crd: Some(name.clone()),
            storage: (group.clone(), plural.clone()),
            flavor: Flavor::Custom,
            selectable,
            tracks_generation: true,
        });
    }
    Ok(out)
}

/// The status the apiserver gives an accepted CRD.
pub fn crd_status(crd: &Value) -> Value {
    let storage: Vec<Value> = crd
        .pointer("/spec/versions")
        .and_then(Value::as_array)
        .map(|vs| {
            vs.iter()
                .filter(|v| v.get("storage").and_then(Value::as_bool).unwrap_or(false))
                .filter_map(|v| v.get("name").cloned())
                .collect()
        })
        .unwrap_or_default();
    let now = super::clock::now();
    let mut names = crd.pointer("/spec/names").cloned().unwrap_or(json!({}));
    if names.get("singular").is_none()
        && let Some(k) = names.get("kind").and_then(Value::as_str)
    {
        names["singular"] = json!(k.to_lowercase());
    }
    if names.get("listKind").is_none()
        && let Some(k) = names.get("kind").and_then(Value::as_str)
    {
        names["listKind"] = json!(format!("{k}List"));
    }
    json!({
        "acceptedNames": names,
        "conditions": [
            {"type": "NamesAccepted", "status": "True", "lastTransitionTime": now, "reason": "NoConflicts", "message": "no conflicts found"},
            {"type": "Established", "status": "True", "lastTransitionTime": now, "reason": "InitialNamesAccepted", "message": "the initial names have been accepted"}
        ],
        "storedVersions": storage,
    })
}

/// Converts a stored core `v1` Event into its `events.k8s.io/v1` form, or back.
pub fn convert_event(obj: &Value, to_events_v1: bool) -> Value {
    const PAIRS: &[(&str, &str)] = &[
        ("involvedObject", "regarding"),
        ("message", "note"),
        ("source", "deprecatedSource"),
        ("firstTimestamp", "deprecatedFirstTimestamp"),
        ("lastTimestamp", "deprecatedLastTimestamp"),
        ("count", "deprecatedCount"),
        ("reportingComponent", "reportingController"),
    ];
    let Some(map) = obj.as_object() else {
        return obj.clone();
    };
    let mut out = serde_json::Map::new();
    for (k, v) in map {
        let renamed = PAIRS
            .iter()
            .find_map(|(core, new)| match to_events_v1 {
                true if k == core => Some(*new),
                false if k == new => Some(*core),
                _ => None,
            })
            .unwrap_or(k.as_str());
        out.insert(renamed.to_string(), v.clone());
    }
    out.insert(
        "apiVersion".into(),
        json!(if to_events_v1 { "events.k8s.io/v1" } else { "v1" }),
    );
    Value::Object(out)
}
