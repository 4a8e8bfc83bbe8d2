//! Watch semantics: initial events, resume from a resourceVersion, bookmarks, selectors, 410 Gone,
//! and `kube::runtime::watcher` / `Controller` running unchanged against the emulator.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use futures::{StreamExt, TryStreamExt};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::json;

async fn next_event<S>(stream: &mut S) -> WatchEvent<kube::api::DynamicObject>
where
    S: futures::Stream<Item = kube::Result<WatchEvent<kube::api::DynamicObject>>> + Unpin,
{
    tokio::time::timeout(Duration::from_secs(10), stream.next())
        .await
        .expect("a watch event within 10s")
        .expect("stream open")
        .expect("event decodes")
}

fn describe(e: &WatchEvent<kube::api::DynamicObject>) -> String {
    match e {
        WatchEvent::Added(o) => format!("ADDED {}", o.metadata.name.clone().unwrap()),
        WatchEvent::Modified(o) => format!("MODIFIED {}", o.metadata.name.clone().unwrap()),
        WatchEvent::Deleted(o) => format!("DELETED {}", o.metadata.name.clone().unwrap()),
        WatchEvent::Bookmark(_) => "BOOKMARK".into(),
        WatchEvent::Error(e) => format!("ERROR {}", e.code),
    }
}

#[tokio::test]
async fn watch_from_zero_and_from_version_with_selectors() {
    let emu = emulator().await;
    let api = macbuilds(&emu.client(), "default");
    api.create(&PostParams::default(), &macbuild("pre", json!({"image": "x"})))
        .await
        .unwrap();

    // rv "0": the current state as ADDED, then changes.
    let mut w = api.watch(&WatchParams::default(), "0").await.unwrap().boxed();
    assert_eq!(describe(&next_event(&mut w).await), "ADDED pre");
    let created = api
        .create(&PostParams::default(), &macbuild("live", json!({"image": "x"})))
        .await
        .unwrap();
    assert_eq!(describe(&next_event(&mut w).await), "ADDED live");

    // From a resourceVersion: only what came after it, in order.
    let rv = created.metadata.resource_version.unwrap();
    api.patch(
        "live",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"timeoutSeconds": 3}})),
    )
    .await
    .unwrap();
    api.delete("pre", &DeleteParams::default()).await.unwrap();
    let mut resumed = api.watch(&WatchParams::default(), &rv).await.unwrap().boxed();
    assert_eq!(describe(&next_event(&mut resumed).await), "MODIFIED live");
    let deleted = next_event(&mut resumed).await;
    assert_eq!(describe(&deleted), "DELETED pre");
    if let WatchEvent::Deleted(o) = deleted {
        let drv: u64 = o.metadata.resource_version.unwrap().parse().unwrap();
        assert!(
            drv > rv.parse::<u64>().unwrap(),
            "a DELETED event carries the deletion's resourceVersion"
        );
    }
    assert_eq!(describe(&next_event(&mut w).await), "MODIFIED live");
    assert_eq!(describe(&next_event(&mut w).await), "DELETED pre");

    // Label selector transitions: entering the selection is ADDED, leaving it is DELETED.
    let mut sel = api
        .watch(&WatchParams::default().labels("claimed=yes"), "0")
        .await
        .unwrap()
        .boxed();
    api.patch(
        "live",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"claimed": "yes"}}})),
    )
    .await
    .unwrap();
    assert_eq!(describe(&next_event(&mut sel).await), "ADDED live");
    // The same change, to a watch without the selector: its own line, not the one shared above.
    assert_eq!(describe(&next_event(&mut w).await), "MODIFIED live");
    api.patch(
        "live",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"claimed": "no"}}})),
    )
    .await
    .unwrap();
    assert_eq!(describe(&next_event(&mut sel).await), "DELETED live");
    assert_eq!(describe(&next_event(&mut w).await), "MODIFIED live");

    // Field selector on a single object.
    api.create(&PostParams::default(), &macbuild("other", json!({"image": "x"})))
        .await
        .unwrap();
    let mut one = api
        .watch(&WatchParams::default().fields("metadata.name=other"), "0")
        .await
        .unwrap()
        .boxed();
    assert_eq!(describe(&next_event(&mut one).await), "ADDED other");
    api.patch(
        "live",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"timeoutSeconds": 4}})),
    )
    .await
    .unwrap();
    api.patch(
        "other",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"timeoutSeconds": 4}})),
    )
    .await
    .unwrap();
    assert_eq!(describe(&next_event(&mut one).await), "MODIFIED other");
}

#[tokio::test]
async fn bookmarks_and_timeout() {
    let emu = emulator_with(tartan_testkit::Options::default().bookmark_interval(Duration::from_millis(100))).await;
    let api = macbuilds(&emu.client(), "default");
    let rv = emu.resource_version().to_string();
    let mut w = api
        .watch(&WatchParams::default().timeout(2), &rv)
        .await
        .unwrap()
        .boxed();
    // A write to another resource still advances the bookmark's resourceVersion.
    let leases: kube::Api<k8s_openapi::api::coordination::v1::Lease> = kube::Api::default_namespaced(emu.client());
    leases
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "l"}})).unwrap(),
        )
        .await
        .unwrap();
    let after = emu.resource_version();
    let bookmark_rv = loop {
        if let WatchEvent::Bookmark(b) = next_event(&mut w).await {
            let brv: u64 = b.metadata.resource_version.parse().unwrap();
            if brv >= after {
                break brv;
            }
        }
    };
    assert_eq!(bookmark_rv, after);
    // timeoutSeconds=2 ends the stream.
    let ended = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(e) = w.next().await {
            e.unwrap();
        }
    })
    .await;
    assert!(ended.is_ok(), "the watch ends after timeoutSeconds");
    // Without allowWatchBookmarks there are none.
    let mut quiet = api
        .watch(
            &WatchParams::default().disable_bookmarks().timeout(1),
            &emu.resource_version().to_string(),
        )
        .await
        .unwrap()
        .boxed();
    let got = tokio::time::timeout(Duration::from_secs(5), quiet.next())
        .await
        .expect("stream ends within its timeout");
    assert!(
        got.is_none(),
        "no events and no bookmarks: {:?}",
        got.map(|r| r.map(|e| describe(&e)))
    );
}

#[tokio::test]
async fn too_old_resource_version_is_410_expired() {
    let emu = emulator_with(tartan_testkit::Options::default().history_limit(5)).await;
    let api = macbuilds(&emu.client(), "default");
    let start = emu.resource_version().to_string();
    for i in 0..10 {
        api.create(
            &PostParams::default(),
            &macbuild(&format!("m{i}"), json!({"image": "x"})),
        )
        .await
        .unwrap();
    }
    let mut w = api.watch(&WatchParams::default(), &start).await.unwrap().boxed();
    match next_event(&mut w).await {
        WatchEvent::Error(e) => {
            assert_eq!((e.code, e.reason.as_str()), (410, "Expired"));
            assert!(
                e.message.starts_with(&format!("too old resource version: {start} (")),
                "{}",
                e.message
            );
        }
        other => panic!("expected 410, got {}", describe(&other)),
    }
    // A recent version still works; explicit compaction expires it.
    let recent = emu.resource_version().to_string();
    emu.compact();
    api.create(&PostParams::default(), &macbuild("after", json!({"image": "x"})))
        .await
        .unwrap();
    let mut w = api
        .watch(
            &WatchParams::default(),
            &(recent.parse::<u64>().unwrap() - 1).to_string(),
        )
        .await
        .unwrap()
        .boxed();
    assert!(matches!(next_event(&mut w).await, WatchEvent::Error(e) if e.code == 410));
    let mut ok = api.watch(&WatchParams::default(), &recent).await.unwrap().boxed();
    assert_eq!(describe(&next_event(&mut ok).await), "ADDED after");
}

#[tokio::test]
async fn kube_runtime_watcher_sees_changes_and_recovers_from_410() {
    let emu = emulator_with(tartan_testkit::Options::default().history_limit(3)).await;
    let api = macbuilds(&emu.client(), "default");
    api.create(&PostParams::default(), &macbuild("w0", json!({"image": "x"})))
        .await
        .unwrap();
    let mut stream = watcher(api.clone(), watcher::Config::default())
        .applied_objects()
        .boxed();
    let first = tokio::time::timeout(Duration::from_secs(10), stream.try_next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(first.metadata.name.as_deref(), Some("w0"));
    api.patch_status(
        "w0",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Running"}})),
    )
    .await
    .unwrap();
    let seen = loop {
        let o = tokio::time::timeout(Duration::from_secs(10), stream.try_next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        if o.data["status"]["phase"] == json!("Running") {
            break o;
        }
    };
    assert_eq!(seen.metadata.name.as_deref(), Some("w0"));
    // Drop every connection, forget the history while clients are away, then come back:
    // the watcher's resourceVersion is now too old (410), so it relists and carries on.
    emu.set_availability(tartan_testkit::Availability::Refuse);
    eventually(10, "connections refused", || async {
        tokio::net::TcpStream::connect(emu.addr()).await.is_err().then_some(())
    })
    .await;
    emu.compact();
    emu.set_availability(tartan_testkit::Availability::Up);
    api.create(&PostParams::default(), &macbuild("w1", json!({"image": "x"})))
        .await
        .unwrap();
    let w1 = loop {
        match tokio::time::timeout(Duration::from_secs(30), stream.next())
            .await
            .unwrap()
            .unwrap()
        {
            Ok(o) if o.metadata.name.as_deref() == Some("w1") => break o,
            _ => continue,
        }
    };
    assert_eq!(w1.data["spec"]["image"], json!("x"));
    let lists = emu
        .requests()
        .iter()
        .filter(|r| r.contains("/macbuilds?") && !r.contains("watch="))
        .count();
    assert!(lists >= 2, "the watcher relisted after 410: {:?}", emu.requests());
}

#[tokio::test]
async fn controller_reconciles_against_the_emulator() {
    use kube::runtime::controller::{Action, Controller};
    let emu = emulator().await;
    let client = emu.client();
    let api = macbuilds(&client, "default");
    api.create(&PostParams::default(), &macbuild("ctl", json!({"image": "x"})))
        .await
        .unwrap();
    let ar = macbuild_resource();
    let reconciler_api = api.clone();
    let controller = Controller::new_with(api.clone(), watcher::Config::default(), ar)
        .run(
            move |obj: Arc<kube::api::DynamicObject>, _ctx: Arc<()>| {
                let api = reconciler_api.clone();
                async move {
                    let name = obj.metadata.name.clone().unwrap();
                    let generation = obj.metadata.generation.unwrap();
                    if obj.data["status"]["observedGeneration"] != json!(generation) {
                        api.patch_status(
                            &name,
                            &PatchParams::default(),
                            &Patch::Merge(json!({"status": {"phase": "Pending", "observedGeneration": generation}})),
                        )
                        .await?;
                    }
                    Ok::<_, kube::Error>(Action::await_change())
                }
            },
            |_obj, _err: &kube::Error, _ctx| Action::requeue(Duration::from_millis(100)),
            Arc::new(()),
        )
        .for_each(|_| async {});
    let task = tokio::spawn(controller);
    eventually(10, "first reconcile", || {
        let api = api.clone();
        async move { (api.get("ctl").await.ok()?.data["status"]["observedGeneration"] == json!(1)).then_some(()) }
    })
    .await;
    api.patch(
        "ctl",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"timeoutSeconds": 9}})),
    )
    .await
    .unwrap();
    eventually(10, "reconcile of generation 2", || {
        let api = api.clone();
        async move { (api.get("ctl").await.ok()?.data["status"]["observedGeneration"] == json!(2)).then_some(()) }
    })
    .await;
    task.abort();
}

#[tokio::test]
async fn streaming_list_watcher_uses_send_initial_events() {
    let emu = emulator().await;
    let api = macbuilds(&emu.client(), "default");
    for n in ["s1", "s2"] {
        api.create(&PostParams::default(), &macbuild(n, json!({"image": "x"})))
            .await
            .unwrap();
    }
    let mut stream = watcher(api.clone(), watcher::Config::default().streaming_lists()).boxed();
    let mut initial = Vec::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(10), stream.try_next())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
        {
            watcher::Event::InitApply(o) => initial.push(o.metadata.name.unwrap()),
            watcher::Event::InitDone => break,
            _ => {}
        }
    }
    assert_eq!(initial, vec!["s1", "s2"]);
    assert!(
        emu.requests().iter().any(|r| r.contains("sendInitialEvents=true")),
        "{:?}",
        emu.requests()
    );
    api.create(&PostParams::default(), &macbuild("s3", json!({"image": "x"})))
        .await
        .unwrap();
    loop {
        if let watcher::Event::Apply(o) = tokio::time::timeout(Duration::from_secs(10), stream.try_next())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
            && o.metadata.name.as_deref() == Some("s3")
        {
            break;
        }
    }
}

#[tokio::test]
async fn table_watch_for_kubectl_get_watch() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let emu = emulator().await;
    let api = macbuilds(&emu.client(), "default");
    api.create(&PostParams::default(), &macbuild("t1", json!({"image": "x"})))
        .await
        .unwrap();
    let mut s = tokio::net::TcpStream::connect(emu.addr()).await.unwrap();
    let req = "GET /apis/tartan.dev/v1alpha1/namespaces/default/macbuilds?watch=1&timeoutSeconds=1 HTTP/1.1\r\nHost: x\r\n\
               Accept: application/json;as=Table;v=v1;g=meta.k8s.io\r\nConnection: close\r\n\r\n";
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut out))
        .await
        .unwrap()
        .unwrap();
    let line = out.lines().find(|l| l.starts_with('{')).expect("an event line");
    let ev: serde_json::Value = serde_json::from_str(line).unwrap();
    assert_eq!(ev["type"], json!("ADDED"));
    assert_eq!(ev["object"]["kind"], json!("Table"));
    assert_eq!(ev["object"]["rows"][0]["cells"][0], json!("t1"));
}
