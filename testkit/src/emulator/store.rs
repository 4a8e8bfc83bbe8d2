//! The object store: one global resourceVersion, a bounded event history for watches, the write
//! pipeline (defaulting, pruning, validation, admission, generation, finalizers) and garbage collection.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{Map, Value, json};
use tokio::sync::{Notify, broadcast};

use super::clock::now;
use super::faults::Faults;
use super::schema::{self, FieldError};
use super::status::{ApiError, ApiResult};
use super::types::{self, CRD_CLEANUP_FINALIZER, Flavor, ResourceType};

pub type StorageKey = (String, String);

/// Where an object is stored: its type's storage key, namespace and name.
pub type Location = (StorageKey, String, String);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// One committed change.
#[derive(Debug)]
pub struct Event {
    pub rv: u64,
    pub key: StorageKey,
    pub namespace: String,
    pub etype: EventType,
    /// The object at `rv` (for DELETED: its last state, with the deletion's resourceVersion).
    pub object: Value,
    /// The object before the change (for selector transitions).
    pub old: Option<Value>,
    /// The watch lines sent for it so far, by what they say (`http::WatchFilter::line_for`):
    /// serialized once however many watches send them.
    pub lines: std::sync::Mutex<Vec<(String, axum::body::Bytes)>>,
}

/// Options common to writes.
#[derive(Debug, Clone, Default)]
pub struct WriteOpts {
    pub dry_run: bool,
    /// `Strict`, `Warn` (the default) or `Ignore`.
    pub field_validation: Option<String>,
}

/// Options of a DELETE.
#[derive(Debug, Clone, Default)]
pub struct DeleteOpts {
    pub dry_run: bool,
    pub propagation: Option<String>,
    pub precondition_uid: Option<String>,
    pub precondition_rv: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sub {
    Main,
    Status,
}

impl Sub {
    fn name(self) -> &'static str {
        match self {
            Sub::Main => "",
            Sub::Status => "status",
        }
    }
}

/// What a DELETE did.
pub enum Deleted {
    /// Removed; the last state.
    Gone(Value),
    /// Kept with a deletionTimestamp until its finalizers are removed.
    Pending(Value),
}

pub struct State {
    rv: u64,
    pub types: Vec<Arc<ResourceType>>,
    objects: BTreeMap<StorageKey, BTreeMap<(String, String), Value>>,
    uids: HashMap<String, Location>,
    /// Owner uid → the objects naming it in their ownerReferences, so the collector finds an
    /// object's dependents without reading the whole store.
    dependents: HashMap<String, BTreeSet<Location>>,
    /// Objects the collector must look at, queued by the writes that may concern them: a write
    /// that concerns no owner, finalizer or deletion queues nothing (writes stay O(1) in the
    /// number of stored objects).
    gc_queue: BTreeSet<Location>,
    /// A CRD was written: storage keys whose type went away are to be emptied.
    gc_sweep_types: bool,
    /// Objects the collector has examined since start.
    gc_visited: u64,
    history: VecDeque<Arc<Event>>,
    pub history_limit: usize,
    /// Watches may start at any resourceVersion >= this.
    compacted: u64,
    pub tx: broadcast::Sender<Arc<Event>>,
    pub faults: Faults,
    pub current_rv: Arc<AtomicU64>,
    pub gc_wake: Arc<Notify>,
    pub requests: Vec<String>,
}

fn meta(obj: &Value, key: &str) -> Option<String> {
    obj.get("metadata")
        .and_then(|m| m.get(key))
        .and_then(Value::as_str)
        .map(str::to_string)
}

fn meta_mut(obj: &mut Value) -> &mut Map<String, Value> {
    if !obj.get("metadata").is_some_and(Value::is_object) {
        obj["metadata"] = json!({});
    }
    obj["metadata"].as_object_mut().expect("metadata is an object")
}

/// Drops empty or null metadata collections, as Go's `omitempty` does when the object is stored.
fn normalize_meta(obj: &mut Value) {
    let m = meta_mut(obj);
    for k in [
        "finalizers",
        "ownerReferences",
        "labels",
        "annotations",
        "managedFields",
    ] {
        let empty = match m.get(k) {
            Some(Value::Null) => true,
            Some(Value::Array(a)) => a.is_empty(),
            Some(Value::Object(o)) => o.is_empty(),
            _ => false,
        };
        if empty {
            m.remove(k);
        }
    }
}

fn finalizers(obj: &Value) -> Vec<String> {
    obj.pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).map(str::to_string).collect())
        .unwrap_or_default()
}

fn set_finalizers(obj: &mut Value, f: &[String]) {
    let m = meta_mut(obj);
    if f.is_empty() {
        m.remove("finalizers");
    } else {
        m.insert("finalizers".into(), json!(f));
    }
}

fn owner_uids(obj: &Value) -> Vec<String> {
    obj.pointer("/metadata/ownerReferences")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|r| r.get("uid").and_then(Value::as_str))
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

fn is_deleting(obj: &Value) -> bool {
    obj.pointer("/metadata/deletionTimestamp").is_some_and(|v| !v.is_null())
}

/// Content without metadata (and status, when it is a subresource): what generation tracks.
fn spec_part(obj: &Value, status_sub: bool) -> Value {
    let mut c = obj.clone();
    if let Some(m) = c.as_object_mut() {
        m.remove("metadata");
        if status_sub {
            m.remove("status");
        }
    }
    c
}

const DNS1123_SUBDOMAIN_MSG: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')";
const DNS1123_LABEL_MSG: &str = "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')";

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_dns_label)
}

fn random_suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    uuid::Uuid::new_v4().as_bytes()[..5]
        .iter()
        .map(|b| ALPHABET[*b as usize % ALPHABET.len()] as char)
        .collect()
}

fn base64(data: &[u8]) -> String {
    const T: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in data.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(T[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

impl State {
    pub fn new(history_limit: usize) -> Self {
        let (tx, _) = broadcast::channel(8192);
        let mut s = State {
            rv: 100,
            types: types::builtins().into_iter().map(Arc::new).collect(),
            objects: BTreeMap::new(),
            uids: HashMap::new(),
            dependents: HashMap::new(),
            gc_queue: BTreeSet::new(),
            gc_sweep_types: false,
            gc_visited: 0,
            history: VecDeque::new(),
            history_limit: history_limit.max(1),
            compacted: 100,
            tx,
            faults: Faults::default(),
            current_rv: Arc::new(AtomicU64::new(100)),
            gc_wake: Arc::new(Notify::new()),
            requests: Vec::new(),
        };
        for ns in ["default", "kube-system", "kube-public"] {
            let rt = s.find("", "v1", "namespaces").expect("namespaces are built in");
            s.create(&rt, "", json!({"metadata": {"name": ns}}), &WriteOpts::default())
                .expect("built-in namespace");
        }
        s.compacted = s.rv;
        s
    }

    pub fn rv(&self) -> u64 {
        self.rv
    }

    pub fn find(&self, group: &str, version: &str, plural: &str) -> Option<Arc<ResourceType>> {
        self.types
            .iter()
            .find(|t| t.group == group && t.version == version && t.plural == plural)
            .cloned()
    }

    /// Drops the whole event history: watches from any earlier resourceVersion get 410 Gone.
    pub fn compact(&mut self) {
        self.history.clear();
        self.compacted = self.rv;
    }

    pub fn compacted(&self) -> u64 {
        self.compacted
    }

    pub fn history_since(&self, rv: u64) -> Vec<Arc<Event>> {
        self.history.iter().filter(|e| e.rv > rv).cloned().collect()
    }

    /// Objects the garbage collector has examined since start (it grows with what changed, not
    /// with what is stored).
    pub fn gc_visited(&self) -> u64 {
        self.gc_visited
    }

    fn commit(&mut self, key: StorageKey, ns: &str, etype: EventType, object: Value, old: Option<Value>) {
        if self.queue_gc(&key, ns, etype, &object, old.as_ref()) {
            self.gc_wake.notify_one();
        }
        let ev = Arc::new(Event {
            rv: self.rv,
            key,
            namespace: ns.to_string(),
            etype,
            object,
            old,
            lines: Default::default(),
        });
        self.history.push_back(ev.clone());
        while self.history.len() > self.history_limit {
            if let Some(dropped) = self.history.pop_front() {
                self.compacted = dropped.rv;
            }
        }
        let _ = self.tx.send(ev);
        self.current_rv.store(self.rv, Ordering::SeqCst);
    }

    fn deleting_at(&self, loc: &Location) -> bool {
        self.stored_at(loc).is_some_and(is_deleting)
    }

    /// Queues for the collector what a committed change may concern; returns whether it queued
    /// anything. Only these can need it: the object itself when it has owners or is being deleted;
    /// an owner, namespace or CRD being deleted and waiting for its dependents, content or
    /// instances to go; and, when the object is gone, its dependents.
    fn queue_gc(&mut self, key: &StorageKey, ns: &str, etype: EventType, obj: &Value, old: Option<&Value>) -> bool {
        let mut due: Vec<Location> = Vec::new();
        let name = meta(obj, "name").unwrap_or_default();
        let owners = owner_uids(obj);
        if etype != EventType::Deleted && (!owners.is_empty() || is_deleting(obj)) {
            due.push((key.clone(), ns.to_string(), name));
        }
        for uid in owners.iter().chain(old.map(owner_uids).unwrap_or_default().iter()) {
            if let Some(loc) = self.uids.get(uid)
                && self.deleting_at(loc)
            {
                due.push(loc.clone());
            }
        }
        if !ns.is_empty() {
            let loc = ((String::new(), "namespaces".to_string()), String::new(), ns.to_string());
            if self.deleting_at(&loc) {
                due.push(loc);
            }
        }
        if let Some(crd) = self.storage_type(key).and_then(|t| t.crd.clone()) {
            let loc = (
                (
                    "apiextensions.k8s.io".to_string(),
                    "customresourcedefinitions".to_string(),
                ),
                String::new(),
                crd,
            );
            if self.deleting_at(&loc) {
                due.push(loc);
            }
        }
        if etype == EventType::Deleted
            && let Some(deps) = meta(obj, "uid").and_then(|u| self.dependents.get(&u))
        {
            due.extend(deps.iter().cloned());
        }
        let queued = !due.is_empty();
        self.gc_queue.extend(due);
        queued
    }

    /// Stores `obj` at a location, keeping the uid and dependents indexes; returns what was there.
    fn put_object(&mut self, key: &StorageKey, ns: &str, name: &str, obj: Value) -> Option<Value> {
        let loc: Location = (key.clone(), ns.to_string(), name.to_string());
        if let Some(uid) = meta(&obj, "uid") {
            self.uids.insert(uid, loc.clone());
        }
        for owner in owner_uids(&obj) {
            self.dependents.entry(owner).or_default().insert(loc.clone());
        }
        let old = self
            .objects
            .entry(key.clone())
            .or_default()
            .insert((ns.to_string(), name.to_string()), obj);
        if let Some(o) = &old {
            let now_owners = self.stored_at(&loc).map(owner_uids).unwrap_or_default();
            for owner in owner_uids(o).into_iter().filter(|u| !now_owners.contains(u)) {
                self.unindex_dependent(&owner, &loc);
            }
        }
        old
    }

    /// Removes the object at a location, keeping the uid and dependents indexes.
    fn take_object(&mut self, key: &StorageKey, ns: &str, name: &str) -> Option<Value> {
        let loc: Location = (key.clone(), ns.to_string(), name.to_string());
        let obj = self
            .objects
            .get_mut(key)
            .and_then(|m| m.remove(&(ns.to_string(), name.to_string())))?;
        if let Some(uid) = meta(&obj, "uid")
            && self.uids.get(&uid) == Some(&loc)
        {
            self.uids.remove(&uid);
        }
        for owner in owner_uids(&obj) {
            self.unindex_dependent(&owner, &loc);
        }
        Some(obj)
    }

    fn unindex_dependent(&mut self, owner: &str, loc: &Location) {
        if let Some(set) = self.dependents.get_mut(owner) {
            set.remove(loc);
            if set.is_empty() {
                self.dependents.remove(owner);
            }
        }
    }

    fn stored_at(&self, loc: &Location) -> Option<&Value> {
        self.objects
            .get(&loc.0)
            .and_then(|m| m.get(&(loc.1.clone(), loc.2.clone())))
    }

    fn next_rv(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    /// The object as served by `rt` (apiVersion/kind of that version, conversion for events).
    pub fn to_served(rt: &ResourceType, obj: &Value) -> Value {
        let mut o = if rt.flavor == Flavor::EventsV1 {
            types::convert_event(obj, true)
        } else {
            obj.clone()
        };
        o["apiVersion"] = json!(rt.api_version());
        o["kind"] = json!(rt.kind);
        o
    }

    fn to_storage(rt: &ResourceType, obj: Value) -> Value {
        let mut o = if rt.flavor == Flavor::EventsV1 {
            types::convert_event(&obj, false)
        } else {
            obj
        };
        if rt.flavor != Flavor::EventsV1 {
            o["apiVersion"] = json!(rt.api_version());
        }
        o["kind"] = json!(rt.kind);
        o
    }

    fn stored(&self, rt: &ResourceType, ns: &str, name: &str) -> Option<&Value> {
        self.objects
            .get(&rt.storage)
            .and_then(|m| m.get(&(ns.to_string(), name.to_string())))
    }

    pub fn get(&self, rt: &ResourceType, ns: &str, name: &str) -> ApiResult<Value> {
        self.stored(rt, ns, name)
            .map(|o| Self::to_served(rt, o))
            .ok_or_else(|| ApiError::not_found(&rt.gr(), name))
    }

    /// Every stored object of `rt` (all namespaces when `ns` is None), served form, in key order.
    pub fn list(&self, rt: &ResourceType, ns: Option<&str>) -> Vec<Value> {
        self.list_page(rt, ns, |_| true, 0, None).0
    }

    /// One page of a list: the `limit` objects from the `start`th of those that `keep` accepts
    /// (in their served form), and how many it accepts in all. Only the page is copied, so the
    /// pages of a paginated list cost O(objects) each, not a copy of every object each.
    pub fn list_page(
        &self,
        rt: &ResourceType,
        ns: Option<&str>,
        keep: impl Fn(&Value) -> bool,
        start: usize,
        limit: Option<usize>,
    ) -> (Vec<Value>, usize) {
        let Some(m) = self.objects.get(&rt.storage) else {
            return (vec![], 0);
        };
        let mut page = Vec::new();
        let mut total = 0;
        for (_, o) in m.iter().filter(|((n, _), _)| ns.is_none_or(|want| want == n)) {
            // Events are stored in another shape than they are served: select on the served one.
            let served = (rt.flavor == Flavor::EventsV1).then(|| Self::to_served(rt, o));
            if !keep(served.as_ref().unwrap_or(o)) {
                continue;
            }
            if total >= start && limit.is_none_or(|l| page.len() < l) {
                page.push(served.unwrap_or_else(|| Self::to_served(rt, o)));
            }
            total += 1;
        }
        (page, total)
    }

    fn check_namespace(&self, rt: &ResourceType, ns: &str, name: &str) -> ApiResult<()> {
        if !rt.namespaced {
            return Ok(());
        }
        let ns_rt = self.find("", "v1", "namespaces").expect("namespaces are built in");
        match self.stored(&ns_rt, "", ns) {
            None => Err(ApiError::not_found(&ns_rt.gr(), ns)),
            Some(n) if is_deleting(n) => Err(ApiError::forbidden(
                &rt.gr(),
                name,
                &format!("unable to create new content in namespace {ns} because it is being terminated"),
            )),
            Some(_) => Ok(()),
        }
    }

    /// Pruning, defaulting and schema validation of a custom resource. Returns warnings.
    fn apply_schema(rt: &ResourceType, obj: &mut Value, name: &str, opts: &WriteOpts) -> ApiResult<Vec<String>> {
        let Some(schema) = &rt.schema else {
            return Ok(vec![]);
        };
        let pruned = schema::prune_and_default(obj, schema);
        let unknown: Vec<String> = pruned.iter().map(|p| format!("unknown field \"{p}\"")).collect();
        let mut warnings = Vec::new();
        match opts.field_validation.as_deref() {
            Some("Strict") if !unknown.is_empty() => {
                return Err(ApiError::bad_request(format!(
                    "{} in version \"{}\" cannot be handled as a {}: strict decoding error: {}",
                    rt.kind,
                    rt.version,
                    rt.kind,
                    unknown.join(", ")
                )));
            }
            Some("Ignore") => {}
            _ => warnings = unknown,
        }
        let errs = schema::validate(obj, schema);
        if !errs.is_empty() {
            return Err(ApiError::invalid(&rt.group, &rt.kind, name, &errs));
        }
        Ok(warnings)
    }

    #[allow(clippy::too_many_arguments)]
    fn admit(
        &self,
        rt: &ResourceType,
        operation: &str,
        sub: Sub,
        ns: &str,
        name: &str,
        object: Option<&Value>,
        old: Option<&Value>,
    ) -> ApiResult<()> {
        for rule in &self.faults.deny {
            if rule.applies(operation, &rt.group, &rt.plural, sub.name(), ns, name, object, old) {
                let why = rule.denial_message();
                let mut e = ApiError::forbidden(&rt.gr(), name, &why);
                if rule.reason.as_deref() != Some("Forbidden") {
                    e.code = 422;
                    e.reason = "Invalid";
                }
                if let Some(d) = e.details.as_mut() {
                    d["causes"] = json!([{"message": why}]);
                }
                return Err(e);
            }
        }
        Ok(())
    }

    fn validate_meta(rt: &ResourceType, obj: &Value, name: &str) -> Vec<FieldError> {
        let mut errs = Vec::new();
        let label_like = rt.plural == "namespaces";
        if label_like && !is_dns_label(name) {
            errs.push(FieldError::invalid("metadata.name", json!(name), DNS1123_LABEL_MSG));
        } else if !label_like && !is_dns_subdomain(name) {
            errs.push(FieldError::invalid("metadata.name", json!(name), DNS1123_SUBDOMAIN_MSG));
        }
        for key in ["labels", "annotations"] {
            if let Some(m) = obj.pointer(&format!("/metadata/{key}")).and_then(Value::as_object) {
                for (k, v) in m {
                    if !v.is_string() {
                        errs.push(FieldError::new(
                            schema::ErrorKind::TypeInvalid,
                            format!("metadata.{key}.{k}"),
                            Some(v.clone()),
                            "must be a string",
                        ));
                    }
                }
            }
        }
        if let Some(refs) = obj.pointer("/metadata/ownerReferences").and_then(Value::as_array) {
            for (i, r) in refs.iter().enumerate() {
                for f in ["apiVersion", "kind", "name", "uid"] {
                    if r.get(f).and_then(Value::as_str).is_none_or(str::is_empty) {
                        errs.push(FieldError::invalid(
                            format!("metadata.ownerReferences[{i}].{f}"),
                            json!(""),
                            format!("{f} must not be empty"),
                        ));
                    }
                }
            }
        }
        errs
    }

    /// Type-specific rules of the built-ins (and CRD registration checks).
    fn builtin_prepare(&self, rt: &ResourceType, obj: &mut Value, old: Option<&Value>) -> ApiResult<()> {
        match (rt.group.as_str(), rt.plural.as_str()) {
            ("", "namespaces") if old.is_none() => {
                obj["spec"] = json!({"finalizers": ["kubernetes"]});
                obj["status"] = json!({"phase": "Active"});
            }
            ("", "secrets") => {
                if let Some(sd) = obj.as_object_mut().and_then(|m| m.remove("stringData"))
                    && let Some(sd) = sd.as_object()
                {
                    if !obj.get("data").is_some_and(Value::is_object) {
                        obj["data"] = json!({});
                    }
                    for (k, v) in sd {
                        obj["data"][k] = json!(base64(v.as_str().unwrap_or_default().as_bytes()));
                    }
                }
                if obj.get("type").is_none() {
                    obj["type"] = json!("Opaque");
                }
            }
            ("apiextensions.k8s.io", "customresourcedefinitions") => {
                let name = meta(obj, "name").unwrap_or_default();
                let types = types::from_crd(obj).map_err(|e| {
                    ApiError::invalid(&rt.group, &rt.kind, &name, &[FieldError::invalid("spec", json!(""), e)])
                })?;
                let group = obj.pointer("/spec/group").and_then(Value::as_str).unwrap_or_default();
                let plural = obj
                    .pointer("/spec/names/plural")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                if name != format!("{plural}.{group}") {
                    return Err(ApiError::invalid(
                        &rt.group,
                        &rt.kind,
                        &name,
                        &[FieldError::invalid(
                            "metadata.name",
                            json!(name),
                            "must be spec.names.plural+\".\"+spec.group",
                        )],
                    ));
                }
                if types.is_empty() {
                    return Err(ApiError::invalid(
                        &rt.group,
                        &rt.kind,
                        &name,
                        &[FieldError::required(
                            "spec.versions",
                            "must have exactly one version marked as storage version",
                        )],
                    ));
                }
                let mut status = types::crd_status(obj);
                if let Some(conds) = old.and_then(|o| o.pointer("/status/conditions")) {
                    status["conditions"] = conds.clone();
                }
                obj["status"] = status;
                if old.is_none() {
                    let mut f = finalizers(obj);
                    if !f.iter().any(|x| x == CRD_CLEANUP_FINALIZER) {
                        f.push(CRD_CLEANUP_FINALIZER.into());
                    }
                    set_finalizers(obj, &f);
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Registers (or replaces) the types a CRD serves.
    pub fn register_crd(&mut self, crd: &Value) -> Result<(), String> {
        let name = meta(crd, "name").unwrap_or_default();
        let new_types = types::from_crd(crd)?;
        self.types.retain(|t| t.crd.as_deref() != Some(name.as_str()));
        self.types.extend(new_types.into_iter().map(Arc::new));
        Ok(())
    }

    fn after_write(&mut self, rt: &ResourceType, obj: Option<&Value>, name: &str) {
        if rt.plural == "customresourcedefinitions" && rt.group == "apiextensions.k8s.io" {
            self.gc_sweep_types = true;
            self.gc_wake.notify_one();
            match obj {
                Some(o) => {
                    let _ = self.register_crd(o);
                }
                None => self.types.retain(|t| t.crd.as_deref() != Some(name)),
            }
        }
    }

    /// POST: create an object.
    pub fn create(
        &mut self,
        rt: &ResourceType,
        ns: &str,
        body: Value,
        opts: &WriteOpts,
    ) -> ApiResult<(Value, Vec<String>)> {
        if !body.is_object() {
            return Err(ApiError::bad_request("the body of the request must be a JSON object"));
        }
        if let Some(av) = body.get("apiVersion").and_then(Value::as_str)
            && av != rt.api_version()
        {
            return Err(ApiError::bad_request(format!(
                "the API version in the data ({av}) does not match the expected API version ({})",
                rt.api_version()
            )));
        }
        let mut obj = Self::to_storage(rt, body);
        let body_ns = meta(&obj, "namespace").unwrap_or_default();
        if rt.namespaced {
            if !body_ns.is_empty() && body_ns != ns {
                return Err(ApiError::bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request",
                ));
            }
            meta_mut(&mut obj).insert("namespace".into(), json!(ns));
        } else {
            meta_mut(&mut obj).remove("namespace");
        }
        if meta(&obj, "resourceVersion").is_some_and(|r| !r.is_empty()) {
            return Err(ApiError::bad_request(
                "resourceVersion should not be set on objects to be created",
            ));
        }
        let mut name = meta(&obj, "name").unwrap_or_default();
        if name.is_empty() {
            match meta(&obj, "generateName").filter(|g| !g.is_empty()) {
                Some(g) => {
                    name = format!("{g}{}", random_suffix());
                    meta_mut(&mut obj).insert("name".into(), json!(name));
                }
                None => {
                    return Err(ApiError::invalid(
                        &rt.group,
                        &rt.kind,
                        "",
                        &[FieldError::required(
                            "metadata.name",
                            "name or generateName is required",
                        )],
                    ));
                }
            }
        }
        self.check_namespace(rt, ns, &name)?;
        if rt.status_subresource
            && rt.flavor == Flavor::Custom
            && let Some(m) = obj.as_object_mut()
        {
            m.remove("status");
        }
        normalize_meta(&mut obj);
        let warnings = Self::apply_schema(rt, &mut obj, &name, opts)?;
        let errs = Self::validate_meta(rt, &obj, &name);
        if !errs.is_empty() {
            return Err(ApiError::invalid(&rt.group, &rt.kind, &name, &errs));
        }
        self.builtin_prepare(rt, &mut obj, None)?;
        {
            let m = meta_mut(&mut obj);
            m.insert("uid".into(), json!(uuid::Uuid::new_v4().to_string()));
            m.insert("creationTimestamp".into(), json!(now()));
            m.remove("deletionTimestamp");
            m.remove("deletionGracePeriodSeconds");
            m.remove("selfLink");
            m.remove("managedFields");
            if rt.tracks_generation {
                m.insert("generation".into(), json!(1));
            } else {
                m.remove("generation");
            }
        }
        if self.stored(rt, ns, &name).is_some() {
            return Err(ApiError::already_exists(&rt.gr(), &name));
        }
        self.admit(
            rt,
            "CREATE",
            Sub::Main,
            ns,
            &name,
            Some(&Self::to_served(rt, &obj)),
            None,
        )?;
        if opts.dry_run {
            return Ok((Self::to_served(rt, &obj), warnings));
        }
        let rv = self.next_rv();
        meta_mut(&mut obj).insert("resourceVersion".into(), json!(rv.to_string()));
        self.put_object(&rt.storage, ns, &name, obj.clone());
        self.commit(rt.storage.clone(), ns, EventType::Added, obj.clone(), None);
        self.after_write(rt, Some(&obj), &name);
        Ok((Self::to_served(rt, &obj), warnings))
    }

    /// PUT (or the result of a PATCH): replace an object, or its status.
    pub fn update(
        &mut self,
        rt: &ResourceType,
        ns: &str,
        name: &str,
        body: Value,
        sub: Sub,
        opts: &WriteOpts,
    ) -> ApiResult<(Value, Vec<String>)> {
        if !body.is_object() {
            return Err(ApiError::bad_request("the body of the request must be a JSON object"));
        }
        let cur = self
            .stored(rt, ns, name)
            .cloned()
            .ok_or_else(|| ApiError::not_found(&rt.gr(), name))?;
        let new = Self::to_storage(rt, body);
        if let Some(n) = meta(&new, "name")
            && n != name
        {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({n}) does not match the name on the URL ({name})"
            )));
        }
        if rt.namespaced
            && let Some(n) = meta(&new, "namespace")
            && !n.is_empty()
            && n != ns
        {
            return Err(ApiError::bad_request(
                "the namespace of the provided object does not match the namespace sent on the request",
            ));
        }
        let cur_rv = meta(&cur, "resourceVersion").unwrap_or_default();
        if let Some(rv) = meta(&new, "resourceVersion").filter(|r| !r.is_empty())
            && rv != cur_rv
        {
            return Err(ApiError::stale(&rt.gr(), name));
        }
        let mut obj = match sub {
            Sub::Status => {
                let mut o = cur.clone();
                match new.get("status") {
                    Some(s) => o["status"] = s.clone(),
                    None => {
                        if let Some(m) = o.as_object_mut() {
                            m.remove("status");
                        }
                    }
                }
                o
            }
            Sub::Main => {
                let mut o = new;
                if rt.status_subresource {
                    match cur.get("status") {
                        Some(s) => o["status"] = s.clone(),
                        None => {
                            if let Some(m) = o.as_object_mut() {
                                m.remove("status");
                            }
                        }
                    }
                }
                let old_meta = cur.get("metadata").cloned().unwrap_or(json!({}));
                let m = meta_mut(&mut o);
                for k in [
                    "uid",
                    "creationTimestamp",
                    "deletionTimestamp",
                    "deletionGracePeriodSeconds",
                    "generation",
                    "name",
                    "namespace",
                ] {
                    match old_meta.get(k) {
                        Some(v) => m.insert(k.into(), v.clone()),
                        None => m.remove(k),
                    };
                }
                m.remove("selfLink");
                m.remove("managedFields");
                o
            }
        };
        meta_mut(&mut obj).insert("resourceVersion".into(), json!(cur_rv));
        normalize_meta(&mut obj);
        let warnings = Self::apply_schema(rt, &mut obj, name, opts)?;
        let mut errs = Self::validate_meta(rt, &obj, name);
        if is_deleting(&cur) {
            let old_f = finalizers(&cur);
            let added: Vec<String> = finalizers(&obj).into_iter().filter(|f| !old_f.contains(f)).collect();
            if !added.is_empty() {
                errs.push(FieldError::forbidden(
                    "metadata.finalizers",
                    format!(
                        "no new finalizers can be added if the object is being deleted, found new finalizers []string{{{}}}",
                        added.iter().map(|f| format!("{f:?}")).collect::<Vec<_>>().join(", ")
                    ),
                ));
            }
        }
        if !errs.is_empty() {
            return Err(ApiError::invalid(&rt.group, &rt.kind, name, &errs));
        }
        self.builtin_prepare(rt, &mut obj, Some(&cur))?;
        if rt.tracks_generation && spec_part(&obj, rt.status_subresource) != spec_part(&cur, rt.status_subresource) {
            let g = cur.pointer("/metadata/generation").and_then(Value::as_i64).unwrap_or(0);
            meta_mut(&mut obj).insert("generation".into(), json!(g + 1));
        }
        if obj == cur {
            return Ok((Self::to_served(rt, &cur), warnings));
        }
        self.admit(
            rt,
            "UPDATE",
            sub,
            ns,
            name,
            Some(&Self::to_served(rt, &obj)),
            Some(&Self::to_served(rt, &cur)),
        )?;
        if opts.dry_run {
            return Ok((Self::to_served(rt, &obj), warnings));
        }
        Ok((self.store_update(rt, ns, name, obj, cur), warnings))
    }

    /// Commits an already-validated new state; deletes it when a deleting object lost its last finalizer.
    fn store_update(&mut self, rt: &ResourceType, ns: &str, name: &str, mut obj: Value, cur: Value) -> Value {
        let rv = self.next_rv();
        meta_mut(&mut obj).insert("resourceVersion".into(), json!(rv.to_string()));
        if is_deleting(&obj) && finalizers(&obj).is_empty() && !Self::namespace_pending(rt, &obj) {
            self.take_object(&rt.storage, ns, name);
            self.commit(rt.storage.clone(), ns, EventType::Deleted, obj.clone(), Some(cur));
            self.after_write(rt, None, name);
        } else {
            self.put_object(&rt.storage, ns, name, obj.clone());
            self.commit(rt.storage.clone(), ns, EventType::Modified, obj.clone(), Some(cur));
            self.after_write(rt, Some(&obj), name);
        }
        Self::to_served(rt, &obj)
    }

    /// A namespace stays until its `spec.finalizers` are cleared by the namespace "controller".
    fn namespace_pending(rt: &ResourceType, obj: &Value) -> bool {
        rt.group.is_empty()
            && rt.plural == "namespaces"
            && obj
                .pointer("/spec/finalizers")
                .and_then(Value::as_array)
                .is_some_and(|a| !a.is_empty())
    }

    /// DELETE.
    pub fn delete(&mut self, rt: &ResourceType, ns: &str, name: &str, opts: &DeleteOpts) -> ApiResult<Deleted> {
        let cur = self
            .stored(rt, ns, name)
            .cloned()
            .ok_or_else(|| ApiError::not_found(&rt.gr(), name))?;
        // As the apiserver's `rest.BeforeDelete` checks them: the GroupResource names the Kind.
        let by_kind = super::status::GroupResource {
            group: &rt.group,
            resource: &rt.kind,
        };
        if let Some(uid) = &opts.precondition_uid {
            let actual = meta(&cur, "uid").unwrap_or_default();
            if *uid != actual {
                return Err(ApiError::conflict(
                    &by_kind,
                    name,
                    &format!(
                        "the UID in the precondition ({uid}) does not match the UID in record ({actual}). The object \
                         might have been deleted and then recreated"
                    ),
                ));
            }
        }
        if let Some(rv) = &opts.precondition_rv {
            let actual = meta(&cur, "resourceVersion").unwrap_or_default();
            if *rv != actual {
                return Err(ApiError::conflict(
                    &by_kind,
                    name,
                    &format!(
                        "the ResourceVersion in the precondition ({rv}) does not match the ResourceVersion in record \
                         ({actual}). The object might have been modified"
                    ),
                ));
            }
        }
        self.admit(
            rt,
            "DELETE",
            Sub::Main,
            ns,
            name,
            None,
            Some(&Self::to_served(rt, &cur)),
        )?;
        let mut fins = finalizers(&cur);
        match opts.propagation.as_deref() {
            Some("Foreground") if !fins.iter().any(|f| f == "foregroundDeletion") => {
                fins.push("foregroundDeletion".into())
            }
            Some("Orphan") if !fins.iter().any(|f| f == "orphan") => fins.push("orphan".into()),
            _ => {}
        }
        if opts.dry_run {
            return Ok(if fins.is_empty() {
                Deleted::Gone(Self::to_served(rt, &cur))
            } else {
                Deleted::Pending(Self::to_served(rt, &cur))
            });
        }
        if !fins.is_empty() || Self::namespace_pending(rt, &cur) {
            let mut obj = cur.clone();
            set_finalizers(&mut obj, &fins);
            if !is_deleting(&cur) {
                let g = cur.pointer("/metadata/generation").and_then(Value::as_i64).unwrap_or(0);
                let m = meta_mut(&mut obj);
                m.insert("deletionTimestamp".into(), json!(now()));
                m.insert("deletionGracePeriodSeconds".into(), json!(0));
                if g > 0 {
                    m.insert("generation".into(), json!(g + 1));
                }
                if Self::namespace_pending(rt, &cur) {
                    obj["status"]["phase"] = json!("Terminating");
                }
            }
            if obj == cur {
                return Ok(Deleted::Pending(Self::to_served(rt, &cur)));
            }
            return Ok(Deleted::Pending(self.store_update(rt, ns, name, obj, cur)));
        }
        Ok(Deleted::Gone(self.remove(rt, ns, name)))
    }

    fn remove(&mut self, rt: &ResourceType, ns: &str, name: &str) -> Value {
        let Some(mut obj) = self.take_object(&rt.storage, ns, name) else {
            return Value::Null;
        };
        let cur = obj.clone();
        let rv = self.next_rv();
        meta_mut(&mut obj).insert("resourceVersion".into(), json!(rv.to_string()));
        self.commit(rt.storage.clone(), ns, EventType::Deleted, obj.clone(), Some(cur));
        self.after_write(rt, None, name);
        Self::to_served(rt, &obj)
    }

    fn storage_type(&self, key: &StorageKey) -> Option<Arc<ResourceType>> {
        self.types
            .iter()
            .find(|t| t.storage == *key && t.flavor != Flavor::EventsV1)
            .or_else(|| self.types.iter().find(|t| t.storage == *key))
            .cloned()
    }

    /// Every object in namespace `ns` (of any type but namespaces).
    fn namespace_content(&self, ns: &str) -> Vec<(Location, Value)> {
        self.objects
            .iter()
            .filter(|(k, _)| k.1 != "namespaces")
            .flat_map(|(k, m)| {
                m.range((ns.to_string(), String::new())..)
                    .take_while(|((n, _), _)| n == ns)
                    .map(|((n, name), o)| ((k.clone(), n.clone(), name.clone()), o.clone()))
            })
            .collect()
    }

    /// One pass of the garbage collector and the namespace / CRD cleanup controllers over what the
    /// writes since the last pass queued. Returns whether more work is queued (its own writes queue
    /// the objects they concern).
    pub fn gc_pass(&mut self) -> bool {
        if std::mem::take(&mut self.gc_sweep_types) {
            let typeless: Vec<StorageKey> = self
                .objects
                .keys()
                .filter(|k| self.storage_type(k).is_none())
                .cloned()
                .collect();
            for key in typeless {
                // The type went away (CRD removed): its objects go too.
                let names: Vec<(String, String)> = self.objects[&key].keys().cloned().collect();
                for (ns, name) in names {
                    self.take_object(&key, &ns, &name);
                }
                self.objects.remove(&key);
            }
        }
        for loc in std::mem::take(&mut self.gc_queue) {
            self.gc_visited += 1;
            let (key, ns, name) = &loc;
            let Some(obj) = self.stored_at(&loc).cloned() else {
                continue;
            };
            if let Some(rt) = self.storage_type(key) {
                self.gc_object(&rt, ns, name, &obj);
            }
        }
        !self.gc_queue.is_empty() || self.gc_sweep_types
    }

    /// The collector's work on one object: its owners, and its own deletion when a finalizer of
    /// the collector or of the namespace / CRD cleanup holds it.
    fn gc_object(&mut self, rt: &ResourceType, ns: &str, name: &str, obj: &Value) {
        let bg = DeleteOpts::default();
        let uid = meta(obj, "uid").unwrap_or_default();
        let owners = owner_uids(obj);
        if !owners.is_empty() {
            let live: Vec<&String> = owners.iter().filter(|u| self.uids.contains_key(*u)).collect();
            if live.is_empty() {
                if !is_deleting(obj) {
                    let _ = self.delete(rt, ns, name, &bg);
                }
                return;
            } else if live.len() < owners.len() {
                let mut o = obj.clone();
                if let Some(refs) = o.pointer_mut("/metadata/ownerReferences").and_then(Value::as_array_mut) {
                    refs.retain(|r| {
                        r.get("uid")
                            .and_then(Value::as_str)
                            .is_some_and(|u| self.uids.contains_key(u))
                    });
                }
                self.store_update(rt, ns, name, o, obj.clone());
                return;
            }
        }
        if !is_deleting(obj) {
            return;
        }
        let fins = finalizers(obj);
        let dependents: Vec<(Location, Value)> = self
            .dependents
            .get(&uid)
            .into_iter()
            .flatten()
            .filter_map(|loc| self.stored_at(loc).map(|d| (loc.clone(), d.clone())))
            .collect();
        if fins.iter().any(|f| f == "orphan") {
            for ((dk, dns, dn), d) in &dependents {
                if let Some(drt) = self.storage_type(dk) {
                    let mut o = d.clone();
                    if let Some(refs) = o.pointer_mut("/metadata/ownerReferences").and_then(Value::as_array_mut) {
                        refs.retain(|r| r.get("uid").and_then(Value::as_str) != Some(uid.as_str()));
                        if refs.is_empty() {
                            meta_mut(&mut o).remove("ownerReferences");
                        }
                    }
                    self.store_update(&drt, dns, dn, o, d.clone());
                }
            }
            let mut o = obj.clone();
            set_finalizers(
                &mut o,
                &fins.iter().filter(|f| *f != "orphan").cloned().collect::<Vec<_>>(),
            );
            self.store_update(rt, ns, name, o, obj.clone());
        } else if fins.iter().any(|f| f == "foregroundDeletion") {
            if dependents.is_empty() {
                let mut o = obj.clone();
                set_finalizers(
                    &mut o,
                    &fins
                        .iter()
                        .filter(|f| *f != "foregroundDeletion")
                        .cloned()
                        .collect::<Vec<_>>(),
                );
                self.store_update(rt, ns, name, o, obj.clone());
            } else {
                for ((dk, dns, dn), d) in &dependents {
                    if !is_deleting(d)
                        && let Some(drt) = self.storage_type(dk)
                    {
                        let _ = self.delete(
                            &drt,
                            dns,
                            dn,
                            &DeleteOpts {
                                propagation: Some("Foreground".into()),
                                ..bg.clone()
                            },
                        );
                    }
                }
            }
        } else if rt.plural == "namespaces" && rt.group.is_empty() && Self::namespace_pending(rt, obj) {
            let content = self.namespace_content(name);
            if content.is_empty() {
                let mut o = obj.clone();
                o["spec"]["finalizers"] = json!([]);
                self.store_update(rt, ns, name, o, obj.clone());
            } else {
                for ((ck, cns, cn), c) in &content {
                    if !is_deleting(c)
                        && let Some(crt) = self.storage_type(ck)
                    {
                        let _ = self.delete(&crt, cns, cn, &bg);
                    }
                }
            }
        } else if rt.plural == "customresourcedefinitions" && fins.iter().any(|f| f == CRD_CLEANUP_FINALIZER) {
            let group = obj
                .pointer("/spec/group")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string();
            let plural = obj
                .pointer("/spec/names/plural")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string();
            let instances: Vec<(Location, Value)> = self
                .objects
                .get(&(group.clone(), plural.clone()))
                .into_iter()
                .flatten()
                .map(|((n, i), o)| (((group.clone(), plural.clone()), n.clone(), i.clone()), o.clone()))
                .collect();
            if instances.is_empty() {
                let mut o = obj.clone();
                set_finalizers(
                    &mut o,
                    &fins
                        .iter()
                        .filter(|f| *f != CRD_CLEANUP_FINALIZER)
                        .cloned()
                        .collect::<Vec<_>>(),
                );
                self.store_update(rt, ns, name, o, obj.clone());
            } else {
                for ((ik, ins, iname), i) in &instances {
                    if !is_deleting(i)
                        && let Some(irt) = self.storage_type(ik)
                    {
                        let _ = self.delete(&irt, ins, iname, &bg);
                    }
                }
            }
        }
    }
}
