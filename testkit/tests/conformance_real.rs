//! The emulator against the referee: one request sequence replayed on the emulator and on a real
//! kube-apiserver (from `KUBEBUILDER_ASSETS` or an existing cluster, see `tartan_testkit::real`), comparing what a client can
//! observe: status codes and Status reasons, resourceVersion behaviour (changes on write, 409 on
//! a stale update, a failed JSON-patch `test`), the status subresource, pruning, finalizers and
//! deletionTimestamp, watch events, list-map keys, and the Table `kubectl get mb` asks for.
//!
//! Normalised away: uids, timestamps, resourceVersion values (only whether they changed is
//! compared), managedFields, condition messages. Status messages are compared word for word. Skips visibly without a real control plane.

use std::path::{Path, PathBuf};

use hyper::{Method, Request};
use serde_json::{Value, json};
use tartan_testkit::RealCluster;

const NS: &str = "conformance";
const MB: &str = "/apis/tartan.dev/v1alpha1/namespaces/conformance/macbuilds";
const TABLE: &str = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json";

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn tekton_crd() -> PathBuf {
    tartan_testkit::customrun_crd()
}

/// One HTTP exchange: code and JSON body.
async fn send(
    client: &kube::Client,
    method: Method,
    path: &str,
    body: Option<(&str, Value)>,
    accept: &str,
) -> (u16, Value) {
    let mut req = Request::builder()
        .method(method.clone())
        .uri(path)
        .header("Accept", accept);
    let bytes = match body {
        Some((content_type, v)) => {
            req = req.header("Content-Type", content_type);
            serde_json::to_vec(&v).unwrap()
        }
        None => vec![],
    };
    let resp = client
        .send(req.body(kube::client::Body::from(bytes)).unwrap())
        .await
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    let code = resp.status().as_u16();
    let bytes = resp.into_body().collect_bytes().await.unwrap();
    let text = String::from_utf8_lossy(&bytes);
    // A watch answers with one JSON document per line.
    let value = serde_json::from_slice(&bytes).unwrap_or_else(|_| {
        Value::Array(
            text.lines()
                .filter(|l| !l.trim().is_empty())
                .map(|l| serde_json::from_str(l).unwrap())
                .collect(),
        )
    });
    (code, value)
}

fn rv(v: &Value) -> String {
    v.pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string()
}

/// What may legitimately differ, replaced by placeholders; what remains is compared.
fn normalise(v: &Value) -> Value {
    match v {
        Value::Object(m) => {
            let mut out = serde_json::Map::new();
            for (k, x) in m {
                let x = match k.as_str() {
                    "uid" | "creationTimestamp" | "deletionTimestamp" | "resourceVersion" | "eventTime"
                    | "lastTransitionTime" => json!("<set>"),
                    "managedFields" | "selfLink" => continue,
                    "message" if m.contains_key("reason") => json!("<message>"),
                    _ => normalise(x),
                };
                out.insert(k.clone(), x);
            }
            Value::Object(out)
        }
        Value::Array(a) => Value::Array(a.iter().map(normalise).collect()),
        other => other.clone(),
    }
}

/// A Status: code, reason and the causes' (type, field), which a client acts on.
fn status_view(code: u16, v: &Value) -> Value {
    let mut causes: Vec<Value> = v
        .pointer("/details/causes")
        .and_then(Value::as_array)
        .map(|a| a.iter().map(|c| json!([c["reason"], c["field"]])).collect())
        .unwrap_or_default();
    causes.sort_by_key(|c| c.to_string());
    // v1.24 reports a forbidden new finalizer twice (the generic registry and the custom resource
    // strategy both validate metadata); a client sees the same cause either way.
    causes.dedup();
    // Resource versions in messages are the backend's own numbers.
    let digits = regex::Regex::new(r"\d+").unwrap();
    // How a duplicate list item is printed changed after v1.24 (Go's `map[string]interface {}{...}`
    // became JSON); which item is named is still compared through the cause's field.
    let duplicate = regex::Regex::new(r"Duplicate value: .*$").unwrap();
    let message = v["message"].as_str().map(|m| {
        let m = digits.replace_all(m, "N");
        duplicate.replace_all(&m, "Duplicate value: (the item)").into_owned()
    });
    json!({"code": code, "message": message, "kind": v["kind"], "reason": v["reason"], "details.kind": v.pointer("/details/kind"),
           "details.name": v.pointer("/details/name"), "causes": causes})
}

fn macbuild(name: &str, spec: Value) -> Value {
    json!({"apiVersion": "tartan.dev/v1alpha1", "kind": "MacBuild", "metadata": {"name": name}, "spec": spec})
}

/// The sequence; each step's observation, named.
/// The events (bookmarks left out) of a watch at `url` that ends by its `timeoutSeconds`, each
/// shown by `show`.
async fn watch_events(client: &kube::Client, url: &str, show: impl Fn(&Value) -> Value) -> (u16, Vec<Value>) {
    let (code, events) = send(client, Method::GET, url, None, "application/json").await;
    let seen = events
        .as_array()
        .map(|a| a.iter().filter(|e| e["type"] != "BOOKMARK").map(&show).collect())
        .unwrap_or_default();
    (code, seen)
}

async fn replay(client: &kube::Client) -> Vec<(&'static str, Value)> {
    use Method as M;
    let mut out: Vec<(&'static str, Value)> = Vec::new();
    let json_ct = "application/json";
    let merge = "application/merge-patch+json";
    let jpatch = "application/json-patch+json";
    let (code, _) = send(
        client,
        M::POST,
        "/api/v1/namespaces",
        Some((json_ct, json!({"metadata": {"name": NS}}))),
        json_ct,
    )
    .await;
    assert_eq!(code, 201, "creating namespace {NS}");
    let (_, list) = send(client, M::GET, MB, None, json_ct).await;
    let start_rv = rv(&list);

    // Create: defaults, pruning of unknown fields (spec and metadata-level), finalizers kept.
    let mut obj = macbuild(
        "m1",
        json!({"image": "sequoia", "steps": [{"name": "build", "run": ["make"]}], "bogus": 1}),
    );
    obj["metadata"]["finalizers"] = json!(["example.com/keep"]);
    obj["status"] = json!({"phase": "Running"});
    obj["extra"] = json!("top-level unknown");
    let (code, created) = send(client, M::POST, MB, Some((json_ct, obj.clone())), json_ct).await;
    out.push((
        "create: 201, pruned, defaulted, status dropped",
        json!([code, normalise(&created)]),
    ));
    let rv1 = rv(&created);

    let (code, dup) = send(client, M::POST, MB, Some((json_ct, obj)), json_ct).await;
    out.push(("create again: AlreadyExists", status_view(code, &dup)));

    // Status subresource: spec changes ignored, status written, generation unchanged.
    let mut s = created.clone();
    s["spec"]["image"] = json!("changed-through-status");
    s["status"] = json!({"phase": "Pending"});
    s["metadata"]["labels"] = json!({"through": "status"});
    let (code, st) = send(client, M::PUT, &format!("{MB}/m1/status"), Some((json_ct, s)), json_ct).await;
    let rv2 = rv(&st);
    out.push((
        "PUT status: spec and labels ignored",
        json!([code, normalise(&st), rv2 != rv1]),
    ));

    // Main resource: status ignored, spec written, generation +1.
    let p = json!({"spec": {"cancelRequested": true}, "status": {"phase": "Failed"}});
    let (code, main) = send(client, M::PATCH, &format!("{MB}/m1"), Some((merge, p)), json_ct).await;
    let rv3 = rv(&main);
    out.push((
        "merge patch main: status ignored",
        json!([code, normalise(&main), rv3 != rv2]),
    ));

    // A no-op write keeps the resourceVersion.
    let (code, same) = send(
        client,
        M::PATCH,
        &format!("{MB}/m1"),
        Some((merge, json!({"spec": {"cancelRequested": true}}))),
        json_ct,
    )
    .await;
    out.push(("no-op patch: rv unchanged", json!([code, rv(&same) == rv3])));

    // A stale update.
    let mut stale = created.clone();
    stale["spec"]["image"] = json!("stale");
    let (code, conflict) = send(client, M::PUT, &format!("{MB}/m1"), Some((json_ct, stale)), json_ct).await;
    out.push(("stale PUT: Conflict", status_view(code, &conflict)));

    // A JSON patch whose `test` fails, and one with a stale resourceVersion test.
    let p = json!([{"op": "test", "path": "/spec/image", "value": "nope"}, {"op": "replace", "path": "/spec/image", "value": "x"}]);
    let (code, failed) = send(client, M::PATCH, &format!("{MB}/m1"), Some((jpatch, p)), json_ct).await;
    out.push(("json patch test fails", status_view(code, &failed)));
    let p = json!([{"op": "test", "path": "/metadata/resourceVersion", "value": rv1}, {"op": "replace", "path": "/status/phase", "value": "Running"}]);
    let (code, failed) = send(client, M::PATCH, &format!("{MB}/m1/status"), Some((jpatch, p)), json_ct).await;
    out.push(("json patch rv test fails on status", status_view(code, &failed)));
    let p = json!([{"op": "replace", "path": "/metadata/resourceVersion", "value": rv1}, {"op": "replace", "path": "/status/phase", "value": "Running"}]);
    let (code, failed) = send(client, M::PATCH, &format!("{MB}/m1/status"), Some((jpatch, p)), json_ct).await;
    out.push(("json patch with stale rv: Conflict", status_view(code, &failed)));

    // Validation: duplicate list-map keys, a missing required field, an enum.
    let dup_steps = macbuild(
        "m2",
        json!({"image": "x", "steps": [{"name": "a", "run": ["x"]}, {"name": "a", "run": ["y"]}]}),
    );
    let (code, invalid) = send(client, M::POST, MB, Some((json_ct, dup_steps)), json_ct).await;
    out.push(("duplicate step names: Invalid", status_view(code, &invalid)));
    let (code, invalid) = send(
        client,
        M::POST,
        MB,
        Some((json_ct, macbuild("m3", json!({"image": "x"})))),
        json_ct,
    )
    .await;
    out.push(("missing steps: Invalid", status_view(code, &invalid)));
    let p = json!({"status": {"phase": "Sleeping"}});
    let (code, invalid) = send(client, M::PATCH, &format!("{MB}/m1/status"), Some((merge, p)), json_ct).await;
    out.push(("bad enum in status: Invalid", status_view(code, &invalid)));

    // kubectl get mb (-o wide asks the same Table).
    let (code, table) = send(client, M::GET, MB, None, TABLE).await;
    let columns: Vec<Value> = table["columnDefinitions"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|c| json!([c["name"], c["type"], c["format"], c["priority"]]))
                .collect()
        })
        .unwrap_or_default();
    let cells: Vec<Value> = table["rows"]
        .as_array()
        .map(|rows| {
            rows.iter()
                .map(|r| json!(r["cells"].as_array().map(|c| c[..c.len().saturating_sub(2)].to_vec())))
                .collect()
        })
        .unwrap_or_default();
    out.push((
        "Table: columns and cells",
        json!([code, table["kind"], table["apiVersion"], columns, cells]),
    ));
    let (code, one) = send(client, M::GET, &format!("{MB}/m1"), None, TABLE).await;
    out.push((
        "Table of one object",
        json!([code, one["kind"], one["rows"].as_array().map(Vec::len)]),
    ));
    let row_object = &table["rows"][0]["object"];
    out.push((
        "Table rows carry partial metadata",
        json!([
            row_object["kind"],
            row_object["apiVersion"],
            table["metadata"]["resourceVersion"].is_string()
        ]),
    ));
    let (code, watched) = send(
        client,
        M::GET,
        &format!("{MB}?watch=true&resourceVersion={start_rv}&timeoutSeconds=1"),
        None,
        TABLE,
    )
    .await;
    let shapes: Vec<Value> = watched
        .as_array()
        .map(|a| {
            a.iter()
                .map(|e| {
                    json!([
                        e["type"],
                        e["object"]["kind"],
                        e["object"]["columnDefinitions"].as_array().map(Vec::len),
                        e["object"]["rows"].as_array().map(Vec::len)
                    ])
                })
                .collect()
        })
        .unwrap_or_default();
    out.push(("kubectl get -w: Table events", json!([code, shapes])));

    // Lists: kind, paging.
    let (code, _) = send(
        client,
        M::POST,
        MB,
        Some((
            json_ct,
            macbuild("m5", json!({"image": "x", "steps": [{"name": "a", "run": ["x"]}]})),
        )),
        json_ct,
    )
    .await;
    assert_eq!(code, 201);
    let (code, page) = send(client, M::GET, &format!("{MB}?limit=1"), None, json_ct).await;
    out.push((
        "list with limit",
        json!([
            code,
            page["kind"],
            page["apiVersion"],
            page["items"].as_array().map(Vec::len),
            page["metadata"]["continue"].is_string(),
            page["metadata"]["remainingItemCount"]
        ]),
    ));
    // At resourceVersion=0 (kube's `any_semantic()` watcher lists) the watch cache answers,
    // ignoring `limit`: every item in one response, no continue token.
    for (step, query) in [
        ("list with limit at resourceVersion=0", "limit=1&resourceVersion=0"),
        (
            "list with limit at resourceVersion=0, NotOlderThan",
            "limit=1&resourceVersion=0&resourceVersionMatch=NotOlderThan",
        ),
    ] {
        let (code, page) = send(client, M::GET, &format!("{MB}?{query}"), None, json_ct).await;
        out.push((
            step,
            json!([
                code,
                page["items"].as_array().map(Vec::len),
                // A client pages on while this is non-empty (v1.24 sends "" on every custom
                // resource list; the emulator leaves it out).
                page["metadata"]["continue"].as_str().is_some_and(|c| !c.is_empty()),
                page["metadata"]["remainingItemCount"]
            ]),
        ));
    }
    // A delete with a stale resourceVersion precondition.
    let pre = json!({"kind": "DeleteOptions", "apiVersion": "v1", "preconditions": {"resourceVersion": rv1}});
    let (code, conflict) = send(client, M::DELETE, &format!("{MB}/m5"), Some((json_ct, pre)), json_ct).await;
    out.push(("delete with stale precondition: Conflict", status_view(code, &conflict)));
    let (code, _) = send(client, M::DELETE, &format!("{MB}/m5"), None, json_ct).await;
    assert_eq!(code, 200);

    // Delete with a finalizer: kept with a deletionTimestamp, then gone once it is removed.
    let (code, deleting) = send(client, M::DELETE, &format!("{MB}/m1"), None, json_ct).await;
    out.push((
        "delete with finalizer: 200, object with deletionTimestamp",
        json!([
            code,
            deleting["kind"],
            deleting.pointer("/metadata/deletionTimestamp").is_some(),
            deleting.pointer("/metadata/generation")
        ]),
    ));
    let p = json!({"metadata": {"finalizers": ["example.com/keep", "example.com/new"]}});
    let (code, refused) = send(client, M::PATCH, &format!("{MB}/m1"), Some((merge, p)), json_ct).await;
    out.push(("no new finalizer while deleting", status_view(code, &refused)));
    let p = json!({"metadata": {"finalizers": null}});
    let (code, gone) = send(client, M::PATCH, &format!("{MB}/m1"), Some((merge, p)), json_ct).await;
    out.push((
        "finalizer removed: 200 with the last state",
        json!([
            code,
            gone["kind"],
            gone.pointer("/metadata/deletionTimestamp").is_some()
        ]),
    ));
    let (code, missing) = send(client, M::GET, &format!("{MB}/m1"), None, json_ct).await;
    out.push(("get after delete: NotFound", status_view(code, &missing)));
    let (code, missing) = send(client, M::DELETE, &format!("{MB}/m1"), None, json_ct).await;
    out.push(("delete again: NotFound", status_view(code, &missing)));

    // A plain delete answers with a Status.
    let (code, _) = send(
        client,
        M::POST,
        MB,
        Some((
            json_ct,
            macbuild("m4", json!({"image": "x", "steps": [{"name": "a", "run": ["x"]}]})),
        )),
        json_ct,
    )
    .await;
    assert_eq!(code, 201);
    let (code, deleted) = send(client, M::DELETE, &format!("{MB}/m4"), None, json_ct).await;
    out.push((
        "plain delete: Status Success",
        json!([
            code,
            deleted["kind"],
            deleted["status"],
            deleted["details"]["name"],
            deleted["details"]["kind"],
            deleted["details"]["group"]
        ]),
    ));

    // A label added by a JSON patch fenced on the uid, and what a selector that excludes it
    // sees (the controller's `tartan.dev/finished`): a list from the watch cache leaves the
    // object out, a watch from before the label sees it DELETED.
    let mut labelled = macbuild("m6", json!({"image": "x", "steps": [{"name": "a", "run": ["x"]}]}));
    labelled["metadata"]["labels"] = json!({"a": "b"});
    let (code, m6) = send(client, M::POST, MB, Some((json_ct, labelled)), json_ct).await;
    assert_eq!(code, 201);
    let rv6 = rv(&m6);
    let uid6 = m6["metadata"]["uid"].clone();
    let add = |uid: Value, path: &str, value: Value| json!([{"op": "test", "path": "/metadata/uid", "value": uid}, {"op": "add", "path": path, "value": value}]);
    let p = add(
        json!("not-its-uid"),
        "/metadata/labels/tartan.dev~1finished",
        json!("true"),
    );
    let (code, failed) = send(client, M::PATCH, &format!("{MB}/m6"), Some((jpatch, p)), json_ct).await;
    out.push(("json patch uid test fails", status_view(code, &failed)));
    let p = add(uid6, "/metadata/labels/tartan.dev~1finished", json!("true"));
    let (code, done) = send(client, M::PATCH, &format!("{MB}/m6"), Some((jpatch, p)), json_ct).await;
    out.push(("label added on the uid", json!([code, done["metadata"]["labels"]])));
    let unlabelled = macbuild("m7", json!({"image": "x", "steps": [{"name": "a", "run": ["x"]}]}));
    let (code, m7) = send(client, M::POST, MB, Some((json_ct, unlabelled)), json_ct).await;
    assert_eq!(code, 201);
    let p = add(
        m7["metadata"]["uid"].clone(),
        "/metadata/labels/tartan.dev~1finished",
        json!("true"),
    );
    let (code, failed) = send(client, M::PATCH, &format!("{MB}/m7"), Some((jpatch, p)), json_ct).await;
    out.push(("json patch add into no labels map", status_view(code, &failed)));
    let unfinished = "labelSelector=%21tartan.dev%2Ffinished";
    let names = |list: &Value| -> Value {
        json!(
            list["items"]
                .as_array()
                .map(|a| a.iter().map(|i| i["metadata"]["name"].clone()).collect::<Vec<_>>())
        )
    };
    let (code, list) = send(
        client,
        M::GET,
        &format!("{MB}?{unfinished}&resourceVersion=0"),
        None,
        json_ct,
    )
    .await;
    out.push(("list !finished from the watch cache", json!([code, names(&list)])));
    let (code, list) = send(client, M::GET, &format!("{MB}?{unfinished}&limit=500"), None, json_ct).await;
    out.push(("list !finished, paged", json!([code, names(&list)])));
    let url = format!("{MB}?watch=true&{unfinished}&resourceVersion={rv6}&timeoutSeconds=1");
    let (code, seen) = watch_events(client, &url, |e| {
        let at = e["object"]["metadata"]["resourceVersion"].as_str().unwrap_or_default();
        json!([
            e["type"],
            e["object"]["metadata"]["name"],
            e["object"]["metadata"]["labels"],
            at == rv(&done)
        ])
    })
    .await;
    out.push(("watch !finished: the labelled object leaves", json!([code, seen])));

    // The watch from before the first write: every change, in order.
    let url = format!("{MB}?watch=true&resourceVersion={start_rv}&timeoutSeconds=1");
    let (code, seen) = watch_events(client, &url, |e| {
        json!([
            e["type"],
            e["object"]["metadata"]["name"],
            e["object"].pointer("/status/phase"),
            e["object"].pointer("/metadata/deletionTimestamp").is_some()
        ])
    })
    .await;
    out.push(("watch events", json!([code, seen])));
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emulator_and_real_apiserver_answer_alike() {
    let Some(cluster) = RealCluster::start("conformance_real").expect("the real cluster starts") else {
        return;
    };
    let crd = workspace().join("deploy/crd.yaml");
    for f in [&crd, &tekton_crd()] {
        cluster.kubectl(&["apply", "-f", f.to_str().unwrap()], None).unwrap();
    }
    cluster
        .kubectl(
            &[
                "wait",
                "--for=condition=Established",
                "--timeout=60s",
                "crd/macbuilds.tartan.dev",
            ],
            None,
        )
        .unwrap();
    let real = replay(&cluster.admin_client().await.unwrap()).await;

    let emu = tartan_testkit::start(tartan_testkit::Options::default().crd_file(&crd).crd_file(tekton_crd()))
        .await
        .unwrap();
    let emulated = replay(&emu.client()).await;

    let mut diffs = Vec::new();
    for ((step, r), (_, e)) in real.iter().zip(&emulated) {
        if r != e {
            diffs.push(format!("{step}:\n  real:     {r}\n  emulator: {e}"));
        }
    }
    for (step, r) in &real {
        println!("{step}: {r}");
    }
    println!("{} steps compared", real.len());
    assert!(
        diffs.is_empty(),
        "the emulator differs from kube-apiserver:\n{}",
        diffs.join("\n")
    );
}
