//! Adversary round 15: the emulator's shared watch lines (`WatchFilter::line_for`, `send_line`).
//! Each watch must still get exactly the line the real API server would send it, however many
//! other watches (other selectors, namespaces, versions, Table output, events.k8s.io) share the
//! event. Every watch here starts from a resourceVersion before the changes, so all of them read
//! the same committed events (the backlog path and the live path both go through `send_line`).

mod common;

use std::time::Duration;

use common::*;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The event lines a watch at `path` (with `query`, from resourceVersion `rv`, 1 s long) sends.
async fn watch_lines(
    emu: &tartan_testkit::EmulatorHandle,
    path: &str,
    query: &str,
    rv: &str,
    table: bool,
) -> Vec<Value> {
    let mut s = tokio::net::TcpStream::connect(emu.addr()).await.unwrap();
    let accept = if table {
        "application/json;as=Table;v=v1;g=meta.k8s.io"
    } else {
        "application/json"
    };
    let sep = if query.is_empty() { "" } else { "&" };
    let req = format!(
        "GET {path}?watch=1&timeoutSeconds=1&resourceVersion={rv}{sep}{query} HTTP/1.1\r\nHost: x\r\nAccept: {accept}\r\n\
         Connection: close\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut out))
        .await
        .expect("watch ends")
        .unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    out.lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str::<Value>(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .filter(|ev| ev["type"] != "BOOKMARK")
        .collect()
}

fn summary(lines: &[Value]) -> Vec<String> {
    lines
        .iter()
        .map(|ev| {
            let o = &ev["object"];
            format!(
                "{} {} rv={} team={} t={}",
                ev["type"].as_str().unwrap_or_default(),
                o["metadata"]["name"].as_str().unwrap_or_default(),
                o["metadata"]["resourceVersion"].as_str().unwrap_or_default(),
                o["metadata"]["labels"]["team"].as_str().unwrap_or("-"),
                o["spec"]["timeoutSeconds"],
            )
        })
        .collect()
}

fn rv_of(o: &DynamicObject) -> String {
    o.metadata.resource_version.clone().unwrap()
}

/// Four watches on one object's life with different label selectors, a field selector, another
/// namespace and all namespaces, opened in an order that makes each reuse lines the others made
/// first: each gets its own event types, and the one the object leaves gets DELETED with the
/// last content it matched at the change's resourceVersion.
#[tokio::test]
async fn shared_lines_held_selectors_and_namespaces_each_get_their_own_line() {
    let emu = emulator().await;
    let client = emu.client();
    let ns: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    ns.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": "other"}})).unwrap(),
    )
    .await
    .unwrap();
    let api = macbuilds(&client, "default");
    let before = rv_of(
        &api.create(&PostParams::default(), &macbuild("marker", json!({"image": "x"})))
            .await
            .unwrap(),
    );
    let mut x = macbuild("x", json!({"image": "x", "timeoutSeconds": 1}));
    x.metadata.labels = Some([("team".to_string(), "a".to_string())].into());
    let r1 = rv_of(&api.create(&PostParams::default(), &x).await.unwrap());
    let label = |team: &str| Patch::Merge(json!({"metadata": {"labels": {"team": team}}}));
    let r2 = rv_of(&api.patch("x", &PatchParams::default(), &label("b")).await.unwrap());
    let r3 = rv_of(
        &api.patch(
            "x",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"timeoutSeconds": 3}})),
        )
        .await
        .unwrap(),
    );
    let r4 = rv_of(&api.patch("x", &PatchParams::default(), &label("a")).await.unwrap());
    api.delete("x", &DeleteParams::default()).await.unwrap();
    // The deletion's resourceVersion: the next write's minus one (read from a later object).
    let after = rv_of(
        &api.create(&PostParams::default(), &macbuild("after", json!({"image": "x"})))
            .await
            .unwrap(),
    );
    let r5 = (after.parse::<u64>().unwrap() - 1).to_string();

    let ns_path = "/apis/tartan.dev/v1alpha1/namespaces/default/macbuilds";
    let all_path = "/apis/tartan.dev/v1alpha1/macbuilds";
    let other_path = "/apis/tartan.dev/v1alpha1/namespaces/other/macbuilds";
    let not_marker = "fieldSelector=metadata.name%21%3Dmarker,metadata.name%21%3Dafter";
    // Order: team=b first (its ADDED/DELETED-LAST-MATCH lines are made first), then team=a, then
    // the unselected watches, then team=a again over all namespaces.
    let b = watch_lines(&emu, ns_path, "labelSelector=team%3Db", &before, false).await;
    let a = watch_lines(&emu, ns_path, "labelSelector=team%3Da", &before, false).await;
    let plain = watch_lines(&emu, ns_path, not_marker, &before, false).await;
    let by_name = watch_lines(&emu, all_path, "fieldSelector=metadata.name%3Dx", &before, false).await;
    let other = watch_lines(&emu, other_path, "", &before, false).await;
    let a_all = watch_lines(&emu, all_path, "labelSelector=team%3Da", &before, false).await;

    let full = vec![
        format!("ADDED x rv={r1} team=a t=1"),
        format!("MODIFIED x rv={r2} team=b t=1"),
        format!("MODIFIED x rv={r3} team=b t=3"),
        format!("MODIFIED x rv={r4} team=a t=3"),
        format!("DELETED x rv={r5} team=a t=3"),
    ];
    assert_eq!(summary(&plain), full);
    assert_eq!(summary(&by_name), full);
    let team_a = vec![
        format!("ADDED x rv={r1} team=a t=1"),
        // Left the selector: the last content it matched, at the change's resourceVersion.
        format!("DELETED x rv={r2} team=a t=1"),
        // Came back: ADDED with the content now.
        format!("ADDED x rv={r4} team=a t=3"),
        format!("DELETED x rv={r5} team=a t=3"),
    ];
    assert_eq!(summary(&a), team_a);
    assert_eq!(summary(&a_all), team_a);
    assert_eq!(
        summary(&b),
        vec![
            format!("ADDED x rv={r2} team=b t=1"),
            format!("MODIFIED x rv={r3} team=b t=3"),
            format!("DELETED x rv={r4} team=b t=3"),
        ]
    );
    assert!(other.is_empty(), "{other:?}");
    for ev in a.iter().chain(&b).chain(&plain) {
        assert_eq!(ev["object"]["apiVersion"], json!("tartan.dev/v1alpha1"));
        assert_eq!(ev["object"]["kind"], json!("MacBuild"));
    }
}

const WIDGET_CRD: &str = r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.adv.example
spec:
  group: adv.example
  scope: Namespaced
  names: {plural: widgets, singular: widget, kind: Widget}
  versions:
  - name: v1
    served: true
    storage: true
    selectableFields:
    - jsonPath: .spec.color
    schema:
      openAPIV3Schema:
        type: object
        x-kubernetes-preserve-unknown-fields: true
  - name: v2
    served: true
    storage: false
    schema:
      openAPIV3Schema:
        type: object
        x-kubernetes-preserve-unknown-fields: true
"#;

fn widgets(client: &kube::Client, version: &str) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("adv.example", version, "Widget"), "widgets");
    Api::namespaced_with(client.clone(), "default", &ar)
}

/// A multi-version CRD: watches of v1 (with a selectable field selector, and without) and v2 on
/// the same events, v1 read first so its lines exist when v2's watch reads: each line carries its
/// own watch's apiVersion, and the field selector's DELETED carries the last matching spec.
#[tokio::test]
async fn shared_lines_held_each_served_version_gets_its_own_api_version() {
    let emu = tartan_testkit::start(tartan_testkit::Options::default().crd_yaml(WIDGET_CRD))
        .await
        .expect("emulator starts");
    let client = emu.client();
    let v1 = widgets(&client, "v1");
    let v2 = widgets(&client, "v2");
    let w = |name: &str, color: &str, version: &str| -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": format!("adv.example/{version}"), "kind": "Widget",
            "metadata": {"name": name}, "spec": {"color": color}
        }))
        .unwrap()
    };
    let before = rv_of(
        &v1.create(&PostParams::default(), &w("marker", "none", "v1"))
            .await
            .unwrap(),
    );
    // Written through v2, then through v1.
    let r1 = rv_of(&v2.create(&PostParams::default(), &w("w", "red", "v2")).await.unwrap());
    let r2 = rv_of(
        &v1.patch(
            "w",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"color": "blue"}})),
        )
        .await
        .unwrap(),
    );
    let p1 = "/apis/adv.example/v1/namespaces/default/widgets";
    let p2 = "/apis/adv.example/v2/namespaces/default/widgets";
    let red = watch_lines(&emu, p1, "fieldSelector=spec.color%3Dred", &before, false).await;
    let all1 = watch_lines(&emu, p1, "fieldSelector=metadata.name%3Dw", &before, false).await;
    let all2 = watch_lines(&emu, p2, "fieldSelector=metadata.name%3Dw", &before, false).await;
    let shape = |lines: &[Value]| -> Vec<String> {
        lines
            .iter()
            .map(|ev| {
                let o = &ev["object"];
                format!(
                    "{} {} {} rv={} color={}",
                    ev["type"].as_str().unwrap(),
                    o["apiVersion"].as_str().unwrap(),
                    o["kind"].as_str().unwrap(),
                    o["metadata"]["resourceVersion"].as_str().unwrap(),
                    o["spec"]["color"].as_str().unwrap()
                )
            })
            .collect()
    };
    assert_eq!(
        shape(&red),
        vec![
            format!("ADDED adv.example/v1 Widget rv={r1} color=red"),
            format!("DELETED adv.example/v1 Widget rv={r2} color=red"),
        ]
    );
    assert_eq!(
        shape(&all1),
        vec![
            format!("ADDED adv.example/v1 Widget rv={r1} color=red"),
            format!("MODIFIED adv.example/v1 Widget rv={r2} color=blue"),
        ]
    );
    assert_eq!(
        shape(&all2),
        vec![
            format!("ADDED adv.example/v2 Widget rv={r1} color=red"),
            format!("MODIFIED adv.example/v2 Widget rv={r2} color=blue"),
        ]
    );
    // The v2 field selector on a field only v1 declares selectable is refused, as by the apiserver.
    let refused = v2
        .list(&kube::api::ListParams::default().fields("spec.color=red"))
        .await
        .unwrap_err();
    assert!(matches!(refused, kube::Error::Api(ref s) if s.code == 400), "{refused}");
}

/// A Table watch (`kubectl get -w`) and a plain watch of the same events, the plain one read
/// first: the Table watch gets one-row Tables (columnDefinitions on the first only), including
/// for the DELETED of an object leaving its selector; the plain one gets objects.
#[tokio::test]
async fn shared_lines_held_table_watches_never_get_the_shared_object_line() {
    let emu = emulator().await;
    let api = macbuilds(&emu.client(), "default");
    let before = rv_of(
        &api.create(&PostParams::default(), &macbuild("marker", json!({"image": "x"})))
            .await
            .unwrap(),
    );
    let mut t = macbuild("t", json!({"image": "x"}));
    t.metadata.labels = Some([("team".to_string(), "a".to_string())].into());
    api.create(&PostParams::default(), &t).await.unwrap();
    let r2 = rv_of(
        &api.patch(
            "t",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"team": "b"}}})),
        )
        .await
        .unwrap(),
    );
    let path = "/apis/tartan.dev/v1alpha1/namespaces/default/macbuilds";
    let plain = watch_lines(&emu, path, "labelSelector=team%3Da", &before, false).await;
    let table = watch_lines(&emu, path, "labelSelector=team%3Da", &before, true).await;
    let plain_again = watch_lines(&emu, path, "labelSelector=team%3Da", &before, false).await;
    assert_eq!(plain, plain_again, "the shared lines are stable");
    assert_eq!(
        plain.iter().map(|e| e["type"].clone()).collect::<Vec<_>>(),
        vec![json!("ADDED"), json!("DELETED")]
    );
    assert_eq!(plain[1]["object"]["kind"], json!("MacBuild"));
    assert_eq!(plain[1]["object"]["metadata"]["labels"]["team"], json!("a"));
    assert_eq!(table.len(), 2, "{table:?}");
    for (i, ev) in table.iter().enumerate() {
        assert_eq!(ev["object"]["kind"], json!("Table"), "{ev}");
        assert_eq!(ev["object"]["rows"][0]["cells"][0], json!("t"));
        assert_eq!(ev["object"].get("columnDefinitions").is_some(), i == 0, "{ev}");
    }
    assert_eq!(table[1]["type"], json!("DELETED"));
    let row_object = &table[1]["object"]["rows"][0]["object"];
    assert_eq!(row_object["metadata"]["resourceVersion"], json!(r2), "{row_object}");
}

/// Creates core Events `marker` (returns its resourceVersion) and `e1` (about `b1`), then moves
/// `e1` to be about `b2`.
async fn event_history(emu: &tartan_testkit::EmulatorHandle) -> String {
    use k8s_openapi::api::core::v1::Event;
    let core: Api<Event> = Api::namespaced(emu.client(), "default");
    let marker: Event = serde_json::from_value(json!({
        "metadata": {"name": "marker"}, "involvedObject": {"kind": "MacBuild", "name": "m", "namespace": "default"},
        "reason": "Marker", "message": "m", "type": "Normal"
    }))
    .unwrap();
    let before = core
        .create(&PostParams::default(), &marker)
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    let ev: Event = serde_json::from_value(json!({
        "metadata": {"name": "e1"}, "involvedObject": {"kind": "MacBuild", "name": "b1", "namespace": "default"},
        "reason": "Claimed", "message": "claimed by mac-1", "type": "Normal", "count": 1
    }))
    .unwrap();
    core.create(&PostParams::default(), &ev).await.unwrap();
    core.patch(
        "e1",
        &PatchParams::default(),
        &Patch::Merge(json!({"involvedObject": {"name": "b2"}, "count": 2})),
    )
    .await
    .unwrap();
    before
}

fn event_kinds(lines: &[Value]) -> Vec<String> {
    lines
        .iter()
        .map(|e| {
            format!(
                "{} {} {}",
                e["type"].as_str().unwrap(),
                e["object"]["apiVersion"].as_str().unwrap(),
                e["object"]["involvedObject"]["name"]
                    .as_str()
                    .or(e["object"]["regarding"]["name"].as_str())
                    .unwrap_or("?")
            )
        })
        .collect()
}

const CORE_EVENTS: &str = "/api/v1/namespaces/default/events";
const NEW_EVENTS: &str = "/apis/events.k8s.io/v1/namespaces/default/events";

/// Core `v1` Events and `events.k8s.io/v1` Events share storage: watches of both on the same
/// events (the core ones read first, making the shared lines) each get their own shape, and the
/// core watch the event leaves (its involvedObject changed) gets DELETED with the old content.
#[tokio::test]
async fn shared_lines_held_core_and_events_k8s_io_watches_get_their_own_shape() {
    let emu = emulator().await;
    let before = event_history(&emu).await;
    let c = watch_lines(
        &emu,
        CORE_EVENTS,
        "fieldSelector=involvedObject.name%3Db1",
        &before,
        false,
    )
    .await;
    let c_all = watch_lines(&emu, CORE_EVENTS, "fieldSelector=metadata.name%3De1", &before, false).await;
    let n_all = watch_lines(&emu, NEW_EVENTS, "fieldSelector=metadata.name%3De1", &before, false).await;
    let c_again = watch_lines(&emu, CORE_EVENTS, "fieldSelector=metadata.name%3De1", &before, false).await;
    assert_eq!(event_kinds(&c), vec!["ADDED v1 b1", "DELETED v1 b1"]);
    assert_eq!(event_kinds(&c_all), vec!["ADDED v1 b1", "MODIFIED v1 b2"]);
    assert_eq!(c_all, c_again);
    assert_eq!(
        event_kinds(&n_all),
        vec!["ADDED events.k8s.io/v1 b1", "MODIFIED events.k8s.io/v1 b2"]
    );
    for e in &n_all {
        assert!(e["object"].get("involvedObject").is_none(), "{e}");
        assert_eq!(
            e["object"]["note"].as_str().map(|s| s.starts_with("claimed")),
            Some(true),
            "{e}"
        );
    }
    for e in c.iter().chain(&c_all) {
        assert!(e["object"].get("regarding").is_none(), "{e}");
    }
}

/// FINDING (pre-existing, not from the shared lines: `line_for` sends events.k8s.io through
/// `translate` as before). Steps: create a core Event about `b1`; watch (or list)
/// `/apis/events.k8s.io/v1/namespaces/default/events?fieldSelector=involvedObject.name=b1`.
/// The emulator accepts the selector (events.k8s.io's `selectable` are the core field names) but
/// matches it against the served events.k8s.io object, which has `regarding`, not
/// `involvedObject`: the watch is silently empty, and `regarding.name` is refused as
/// "field label not supported". The apiserver converts events.k8s.io field labels
/// (`regarding.name` → `involvedObject.name`, …) and so either refuses a name or matches it.
/// Impact: a test that watches events.k8s.io Events by the object they regard sees none (it
/// would pass vacuously on "no event"), or cannot be written. Fix: give events.k8s.io its own
/// selectable names (`regarding.*`, `reportingController`, `type`, `reason`, metadata.*) and match
/// them against the served shape, or map them to the stored core names and match the stored
/// object.
#[tokio::test]
#[ignore = "FINDING adversary 15: events.k8s.io field selectors accept core names that never match the served shape and refuse regarding.*"]
async fn finding_events_k8s_io_field_selector_on_the_regarded_object_never_matches() {
    let emu = emulator().await;
    let before = event_history(&emu).await;
    let core_name = watch_lines_or_status(&emu, NEW_EVENTS, "fieldSelector=involvedObject.name%3Db1", &before).await;
    let regarding = watch_lines_or_status(&emu, NEW_EVENTS, "fieldSelector=regarding.name%3Db1", &before).await;
    let want = vec!["ADDED events.k8s.io/v1 b1", "DELETED events.k8s.io/v1 b1"];
    // Either spelling the server accepts must select the event about b1.
    for (spelling, got) in [("involvedObject.name", &core_name), ("regarding.name", &regarding)] {
        if let Ok(lines) = got {
            assert_eq!(event_kinds(lines), want, "{spelling}");
        }
    }
    assert!(regarding.is_ok(), "regarding.name refused: {regarding:?}");
}

/// As [`watch_lines`] without a Table, but a refused watch is `Err(status line)`.
async fn watch_lines_or_status(
    emu: &tartan_testkit::EmulatorHandle,
    path: &str,
    query: &str,
    rv: &str,
) -> Result<Vec<Value>, String> {
    let mut s = tokio::net::TcpStream::connect(emu.addr()).await.unwrap();
    let req = format!(
        "GET {path}?watch=1&timeoutSeconds=1&resourceVersion={rv}&{query} HTTP/1.1\r\nHost: x\r\n\
         Accept: application/json\r\nConnection: close\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut out))
        .await
        .expect("watch ends")
        .unwrap();
    if !out.starts_with("HTTP/1.1 200") {
        return Err(out.lines().next().unwrap_or_default().to_string());
    }
    Ok(out
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|ev| ev["type"] != "BOOKMARK")
        .collect())
}

/// The live path (watches open before the changes, fed by the broadcast rather than the
/// backlog): two selectors on the same object leaving one and entering the other, read
/// concurrently, each get their own event with their own content.
#[tokio::test]
async fn shared_lines_held_live_watches_with_opposite_selectors() {
    use futures::StreamExt;
    use kube::api::{WatchEvent, WatchParams};
    let emu = emulator().await;
    let api = macbuilds(&emu.client(), "default");
    let mut x = macbuild("x", json!({"image": "x", "timeoutSeconds": 1}));
    x.metadata.labels = Some([("team".to_string(), "a".to_string())].into());
    let r1 = rv_of(&api.create(&PostParams::default(), &x).await.unwrap());
    let mut a = api
        .watch(&WatchParams::default().labels("team=a"), &r1)
        .await
        .unwrap()
        .boxed();
    let mut b = api
        .watch(&WatchParams::default().labels("team=b"), &r1)
        .await
        .unwrap()
        .boxed();
    let r2 = rv_of(
        &api.patch(
            "x",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"team": "b"}}, "spec": {"timeoutSeconds": 2}})),
        )
        .await
        .unwrap(),
    );
    let next = async |s: &mut (dyn futures::Stream<Item = kube::Result<WatchEvent<DynamicObject>>> + Unpin + Send)| loop {
        let ev = tokio::time::timeout(Duration::from_secs(10), s.next())
            .await
            .expect("an event")
            .expect("open")
            .expect("decodes");
        if !matches!(ev, WatchEvent::Bookmark(_)) {
            return ev;
        }
    };
    match next(&mut a).await {
        WatchEvent::Deleted(o) => {
            assert_eq!(rv_of(&o), r2);
            assert_eq!(o.metadata.labels.unwrap()["team"], "a");
            assert_eq!(o.data["spec"]["timeoutSeconds"], json!(1));
        }
        other => panic!("team=a got {other:?}"),
    }
    match next(&mut b).await {
        WatchEvent::Added(o) => {
            assert_eq!(rv_of(&o), r2);
            assert_eq!(o.metadata.labels.unwrap()["team"], "b");
            assert_eq!(o.data["spec"]["timeoutSeconds"], json!(2));
        }
        other => panic!("team=b got {other:?}"),
    }
}
