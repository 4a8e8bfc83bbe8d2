//! HTTP front end: routing, REST verbs, watch streams, discovery, tables, OpenAPI and fault control.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::body::{Body, Bytes};
use hyper::{Method, Request, Response, StatusCode, header};
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc};

use super::Inner;
use super::faults::{Availability, FaultsUpdate};
use super::selector::{FieldSelector, LabelSelector};
use super::status::{ApiError, ApiResult};
use super::store::{DeleteOpts, Deleted, Event, EventType, State, Sub, WriteOpts};
use super::types::{Flavor, ResourceType};
use super::{discovery, table};

pub type Resp = Response<Body>;

fn json_response(code: u16, v: &Value) -> Resp {
    Response::builder()
        .status(StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(serde_json::to_vec(v).unwrap_or_default()))
        .expect("valid response")
}

fn error_response(e: &ApiError) -> Resp {
    json_response(e.code, &e.to_status())
}

fn with_warnings(mut r: Resp, warnings: &[String]) -> Resp {
    for w in warnings {
        if let Ok(v) = header::HeaderValue::from_str(&format!("299 - {w:?}")) {
            r.headers_mut().append("Warning", v);
        }
    }
    r
}

/// Decoded query string.
struct Query(Vec<(String, String)>);

impl Query {
    fn parse(q: Option<&str>) -> Self {
        let pairs = q
            .unwrap_or_default()
            .split('&')
            .filter(|p| !p.is_empty())
            .map(|p| {
                let (k, v) = p.split_once('=').unwrap_or((p, ""));
                (decode(k), decode(v))
            })
            .collect();
        Query(pairs)
    }

    fn get(&self, k: &str) -> Option<&str> {
        self.0.iter().find(|(key, _)| key == k).map(|(_, v)| v.as_str())
    }

    fn flag(&self, k: &str) -> bool {
        matches!(self.get(k), Some("1" | "true" | "True"))
    }
}

fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                match u8::from_str_radix(std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("zz"), 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A request for a resource, parsed from its path.
struct Target {
    rt: Arc<ResourceType>,
    namespace: Option<String>,
    name: Option<String>,
    sub: Option<String>,
}

/// A request of a partitioned user ([`super::faults::Faults::partitioned`]): returned to hyper
/// as the service's error, it closes the connection without an answer.
#[derive(Debug, thiserror::Error)]
#[error("the request of {user} is dropped: that user is partitioned from the API")]
pub struct Partitioned {
    user: String,
}

/// The bearer token of `req`: the emulator's notion of its user.
fn bearer_token(req: &Request<hyper::body::Incoming>) -> Option<String> {
    let v = req.headers().get(header::AUTHORIZATION)?.to_str().ok()?;
    v.strip_prefix("Bearer ").map(|t| t.trim().to_string())
}

pub async fn handle(
    inner: Arc<Inner>,
    req: Request<hyper::body::Incoming>,
    control_only: bool,
) -> Result<Resp, Partitioned> {
    let path = req.uri().path().to_string();
    let query = Query::parse(req.uri().query());
    let query_text = req.uri().query().filter(|q| !q.is_empty()).map(str::to_string);
    let method = req.method().clone();
    if path.starts_with("/emulator/") {
        return Ok(control(inner, req).await);
    }
    if control_only {
        return Ok(error_response(&ApiError::no_route()));
    }
    let user = bearer_token(&req);
    let (availability, latency, busy) = {
        let mut st = inner.state.lock().expect("state lock");
        if st.requests.len() >= 20_000 {
            st.requests.drain(..10_000);
        }
        // The User-Agent says which process sent it (two controllers share one ServiceAccount).
        let agent = req
            .headers()
            .get(header::USER_AGENT)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-");
        st.requests.push(format!("{method} {} ua={agent}", req.uri()));
        if st.faults.is_partitioned(user.as_deref()) {
            return Err(Partitioned {
                user: user.unwrap_or_default(),
            });
        }
        (st.faults.availability, st.faults.latency_ms, st.faults.busy_ms)
    };
    if latency > 0 {
        tokio::time::sleep(Duration::from_millis(latency)).await;
    }
    if busy > 0 {
        let request = format!("{method} {path}");
        inner.busy.pass(request, Duration::from_millis(busy)).await;
    }
    if availability != Availability::Up {
        return Ok(error_response(&ApiError::unavailable()));
    }
    let accept = req
        .headers()
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let content_type = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let body = match axum::body::to_bytes(Body::new(req.into_body()), 64 << 20).await {
        Ok(b) => b,
        Err(e) => return Ok(error_response(&ApiError::bad_request(format!("reading body: {e}")))),
    };
    let uri = match query_text {
        Some(q) => format!("{path}?{q}"),
        None => path.clone(),
    };
    let request = Received {
        method,
        path,
        query,
        accept,
        content_type,
        body,
        user,
        uri,
    };
    let hold = held(&inner, &request.method, &request.path);
    if let Some(hold) = hold {
        // The write is applied by a task of its own: a client that gave up (its connection closed,
        // so hyper drops this future) does not take it back, as it cannot on a real apiserver.
        let applying = tokio::spawn(async move {
            tokio::time::sleep(hold).await;
            answer(&inner, request).await
        });
        return Ok(applying
            .await
            .unwrap_or_else(|e| error_response(&ApiError::internal(format!("held write failed: {e}")))));
    }
    Ok(answer(&inner, request).await)
}

/// An API request as read: everything [`route`] needs, owned.
struct Received {
    method: Method,
    path: String,
    query: Query,
    accept: String,
    content_type: String,
    body: Bytes,
    user: Option<String>,
    /// Path and query, for the answers log.
    uri: String,
}

/// Routes `r` and records the answer.
async fn answer(inner: &Arc<Inner>, r: Received) -> Resp {
    let result = route(
        inner,
        &r.method,
        &r.path,
        &r.query,
        &r.accept,
        &r.content_type,
        r.body,
        r.user.clone(),
    )
    .await;
    let response = result.unwrap_or_else(|e| error_response(&e));
    let at_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    inner.answers.lock().expect("answers lock").push(super::Answer {
        at_ms,
        method: r.method.to_string(),
        uri: r.uri,
        user: r.user,
        code: response.status().as_u16(),
    });
    response
}

/// How long a write to `path` is held ([`super::faults::HeldWrites`]), taking one from the first
/// rule that holds it; `None` for reads and writes no rule holds.
fn held(inner: &Inner, method: &Method, path: &str) -> Option<Duration> {
    if !matches!(*method, Method::POST | Method::PUT | Method::PATCH | Method::DELETE) {
        return None;
    }
    let segs: Vec<&str> = path.trim_matches('/').split('/').filter(|s| !s.is_empty()).collect();
    let rest = match segs.as_slice() {
        ["api", _, rest @ ..] | ["apis", _, _, rest @ ..] => rest,
        _ => return None,
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, plural, more @ ..]
            if !(more.is_empty() && (*plural == "status" || *plural == "finalize")) =>
        {
            (*ns, &rest[2..])
        }
        _ => ("", rest),
    };
    let plural = rest.first()?;
    let name = rest.get(1).copied().unwrap_or_default();
    let sub = rest.get(2).copied().unwrap_or_default();
    let mut st = inner.state.lock().expect("state lock");
    let rule = st
        .faults
        .held_writes
        .iter_mut()
        .find(|h| h.matches(plural, sub, namespace, name))?;
    rule.count -= 1;
    Some(Duration::from_millis(rule.hold_ms))
}

#[allow(clippy::too_many_arguments)]
async fn route(
    inner: &Arc<Inner>,
    method: &Method,
    path: &str,
    query: &Query,
    accept: &str,
    content_type: &str,
    body: Bytes,
    user: Option<String>,
) -> ApiResult<Resp> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').filter(|s| !s.is_empty()).collect();
    match segs.as_slice() {
        ["healthz"] | ["readyz"] | ["livez"] => {
            return Ok(Response::builder().body(Body::from("ok")).expect("valid response"));
        }
        ["version"] => return Ok(json_response(200, &discovery::version())),
        ["api"] => return Ok(json_response(200, &discovery::api_versions(&inner.addr.to_string()))),
        ["apis"] => {
            let st = inner.state.lock().expect("state lock");
            return Ok(json_response(200, &discovery::group_list(&st.types)));
        }
        ["openapi", "v2"] => {
            let st = inner.state.lock().expect("state lock");
            let doc = super::openapi::v2(&st.types);
            if accept.contains("protobuf") {
                return Ok(Response::builder()
                    .header(
                        header::CONTENT_TYPE,
                        "application/com.github.proto-openapi.spec.v2.v1.0+protobuf",
                    )
                    .body(Body::from(super::protobuf::encode_document(&doc)))
                    .expect("valid response"));
            }
            return Ok(json_response(200, &doc));
        }
        ["openapi", "v3"] => {
            let st = inner.state.lock().expect("state lock");
            return Ok(json_response(200, &super::openapi::v3_root(&st.types)));
        }
        ["openapi", "v3", rest @ ..] => {
            let gv = rest.join("/");
            let st = inner.state.lock().expect("state lock");
            return super::openapi::v3_group_version(&st.types, &gv)
                .map(|d| json_response(200, &d))
                .ok_or_else(ApiError::no_route);
        }
        _ => {}
    }
    let (group, version, rest) = match segs.as_slice() {
        ["api", v, rest @ ..] => ("", *v, rest),
        ["apis", g] => {
            let st = inner.state.lock().expect("state lock");
            return discovery::group(&st.types, g)
                .map(|g| json_response(200, &g))
                .ok_or_else(ApiError::no_route);
        }
        ["apis", g, v, rest @ ..] => (*g, *v, rest),
        _ => return Err(ApiError::no_route()),
    };
    if rest.is_empty() {
        let st = inner.state.lock().expect("state lock");
        return discovery::resource_list(&st.types, group, version)
            .map(|l| json_response(200, &l))
            .ok_or_else(ApiError::no_route);
    }
    let (namespace, rest): (Option<String>, &[&str]) = match rest {
        ["namespaces", ns, plural, more @ ..]
            if !(more.is_empty() && (*plural == "status" || *plural == "finalize")) =>
        {
            (Some(ns.to_string()), &rest[2..])
        }
        _ => (None, rest),
    };
    let plural = rest[0];
    let rt = {
        let st = inner.state.lock().expect("state lock");
        st.find(group, version, plural).ok_or_else(ApiError::no_route)?
    };
    if namespace.is_some() && !rt.namespaced {
        return Err(ApiError::no_route());
    }
    let target = Target {
        rt: rt.clone(),
        namespace: namespace.clone(),
        name: rest.get(1).map(|s| s.to_string()),
        sub: rest.get(2).map(|s| s.to_string()),
    };
    if rest.len() > 3 {
        return Err(ApiError::no_route());
    }
    if let Some(sub) = &target.sub {
        let ok = (sub == "status" && rt.status_subresource) || (sub == "finalize" && rt.plural == "namespaces");
        if !ok {
            return Err(ApiError::no_route());
        }
    }
    if rt.namespaced && target.name.is_some() && namespace.is_none() {
        return Err(ApiError::no_route());
    }
    match (method, target.name.is_some()) {
        (&Method::GET, false) if query.flag("watch") => watch(inner, &target, query, accept, user),
        (&Method::GET, false) => list(inner, &target, query, accept),
        (&Method::POST, false) => create(inner, &target, query, &body),
        (&Method::DELETE, false) => delete_collection(inner, &target, query),
        (&Method::GET, true) if query.flag("watch") => {
            let q = Query(
                query
                    .0
                    .iter()
                    .cloned()
                    .chain([(
                        "fieldSelector".to_string(),
                        format!("metadata.name={}", target.name.clone().unwrap_or_default()),
                    )])
                    .collect(),
            );
            watch(inner, &Target { name: None, ..target }, &q, accept, user)
        }
        (&Method::GET, true) => get(inner, &target, accept),
        (&Method::PUT, true) => update(inner, &target, query, &body),
        (&Method::PATCH, true) => patch(inner, &target, query, content_type, &body),
        (&Method::DELETE, true) if target.sub.is_none() => delete(inner, &target, query, &body),
        _ => Err(ApiError::method_not_allowed()),
    }
}

fn ns_of(t: &Target) -> &str {
    t.namespace.as_deref().unwrap_or_default()
}

fn sub_of(t: &Target) -> Sub {
    match t.sub.as_deref() {
        Some("status") => Sub::Status,
        _ => Sub::Main,
    }
}

fn write_opts(query: &Query) -> WriteOpts {
    WriteOpts {
        dry_run: query.get("dryRun") == Some("All"),
        field_validation: query.get("fieldValidation").map(str::to_string),
    }
}

fn parse_body(body: &[u8]) -> ApiResult<Value> {
    serde_json::from_slice(body)
        .or_else(|_| serde_saphyr::from_slice::<Value>(body))
        .map_err(|e| ApiError::bad_request(format!("error decoding body: {e}")))
}

fn selectors(rt: &ResourceType, query: &Query) -> ApiResult<(LabelSelector, FieldSelector)> {
    let labels = LabelSelector::parse(query.get("labelSelector").unwrap_or_default()).map_err(ApiError::bad_request)?;
    let fields = FieldSelector::parse(query.get("fieldSelector").unwrap_or_default()).map_err(ApiError::bad_request)?;
    for f in fields.fields() {
        let ok = matches!(f, "metadata.name" | "metadata.namespace") || rt.selectable.iter().any(|s| s == f);
        if !ok {
            return Err(ApiError::bad_request(format!(
                "unable to parse requirement: field label not supported: {f}"
            )));
        }
    }
    Ok((labels, fields))
}

fn get(inner: &Arc<Inner>, t: &Target, accept: &str) -> ApiResult<Resp> {
    let st = inner.state.lock().expect("state lock");
    let obj = st.get(&t.rt, ns_of(t), t.name.as_deref().unwrap_or_default())?;
    if accept.contains("as=Table") {
        return Ok(json_response(
            200,
            &table::table(&t.rt, &[obj], &st.rv().to_string(), None),
        ));
    }
    Ok(json_response(200, &obj))
}

fn list(inner: &Arc<Inner>, t: &Target, query: &Query, accept: &str) -> ApiResult<Resp> {
    let (labels, fields) = selectors(&t.rt, query)?;
    let start = match query.get("continue").filter(|c| !c.is_empty()) {
        Some(c) => c
            .parse::<usize>()
            .map_err(|_| ApiError::bad_request("invalid continue token"))?,
        None => 0,
    };
    // kube-apiserver serves a list at resourceVersion=0 from its watch cache, which ignores
    // `limit`: everything comes in one response (v1.24, the referee; a client that asks for pages
    // at "any" resourceVersion gets one page of all objects).
    let limit = query
        .get("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .filter(|l| *l > 0)
        .filter(|_| query.get("resourceVersion") != Some("0"));
    let st = inner.state.lock().expect("state lock");
    let rv = st.rv().to_string();
    let (items, total) = st.list_page(
        &t.rt,
        t.namespace.as_deref(),
        |o| labels.matches(o) && fields.matches(o),
        start,
        limit,
    );
    drop(st);
    let mut list_meta = json!({"resourceVersion": rv});
    if let Some(limit) = limit
        && total > start + limit
    {
        list_meta["continue"] = json!((start + limit).to_string());
        list_meta["remainingItemCount"] = json!(total - start - limit);
    }
    if accept.contains("as=Table") {
        return Ok(json_response(
            200,
            &table::table(&t.rt, &items, &rv, query.get("includeObject")),
        ));
    }
    Ok(json_response(
        200,
        &json!({"kind": t.rt.list_kind(), "apiVersion": t.rt.api_version(), "metadata": list_meta, "items": items}),
    ))
}

fn create(inner: &Arc<Inner>, t: &Target, query: &Query, body: &[u8]) -> ApiResult<Resp> {
    let obj = parse_body(body)?;
    let mut st = inner.state.lock().expect("state lock");
    let (created, warnings) = st.create(&t.rt, ns_of(t), obj, &write_opts(query))?;
    Ok(with_warnings(json_response(201, &created), &warnings))
}

fn update(inner: &Arc<Inner>, t: &Target, query: &Query, body: &[u8]) -> ApiResult<Resp> {
    let obj = parse_body(body)?;
    let name = t.name.as_deref().unwrap_or_default();
    let mut st = inner.state.lock().expect("state lock");
    let (updated, warnings) = st.update(&t.rt, ns_of(t), name, obj, sub_of(t), &write_opts(query))?;
    Ok(with_warnings(json_response(200, &updated), &warnings))
}

/// Removes strategic-merge-patch directives (`$patch`, `$retainKeys`, `$setElementOrder/...`, `$deleteFromPrimitiveList/...`).
fn strip_directives(v: &mut Value) {
    if let Some(m) = v.as_object_mut() {
        m.retain(|k, _| !k.starts_with('$'));
        for x in m.values_mut() {
            strip_directives(x);
        }
    }
}

/// Server-side apply without field ownership: maps merge recursively, everything else is replaced.
fn apply_merge(target: &mut Value, applied: &Value) {
    match (target.as_object_mut(), applied.as_object()) {
        (Some(t), Some(a)) => {
            for (k, v) in a {
                match t.get_mut(k) {
                    Some(existing) if existing.is_object() && v.is_object() => apply_merge(existing, v),
                    _ => {
                        t.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        _ => *target = applied.clone(),
    }
}

const CR_PATCH_TYPES: &[&str] = &[
    "application/json-patch+json",
    "application/merge-patch+json",
    "application/apply-patch+yaml",
];

fn patch(inner: &Arc<Inner>, t: &Target, query: &Query, content_type: &str, body: &[u8]) -> ApiResult<Resp> {
    let name = t.name.as_deref().unwrap_or_default();
    let ns = ns_of(t);
    let ct = content_type.split(';').next().unwrap_or_default().trim();
    let opts = write_opts(query);
    let mut st = inner.state.lock().expect("state lock");
    let current = match st.get(&t.rt, ns, name) {
        Ok(c) => Some(c),
        Err(e) if ct == "application/apply-patch+yaml" && e.code == 404 => None,
        Err(e) => return Err(e),
    };
    let patched = match ct {
        "application/json-patch+json" => {
            let p: json_patch::Patch =
                serde_json::from_slice(body).map_err(|e| ApiError::bad_request(e.to_string()))?;
            let mut doc = current.clone().unwrap_or_default();
            json_patch::patch(&mut doc, &p).map_err(|_| {
                ApiError::new(
                    422,
                    "Invalid",
                    "the server rejected our request due to an error in our request",
                )
                .with_details(json!({}))
            })?;
            doc
        }
        "application/merge-patch+json" => {
            let p = parse_body(body)?;
            let mut doc = current.clone().unwrap_or_default();
            json_patch::merge(&mut doc, &p);
            doc
        }
        "application/strategic-merge-patch+json" if t.rt.flavor != Flavor::Custom => {
            let mut p = parse_body(body)?;
            strip_directives(&mut p);
            let mut doc = current.clone().unwrap_or_default();
            json_patch::merge(&mut doc, &p);
            doc
        }
        "application/apply-patch+yaml" => {
            if query.get("fieldManager").is_none_or(str::is_empty) {
                return Err(ApiError::invalid(
                    "meta.k8s.io",
                    "PatchOptions",
                    "",
                    &[super::schema::FieldError::required(
                        "fieldManager",
                        "is required for apply patch",
                    )],
                ));
            }
            let applied = parse_body(body)?;
            match &current {
                None => {
                    let mut obj = applied;
                    obj["metadata"]["name"] = json!(name);
                    let (created, warnings) = st.create(&t.rt, ns, obj, &opts)?;
                    return Ok(with_warnings(json_response(201, &created), &warnings));
                }
                Some(c) => {
                    let mut doc = c.clone();
                    apply_merge(&mut doc, &applied);
                    doc
                }
            }
        }
        other => {
            let accepted: Vec<&str> = if t.rt.flavor == Flavor::Custom {
                CR_PATCH_TYPES.to_vec()
            } else {
                vec![
                    "application/json-patch+json",
                    "application/merge-patch+json",
                    "application/strategic-merge-patch+json",
                    "application/apply-patch+yaml",
                ]
            };
            return Err(ApiError::unsupported_media_type(other, &accepted));
        }
    };
    let (updated, warnings) = st.update(&t.rt, ns, name, patched, sub_of(t), &opts)?;
    Ok(with_warnings(json_response(200, &updated), &warnings))
}

fn delete_opts(query: &Query, body: &[u8]) -> ApiResult<DeleteOpts> {
    let b = if body.iter().all(u8::is_ascii_whitespace) {
        json!({})
    } else {
        parse_body(body)?
    };
    let s = |p: &str| b.pointer(p).and_then(Value::as_str).map(str::to_string);
    let mut propagation = s("/propagationPolicy").or_else(|| query.get("propagationPolicy").map(str::to_string));
    if propagation.is_none() && b.get("orphanDependents").and_then(Value::as_bool) == Some(true) {
        propagation = Some("Orphan".into());
    }
    let dry = b
        .get("dryRun")
        .and_then(Value::as_array)
        .is_some_and(|a| a.iter().any(|v| v == "All"))
        || query.get("dryRun") == Some("All");
    Ok(DeleteOpts {
        dry_run: dry,
        propagation,
        precondition_uid: s("/preconditions/uid"),
        precondition_rv: s("/preconditions/resourceVersion"),
    })
}

fn deleted_status(t: &Target, obj: &Value) -> Value {
    let mut details = json!({
        "name": obj.pointer("/metadata/name").cloned().unwrap_or_default(),
        "kind": t.rt.plural,
        "uid": obj.pointer("/metadata/uid").cloned().unwrap_or_default(),
    });
    if !t.rt.group.is_empty() {
        details["group"] = json!(t.rt.group);
    }
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "details": details})
}

fn delete(inner: &Arc<Inner>, t: &Target, query: &Query, body: &[u8]) -> ApiResult<Resp> {
    let opts = delete_opts(query, body)?;
    let mut st = inner.state.lock().expect("state lock");
    match st.delete(&t.rt, ns_of(t), t.name.as_deref().unwrap_or_default(), &opts)? {
        Deleted::Gone(obj) => Ok(json_response(200, &deleted_status(t, &obj))),
        Deleted::Pending(obj) => Ok(json_response(200, &obj)),
    }
}

fn delete_collection(inner: &Arc<Inner>, t: &Target, query: &Query) -> ApiResult<Resp> {
    let (labels, fields) = selectors(&t.rt, query)?;
    let opts = delete_opts(query, b"")?;
    let mut st = inner.state.lock().expect("state lock");
    let victims: Vec<Value> = st
        .list(&t.rt, t.namespace.as_deref())
        .into_iter()
        .filter(|o| labels.matches(o) && fields.matches(o))
        .collect();
    let mut items = Vec::new();
    for v in victims {
        let ns = v
            .pointer("/metadata/namespace")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let name = v
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        match st.delete(&t.rt, &ns, &name, &opts)? {
            Deleted::Gone(o) | Deleted::Pending(o) => items.push(o),
        }
    }
    let rv = st.rv().to_string();
    Ok(json_response(
        200,
        &json!({"kind": t.rt.list_kind(), "apiVersion": t.rt.api_version(), "metadata": {"resourceVersion": rv}, "items": items}),
    ))
}

struct WatchFilter {
    rt: Arc<ResourceType>,
    namespace: Option<String>,
    labels: LabelSelector,
    fields: FieldSelector,
}

impl WatchFilter {
    fn matches(&self, obj: &Value) -> bool {
        self.labels.matches(obj) && self.fields.matches(obj)
    }

    /// The event this watch sees for a committed change, if any (selector transitions included).
    fn translate(&self, ev: &Event) -> Option<Value> {
        if ev.key != self.rt.storage || self.namespace.as_deref().is_some_and(|n| n != ev.namespace) {
            return None;
        }
        let obj = State::to_served(&self.rt, &ev.object);
        let old = ev.old.as_ref().map(|o| State::to_served(&self.rt, o));
        let now = self.matches(&obj);
        let before = old.as_ref().is_some_and(|o| self.matches(o));
        let etype = match ev.etype {
            EventType::Added if now => "ADDED",
            EventType::Modified if now && before => "MODIFIED",
            EventType::Modified if now => "ADDED",
            EventType::Modified if before => {
                // As the apiserver's watch cache does: the last content the selector matched,
                // at the change's resourceVersion.
                let mut last = old.unwrap_or(obj);
                let rv = ev.object.pointer("/metadata/resourceVersion").cloned();
                if let (Some(rv), Some(meta)) = (rv, last.get_mut("metadata").and_then(Value::as_object_mut)) {
                    meta.insert("resourceVersion".into(), rv);
                }
                return Some(json!({"type": "DELETED", "object": last}));
            }
            EventType::Deleted if now || before => "DELETED",
            _ => return None,
        };
        Some(json!({"type": etype, "object": obj}))
    }
}

impl WatchFilter {
    /// [`WatchFilter::translate`] as the line a watch sends. Every agent of a fleet watches the
    /// same kinds: a line is made once per event and served form and shared, and a watch the
    /// change does not concern costs a selector match, not a copy of the object.
    fn line_for(&self, ev: &Event) -> Option<Bytes> {
        if self.rt.flavor == Flavor::EventsV1 {
            // Stored in another shape than served: selectors apply to the served one.
            return self.translate(ev).map(|v| line(&v));
        }
        if ev.key != self.rt.storage || self.namespace.as_deref().is_some_and(|n| n != ev.namespace) {
            return None;
        }
        let now = self.matches(&ev.object);
        let before = ev.old.as_ref().is_some_and(|o| self.matches(o));
        let says = match ev.etype {
            EventType::Added if now => "ADDED",
            EventType::Modified if now && before => "MODIFIED",
            EventType::Modified if now => "ADDED",
            EventType::Modified if before => "DELETED-LAST-MATCH",
            EventType::Deleted if now || before => "DELETED",
            _ => return None,
        };
        let key = format!("{says} {} {}", self.rt.api_version(), self.rt.kind);
        let mut lines = ev.lines.lock().expect("event lines lock");
        if let Some((_, made)) = lines.iter().find(|(k, _)| *k == key) {
            return Some(made.clone());
        }
        let made = line(&self.translate(ev)?);
        lines.push((key, made.clone()));
        Some(made)
    }
}

/// The line `filter`'s watch sends for `ev`: the shared one, unless a Table is asked for.
fn send_line(
    filter: &WatchFilter,
    ev: &Event,
    as_table: bool,
    shape: &mut impl FnMut(Value) -> Value,
) -> Option<Bytes> {
    if as_table {
        filter.translate(ev).map(|v| line(&shape(v)))
    } else {
        filter.line_for(ev)
    }
}

fn line(v: &Value) -> Bytes {
    let mut b = serde_json::to_vec(v).unwrap_or_default();
    b.push(b'\n');
    Bytes::from(b)
}

fn watch(inner: &Arc<Inner>, t: &Target, query: &Query, accept: &str, user: Option<String>) -> ApiResult<Resp> {
    let as_table = accept.contains("as=Table");
    let (labels, fields) = selectors(&t.rt, query)?;
    let filter = WatchFilter {
        rt: t.rt.clone(),
        namespace: t.namespace.clone(),
        labels,
        fields,
    };
    let bookmarks = query.flag("allowWatchBookmarks");
    let send_initial = query.flag("sendInitialEvents");
    let timeout = query
        .get("timeoutSeconds")
        .and_then(|s| s.parse::<u64>().ok())
        .filter(|s| *s > 0)
        .unwrap_or(1800);
    let rv_param = query.get("resourceVersion").unwrap_or_default().to_string();
    if send_initial && !bookmarks {
        return Err(ApiError::invalid(
            "meta.k8s.io",
            "ListOptions",
            "",
            &[super::schema::FieldError::forbidden(
                "allowWatchBookmarks",
                "allowWatchBookmarks required when sendInitialEvents is true",
            )],
        ));
    }
    let (rx, initial, backlog, start_rv, error) = {
        let st = inner.state.lock().expect("state lock");
        let rx = st.tx.subscribe();
        let start_rv = st.rv();
        let mut initial = Vec::new();
        let mut backlog = Vec::new();
        let mut error = None;
        if rv_param.is_empty() || rv_param == "0" || send_initial {
            initial = st
                .list(&t.rt, t.namespace.as_deref())
                .into_iter()
                .filter(|o| filter.matches(o))
                .collect();
        } else {
            match rv_param.parse::<u64>() {
                Ok(rv) if rv < st.compacted() => {
                    error = Some(ApiError::expired(format!(
                        "too old resource version: {rv} ({})",
                        st.compacted()
                    )));
                }
                Ok(rv) => backlog = st.history_since(rv),
                Err(_) => {
                    return Err(ApiError::bad_request(format!("invalid resource version: {rv_param:?}")));
                }
            }
        }
        (rx, initial, backlog, start_rv, error)
    };
    let (tx, out) = mpsc::channel::<Bytes>(64);
    let table_rt = t.rt.clone();
    // `kubectl get -w` asks for Tables: every event object becomes a one-row Table; as in the
    // apiserver, only the first one carries the columnDefinitions.
    let mut columns_sent = false;
    let mut shape = move |mut ev: Value| -> Value {
        if as_table && ev["type"] != "BOOKMARK" && ev["type"] != "ERROR" {
            let rv = ev
                .pointer("/object/metadata/resourceVersion")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string();
            let mut t = table::table(&table_rt, &[ev["object"].clone()], &rv, None);
            if std::mem::replace(&mut columns_sent, true)
                && let Some(m) = t.as_object_mut()
            {
                m.remove("columnDefinitions");
            }
            ev["object"] = t;
        }
        ev
    };
    let current_rv = inner.state.lock().expect("state lock").current_rv.clone();
    let bookmark_every = inner.bookmark_interval;
    let kind = t.rt.kind.clone();
    let api_version = t.rt.api_version();
    let cut_check = Arc::clone(inner);
    let inner = Arc::clone(inner);
    tokio::spawn(async move {
        if stalled(&inner, &tx).await {
            return;
        }
        let bookmark = |rv: u64, end: bool| {
            let mut meta = json!({"resourceVersion": rv.to_string()});
            if end {
                meta["annotations"] = json!({"k8s.io/initial-events-end": "true"});
            }
            line(&json!({"type": "BOOKMARK", "object": {"kind": kind, "apiVersion": api_version, "metadata": meta}}))
        };
        if let Some(e) = error {
            let _ = tx.send(line(&json!({"type": "ERROR", "object": e.to_status()}))).await;
            return;
        }
        for o in initial {
            if tx
                .send(line(&shape(json!({"type": "ADDED", "object": o}))))
                .await
                .is_err()
            {
                return;
            }
        }
        if send_initial {
            let _ = tx.send(bookmark(start_rv, true)).await;
        }
        let mut last = start_rv;
        for ev in backlog {
            last = last.max(ev.rv);
            if let Some(l) = send_line(&filter, &ev, as_table, &mut shape)
                && tx.send(l).await.is_err()
            {
                return;
            }
        }
        let mut rx = rx;
        let deadline = tokio::time::sleep(Duration::from_secs(timeout));
        tokio::pin!(deadline);
        let mut tick = tokio::time::interval(bookmark_every);
        tick.tick().await;
        loop {
            tokio::select! {
                _ = &mut deadline => return,
                _ = tx.closed() => return,
                r = rx.recv() => match r {
                    Ok(_) if stalled(&inner, &tx).await => return,
                    Ok(ev) => {
                        last = last.max(ev.rv);
                        if let Some(l) = send_line(&filter, &ev, as_table, &mut shape) && tx.send(l).await.is_err() {
                            return;
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        let e = ApiError::expired(format!("too old resource version: {last} (watch fell behind)"));
                        let _ = tx.send(line(&json!({"type": "ERROR", "object": e.to_status()}))).await;
                        return;
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                },
                _ = tick.tick(), if bookmarks => {
                    if stalled(&inner, &tx).await {
                        return;
                    }
                    let global = current_rv.load(Ordering::SeqCst);
                    loop {
                        match rx.try_recv() {
                            Ok(ev) => {
                                last = last.max(ev.rv);
                                if let Some(l) = send_line(&filter, &ev, as_table, &mut shape) && tx.send(l).await.is_err() {
                                    return;
                                }
                            }
                            Err(broadcast::error::TryRecvError::Empty) => break,
                            Err(_) => return,
                        }
                    }
                    last = last.max(global);
                    if tx.send(bookmark(last, false)).await.is_err() {
                        return;
                    }
                }
            }
        }
    });
    // A partition cuts the open watch: the body ends in an error, so hyper drops the connection
    // (the client sees it broken, not a watch that ended).
    let stream = futures::stream::unfold((out, false), move |(mut out, cut)| {
        let inner = Arc::clone(&cut_check);
        let user = user.clone();
        async move {
            if cut {
                return None;
            }
            loop {
                tokio::select! {
                    b = out.recv() => return b.map(|b| (Ok(b), (out, false))),
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {
                        if inner.state.lock().expect("state lock").faults.is_partitioned(user.as_deref()) {
                            let e = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "partitioned from the API");
                            return Some((Err(e), (out, true)));
                        }
                    }
                }
            }
        }
    });
    Ok(Response::builder()
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(stream))
        .expect("valid response"))
}

/// While watches are stalled ([`super::faults::Faults::watches_stalled`]), waits without
/// delivering anything until the fault is lifted or the client leaves. True if it stalled: the
/// caller then ends the watch, so the client watches again from the last version it saw.
async fn stalled(inner: &Inner, tx: &mpsc::Sender<Bytes>) -> bool {
    let mut held = false;
    while inner.state.lock().expect("state lock").faults.watches_stalled {
        held = true;
        tokio::select! {
            _ = tx.closed() => return true,
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
    }
    held
}

async fn control(inner: Arc<Inner>, req: Request<hyper::body::Incoming>) -> Resp {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let body = axum::body::to_bytes(Body::new(req.into_body()), 1 << 20)
        .await
        .unwrap_or_default();
    let faults = || {
        json_response(
            200,
            &serde_json::to_value(&inner.state.lock().expect("state lock").faults).unwrap_or_default(),
        )
    };
    match (method, path.as_str()) {
        (Method::GET, "/emulator/faults") => faults(),
        (Method::DELETE, "/emulator/faults") => {
            inner.set_faults(Default::default());
            faults()
        }
        (Method::POST | Method::PUT, "/emulator/faults") => {
            let update: FaultsUpdate = match serde_json::from_slice(&body) {
                Ok(u) => u,
                Err(e) => return error_response(&ApiError::bad_request(format!("invalid faults: {e}"))),
            };
            inner.update_faults(update);
            faults()
        }
        (Method::POST, "/emulator/compact") => {
            inner.state.lock().expect("state lock").compact();
            json_response(200, &json!({"compacted": true}))
        }
        (Method::GET, "/emulator/answers") => {
            let answers = inner.answers.lock().expect("answers lock");
            json_response(200, &json!(&*answers))
        }
        (Method::GET, "/emulator/requests") => {
            let reqs = inner.state.lock().expect("state lock").requests.clone();
            json_response(200, &json!(reqs))
        }
        _ => error_response(&ApiError::no_route()),
    }
}
