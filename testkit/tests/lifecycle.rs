//! Finalizers and deletion, ownerReference garbage collection, namespace deletion, CRDs at runtime.

mod common;

use std::time::Duration;

use common::*;
use futures::StreamExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use serde_json::json;

#[tokio::test]
async fn finalizer_holds_deletion_until_removed() {
    let emu = emulator().await;
    let api = macbuilds(&emu.client(), "default");
    let mut o = macbuild("f", json!({"image": "x"}));
    o.metadata.finalizers = Some(vec!["tartan.dev/vm-cleanup".into()]);
    let created = api.create(&PostParams::default(), &o).await.unwrap();
    let mut w = api
        .watch(
            &WatchParams::default(),
            created.metadata.resource_version.as_deref().unwrap(),
        )
        .await
        .unwrap()
        .boxed();

    let pending = api
        .delete("f", &DeleteParams::default())
        .await
        .unwrap()
        .left()
        .expect("kept: the object comes back");
    assert!(pending.metadata.deletion_timestamp.is_some());
    assert_eq!(pending.metadata.deletion_grace_period_seconds, Some(0));
    assert_eq!(
        pending.metadata.generation,
        Some(2),
        "marking for deletion bumps generation"
    );
    match tokio::time::timeout(Duration::from_secs(5), w.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap()
    {
        WatchEvent::Modified(m) => assert!(m.metadata.deletion_timestamp.is_some()),
        _ => panic!("expected MODIFIED with deletionTimestamp"),
    }
    // Still readable, still writable (status), but no new finalizers.
    api.patch_status(
        "f",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Failed"}})),
    )
    .await
    .unwrap();
    let add = status_of(
        api.patch(
            "f",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": ["tartan.dev/vm-cleanup", "other/x"]}})),
        )
        .await,
    );
    assert_eq!(add.code, 422);
    assert_eq!(
        add.message,
        "MacBuild.tartan.dev \"f\" is invalid: metadata.finalizers: Forbidden: no new finalizers can be added if the object is being deleted, found new finalizers []string{\"other/x\"}"
    );
    // A second DELETE changes nothing.
    let again = api.delete("f", &DeleteParams::default()).await.unwrap().left().unwrap();
    assert_eq!(again.metadata.deletion_timestamp, pending.metadata.deletion_timestamp);

    // Removing the finalizer the way kube's finalizer helper does: test + remove.
    let cur = api.get("f").await.unwrap();
    let patch: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/finalizers/0", "value": "tartan.dev/vm-cleanup"},
        {"op": "remove", "path": "/metadata/finalizers/0"}
    ]))
    .unwrap();
    let last = api
        .patch("f", &PatchParams::default(), &Patch::Json::<()>(patch))
        .await
        .unwrap();
    assert!(last.metadata.finalizers.is_none());
    let mut saw_delete = false;
    while let Ok(Some(e)) = tokio::time::timeout(Duration::from_secs(5), w.next()).await {
        if let WatchEvent::Deleted(d) = e.unwrap() {
            assert_eq!(d.metadata.uid, cur.metadata.uid);
            saw_delete = true;
            break;
        }
    }
    assert!(saw_delete, "DELETED event once finalizers are gone");
    assert_eq!(status_of(api.get("f").await).code, 404);
}

fn owner_ref(owner: &kube::api::DynamicObject, kind: &str, api_version: &str) -> serde_json::Value {
    json!({"apiVersion": api_version, "kind": kind, "name": owner.metadata.name, "uid": owner.metadata.uid,
           "controller": true, "blockOwnerDeletion": true})
}

#[tokio::test]
async fn owner_deletion_collects_dependents_honouring_their_finalizers() {
    let emu = emulator().await;
    let client = emu.client();
    let runs = customruns(&client, "default");
    let builds = macbuilds(&client, "default");
    let run: kube::api::DynamicObject = serde_json::from_value(json!({
        "apiVersion": "tekton.dev/v1beta1", "kind": "CustomRun", "metadata": {"name": "run-1"},
        "spec": {"customRef": {"apiVersion": "tartan.dev/v1alpha1", "kind": "MacBuild"}}
    }))
    .unwrap();
    let run = runs.create(&PostParams::default(), &run).await.unwrap();
    let mut plain = macbuild("child-plain", json!({"image": "x"}));
    plain.metadata.owner_references =
        serde_json::from_value(json!([owner_ref(&run, "CustomRun", "tekton.dev/v1beta1")])).unwrap();
    builds.create(&PostParams::default(), &plain).await.unwrap();
    let mut held = macbuild("child-held", json!({"image": "x"}));
    held.metadata.owner_references = plain.metadata.owner_references.clone();
    held.metadata.finalizers = Some(vec!["tartan.dev/vm-cleanup".into()]);
    builds.create(&PostParams::default(), &held).await.unwrap();
    let unrelated = builds
        .create(&PostParams::default(), &macbuild("unrelated", json!({"image": "x"})))
        .await
        .unwrap();

    runs.delete("run-1", &DeleteParams::background()).await.unwrap();
    eventually(10, "plain dependent collected", || {
        let b = builds.clone();
        async move { b.get("child-plain").await.is_err().then_some(()) }
    })
    .await;
    let held_now = eventually(10, "held dependent marked for deletion", || {
        let b = builds.clone();
        async move {
            b.get("child-held")
                .await
                .ok()
                .filter(|o| o.metadata.deletion_timestamp.is_some())
        }
    })
    .await;
    assert!(held_now.metadata.finalizers.is_some());
    builds
        .patch(
            "child-held",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await
        .unwrap();
    assert_eq!(status_of(builds.get("child-held").await).code, 404);
    assert_eq!(
        builds.get("unrelated").await.unwrap().metadata.uid,
        unrelated.metadata.uid
    );

    // A dependent whose owner never existed is collected too.
    let mut orphan = macbuild("dangling", json!({"image": "x"}));
    orphan.metadata.owner_references =
        serde_json::from_value(json!([{"apiVersion": "tekton.dev/v1beta1", "kind": "CustomRun",
        "name": "ghost", "uid": "00000000-0000-0000-0000-000000000000"}]))
        .unwrap();
    builds.create(&PostParams::default(), &orphan).await.unwrap();
    eventually(10, "dangling dependent collected", || {
        let b = builds.clone();
        async move { b.get("dangling").await.is_err().then_some(()) }
    })
    .await;
}

#[tokio::test]
async fn foreground_and_orphan_propagation() {
    let emu = emulator().await;
    let client = emu.client();
    let builds = macbuilds(&client, "default");
    let owner = builds
        .create(&PostParams::default(), &macbuild("owner", json!({"image": "x"})))
        .await
        .unwrap();
    let mut dep = macbuild("dep", json!({"image": "x"}));
    dep.metadata.owner_references =
        serde_json::from_value(json!([owner_ref(&owner, "MacBuild", "tartan.dev/v1alpha1")])).unwrap();
    dep.metadata.finalizers = Some(vec!["x/hold".into()]);
    builds.create(&PostParams::default(), &dep).await.unwrap();
    let o = builds
        .delete("owner", &DeleteParams::foreground())
        .await
        .unwrap()
        .left()
        .unwrap();
    assert!(
        o.metadata
            .finalizers
            .unwrap()
            .contains(&"foregroundDeletion".to_string())
    );
    eventually(10, "dependent marked", || {
        let b = builds.clone();
        async move {
            b.get("dep")
                .await
                .ok()
                .filter(|d| d.metadata.deletion_timestamp.is_some())
        }
    })
    .await;
    assert!(builds.get("owner").await.is_ok(), "owner waits for its dependents");
    builds
        .patch(
            "dep",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await
        .unwrap();
    eventually(10, "owner gone after dependents", || {
        let b = builds.clone();
        async move { b.get("owner").await.is_err().then_some(()) }
    })
    .await;

    let owner = builds
        .create(&PostParams::default(), &macbuild("owner2", json!({"image": "x"})))
        .await
        .unwrap();
    let mut kept = macbuild("kept", json!({"image": "x"}));
    kept.metadata.owner_references =
        serde_json::from_value(json!([owner_ref(&owner, "MacBuild", "tartan.dev/v1alpha1")])).unwrap();
    builds.create(&PostParams::default(), &kept).await.unwrap();
    builds.delete("owner2", &DeleteParams::orphan()).await.unwrap();
    eventually(10, "orphaning owner gone", || {
        let b = builds.clone();
        async move { b.get("owner2").await.is_err().then_some(()) }
    })
    .await;
    let k = builds.get("kept").await.unwrap();
    assert!(
        k.metadata.owner_references.is_none(),
        "orphaned dependent keeps living without the reference"
    );
}

#[tokio::test]
async fn namespace_deletion_removes_its_content() {
    let emu = emulator().await;
    let client = emu.client();
    let nss: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    nss.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": "doomed"}})).unwrap(),
    )
    .await
    .unwrap();
    let ns = nss.get("doomed").await.unwrap();
    assert_eq!(ns.status.unwrap().phase.as_deref(), Some("Active"));
    let builds = macbuilds(&client, "doomed");
    builds
        .create(&PostParams::default(), &macbuild("inside", json!({"image": "x"})))
        .await
        .unwrap();
    nss.delete("doomed", &DeleteParams::default()).await.unwrap();
    eventually(10, "namespace gone", || {
        let n = nss.clone();
        async move { n.get("doomed").await.is_err().then_some(()) }
    })
    .await;
    assert_eq!(status_of(builds.get("inside").await).code, 404);
    let default = nss.get("default").await.unwrap();
    assert_eq!(default.metadata.name.as_deref(), Some("default"));
}

#[tokio::test]
async fn crd_posted_at_runtime_is_served_and_its_deletion_removes_instances() {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let emu = tartan_testkit::start(tartan_testkit::Options::default()).await.unwrap();
    let client = emu.client();
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let text = std::fs::read_to_string(fixture("macbuild-crd.yaml")).unwrap();
    let crd: CustomResourceDefinition = serde_saphyr::from_str(&text).unwrap();
    let builds = macbuilds(&client, "default");
    assert_eq!(status_of(builds.list(&Default::default()).await).code, 404);
    let created = crds.create(&PostParams::default(), &crd).await.unwrap();
    let conds = created.status.unwrap().conditions.unwrap();
    assert!(conds.iter().any(|c| c.type_ == "Established" && c.status == "True"));
    builds
        .create(&PostParams::default(), &macbuild("later", json!({"image": "x"})))
        .await
        .unwrap();
    let discovery = kube::discovery::Discovery::new(client.clone()).run().await.unwrap();
    let (ar, caps) = discovery
        .resolve_gvk(&kube::api::GroupVersionKind::gvk("tartan.dev", "v1alpha1", "MacBuild"))
        .unwrap();
    assert_eq!(ar.plural, "macbuilds");
    assert!(caps.subresources.iter().any(|(s, _)| s.plural == "status"));

    crds.delete("macbuilds.tartan.dev", &DeleteParams::default())
        .await
        .unwrap();
    eventually(10, "CRD and its instances gone", || {
        let c = crds.clone();
        async move { c.get("macbuilds.tartan.dev").await.is_err().then_some(()) }
    })
    .await;
    assert_eq!(status_of(builds.get("later").await).code, 404);
}

/// The collector's work follows what changed, not what is stored: with 1,000 objects stored, status
/// writes on unowned objects make it look at nothing, on owned objects at the written object only,
/// and an owner's deletion at its dependents only (it once read every stored object per write).
#[tokio::test]
async fn garbage_collection_work_follows_what_changed_not_what_is_stored() {
    let emu = emulator().await;
    let client = emu.client();
    let runs = customruns(&client, "default");
    let builds = macbuilds(&client, "default");
    let run: kube::api::DynamicObject = serde_json::from_value(json!({
        "apiVersion": "tekton.dev/v1beta1", "kind": "CustomRun", "metadata": {"name": "owner"},
        "spec": {"customRef": {"apiVersion": "tartan.dev/v1alpha1", "kind": "MacBuild"}}
    }))
    .unwrap();
    let run = runs.create(&PostParams::default(), &run).await.unwrap();
    let refs: Vec<_> = serde_json::from_value(json!([owner_ref(&run, "CustomRun", "tekton.dev/v1beta1")])).unwrap();
    for i in 0..990 {
        builds
            .create(
                &PostParams::default(),
                &macbuild(&format!("plain-{i}"), json!({"image": "x"})),
            )
            .await
            .unwrap();
    }
    for i in 0..10 {
        let mut owned = macbuild(&format!("owned-{i}"), json!({"image": "x"}));
        owned.metadata.owner_references = Some(refs.clone());
        builds.create(&PostParams::default(), &owned).await.unwrap();
    }
    // The creations of owned objects were looked at (their owner is live): wait for that to settle.
    let settled = eventually(10, "collector done with the creations", || {
        let emu = &emu;
        async move { (emu.gc_visited() >= 10).then(|| emu.gc_visited()) }
    })
    .await;
    assert!(
        settled <= 10,
        "creating 10 owned objects had the collector look at {settled} objects"
    );

    let status = |phase: &str| Patch::Merge(json!({"status": {"phase": phase}}));
    for i in 0..100 {
        builds
            .patch_status(&format!("plain-{i}"), &PatchParams::default(), &status("Running"))
            .await
            .unwrap();
    }
    assert_eq!(
        emu.gc_visited(),
        settled,
        "status writes on objects without owners or finalizers need no collector"
    );
    for i in 0..10 {
        builds
            .patch_status(&format!("owned-{i}"), &PatchParams::default(), &status("Running"))
            .await
            .unwrap();
    }
    let after_owned = eventually(10, "collector looked at the written owned objects", || {
        let emu = &emu;
        async move { (emu.gc_visited() >= settled + 10).then(|| emu.gc_visited()) }
    })
    .await;
    assert!(
        after_owned <= settled + 10,
        "10 status writes on owned objects had the collector look at {} objects",
        after_owned - settled
    );

    runs.delete("owner", &DeleteParams::background()).await.unwrap();
    eventually(10, "owned objects collected", || {
        let b = builds.clone();
        async move {
            let left = b.list(&Default::default()).await.unwrap().items;
            (!left
                .iter()
                .any(|o| o.metadata.name.as_deref().unwrap_or("").starts_with("owned-")))
            .then_some(())
        }
    })
    .await;
    let deletion_cost = emu.gc_visited() - after_owned;
    assert!(
        deletion_cost <= 30,
        "deleting an owner of 10 among 1,000 stored objects had the collector look at {deletion_cost} objects"
    );
    assert_eq!(builds.list(&Default::default()).await.unwrap().items.len(), 990);
}
