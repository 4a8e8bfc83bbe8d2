//! CRUD, patch, status subresource, generation, validation and pruning through `kube::Client`.

mod common;

use common::*;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;

#[tokio::test]
async fn create_get_list_conflict_and_not_found() {
    let emu = emulator().await;
    let api = macbuilds(&emu.client(), "default");
    let created = api
        .create(&PostParams::default(), &macbuild("b1", json!({"image": "sequoia"})))
        .await
        .unwrap();
    let meta = &created.metadata;
    assert!(meta.uid.as_deref().is_some_and(|u| u.len() == 36));
    assert!(meta.creation_timestamp.is_some());
    assert_eq!(meta.generation, Some(1));
    let rv1: u64 = meta.resource_version.as_deref().unwrap().parse().unwrap();
    assert_eq!(created.data["spec"]["maxAttempts"], json!(2), "schema default applied");

    let again = status_of(
        api.create(&PostParams::default(), &macbuild("b1", json!({"image": "x"})))
            .await,
    );
    assert_eq!((again.code, again.reason.as_str()), (409, "AlreadyExists"));
    assert_eq!(again.message, "macbuilds.tartan.dev \"b1\" already exists");
    let d = again.details.unwrap();
    assert_eq!(
        (d.name.as_str(), d.group.as_str(), d.kind.as_str()),
        ("b1", "tartan.dev", "macbuilds")
    );

    let missing = status_of(api.get("nope").await);
    assert_eq!((missing.code, missing.reason.as_str()), (404, "NotFound"));
    assert_eq!(missing.message, "macbuilds.tartan.dev \"nope\" not found");

    let mut gen_named = macbuild("", json!({"image": "x"}));
    gen_named.metadata.name = None;
    gen_named.metadata.generate_name = Some("gen-".into());
    let g = api.create(&PostParams::default(), &gen_named).await.unwrap();
    let gname = g.metadata.name.unwrap();
    assert!(gname.starts_with("gen-") && gname.len() == 9, "{gname}");
    let rv2: u64 = g.metadata.resource_version.unwrap().parse().unwrap();
    assert!(rv2 > rv1);

    let list = api.list(&ListParams::default()).await.unwrap();
    let names: Vec<String> = list.items.iter().filter_map(|o| o.metadata.name.clone()).collect();
    assert_eq!(names, vec!["b1".to_string(), gname.clone()]);
    let list_rv: u64 = list.metadata.resource_version.unwrap().parse().unwrap();
    assert!(list_rv >= rv2);

    let other_ns = status_of(
        macbuilds(&emu.client(), "ghost")
            .create(&PostParams::default(), &macbuild("b", json!({"image": "x"})))
            .await,
    );
    assert_eq!(
        (other_ns.code, other_ns.message.as_str()),
        (404, "namespaces \"ghost\" not found")
    );

    let gone = api.delete("b1", &DeleteParams::default()).await.unwrap();
    let status = gone.right().expect("deleted at once: a Status");
    assert!(status.is_success());
    assert_eq!(status_of(api.get("b1").await).code, 404);
    assert_eq!(status_of(api.delete("b1", &DeleteParams::default()).await).code, 404);
}

#[tokio::test]
async fn selectors_and_cluster_wide_list() {
    let emu = emulator().await;
    let client = emu.client();
    let ns_api: kube::Api<k8s_openapi::api::core::v1::Namespace> = kube::Api::all(client.clone());
    ns_api
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "ci"}})).unwrap(),
        )
        .await
        .unwrap();
    for (ns, name, labels) in [
        ("default", "a", json!({"app": "mac", "tier": "ci"})),
        ("default", "b", json!({"app": "linux"})),
        ("ci", "c", json!({"app": "mac"})),
    ] {
        let mut o = macbuild(name, json!({"image": "x"}));
        o.metadata.labels = serde_json::from_value(labels).unwrap();
        macbuilds(&client, ns).create(&PostParams::default(), &o).await.unwrap();
    }
    let all: kube::Api<kube::api::DynamicObject> = kube::Api::all_with(client.clone(), &macbuild_resource());
    let names = |l: kube::core::ObjectList<kube::api::DynamicObject>| -> Vec<String> {
        l.items.into_iter().map(|o| o.metadata.name.unwrap()).collect()
    };
    assert_eq!(
        names(all.list(&ListParams::default()).await.unwrap()),
        vec!["c", "a", "b"]
    );
    assert_eq!(
        names(all.list(&ListParams::default().labels("app=mac")).await.unwrap()),
        vec!["c", "a"]
    );
    assert_eq!(
        names(all.list(&ListParams::default().labels("app!=mac")).await.unwrap()),
        vec!["b"]
    );
    assert_eq!(
        names(
            all.list(&ListParams::default().labels("app in (linux,bsd)"))
                .await
                .unwrap()
        ),
        vec!["b"]
    );
    assert_eq!(
        names(
            all.list(&ListParams::default().labels("app notin (linux),tier"))
                .await
                .unwrap()
        ),
        vec!["a"]
    );
    assert_eq!(
        names(all.list(&ListParams::default().labels("!tier")).await.unwrap()),
        vec!["c", "b"]
    );
    assert_eq!(
        names(
            all.list(&ListParams::default().fields("metadata.namespace=ci"))
                .await
                .unwrap()
        ),
        vec!["c"]
    );
    assert_eq!(
        names(
            macbuilds(&client, "default")
                .list(&ListParams::default().fields("metadata.name!=a"))
                .await
                .unwrap()
        ),
        vec!["b"]
    );
    let bad = status_of(all.list(&ListParams::default().fields("spec.image=x")).await);
    assert_eq!(bad.code, 400);
    let page = all.list(&ListParams::default().limit(2)).await.unwrap();
    assert_eq!(page.items.len(), 2);
    let token = page.metadata.continue_.clone().expect("continue token");
    let rest = all
        .list(&ListParams::default().limit(2).continue_token(&token))
        .await
        .unwrap();
    assert_eq!(names(rest), vec!["b"]);
}

#[tokio::test]
async fn generation_and_status_subresource() {
    let emu = emulator().await;
    let api = macbuilds(&emu.client(), "default");
    api.create(&PostParams::default(), &macbuild("g", json!({"image": "x"})))
        .await
        .unwrap();

    // Status on create is dropped when status is a subresource.
    let mut with_status = macbuild("s", json!({"image": "x"}));
    with_status.data["status"] = json!({"phase": "Running"});
    let s = api.create(&PostParams::default(), &with_status).await.unwrap();
    assert!(s.data.get("status").is_none());

    // Metadata-only change: resourceVersion moves, generation does not.
    let p = api
        .patch(
            "g",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"x": "y"}}})),
        )
        .await
        .unwrap();
    assert_eq!(p.metadata.generation, Some(1));
    // Status through the main endpoint is ignored (and no generation bump).
    let p2 = api
        .patch(
            "g",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Running"}})),
        )
        .await
        .unwrap();
    assert!(p2.data.get("status").is_none());
    assert_eq!(p2.metadata.generation, Some(1));
    assert_eq!(
        p2.metadata.resource_version, p.metadata.resource_version,
        "a no-op write changes nothing"
    );
    // Spec change bumps generation.
    let p3 = api
        .patch(
            "g",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"timeoutSeconds": 60}})),
        )
        .await
        .unwrap();
    assert_eq!(p3.metadata.generation, Some(2));
    // The status endpoint writes status only, ignoring spec and labels, without a generation bump.
    let st = api
        .patch_status(
            "g",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"image": "ignored"}, "metadata": {"labels": {"z": "1"}}, "status": {"phase": "Running", "observedGeneration": 2}})),
        )
        .await
        .unwrap();
    assert_eq!(st.data["status"]["phase"], json!("Running"));
    assert_eq!(st.data["spec"]["image"], json!("x"));
    assert!(st.metadata.labels.as_ref().unwrap().get("z").is_none());
    assert_eq!(st.metadata.generation, Some(2));
    // PUT on the main endpoint keeps the stored status.
    let mut cur = api.get("g").await.unwrap();
    cur.data["status"] = json!({"phase": "Failed"});
    cur.data["spec"]["image"] = json!("y");
    let put = api.replace("g", &PostParams::default(), &cur).await.unwrap();
    assert_eq!(put.data["status"]["phase"], json!("Running"));
    assert_eq!(put.metadata.generation, Some(3));
    // get_status returns the whole object.
    let gs = api.get_status("g").await.unwrap();
    assert_eq!(gs.data["spec"]["image"], json!("y"));
}

#[tokio::test]
async fn optimistic_concurrency() {
    let emu = emulator().await;
    let api = macbuilds(&emu.client(), "default");
    let created = api
        .create(&PostParams::default(), &macbuild("c", json!({"image": "x"})))
        .await
        .unwrap();
    let rv = created.metadata.resource_version.clone().unwrap();
    api.patch(
        "c",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"timeoutSeconds": 5}})),
    )
    .await
    .unwrap();

    // PUT with a stale resourceVersion.
    let stale = status_of(api.replace("c", &PostParams::default(), &created).await);
    assert_eq!((stale.code, stale.reason.as_str()), (409, "Conflict"));
    assert_eq!(
        stale.message,
        "Operation cannot be fulfilled on macbuilds.tartan.dev \"c\": the object has been modified; please apply your changes to the latest version and try again"
    );
    // Merge patch carrying a stale resourceVersion.
    let merge = status_of(
        api.patch_status(
            "c",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"resourceVersion": rv}, "status": {"phase": "Running"}})),
        )
        .await,
    );
    assert_eq!((merge.code, merge.reason.as_str()), (409, "Conflict"));
    // JSON patch whose test fails: 422 with the apiserver's generic message.
    let patch: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
        {"op": "add", "path": "/status", "value": {"claim": {"holder": "mac-1", "epoch": 1}}}
    ]))
    .unwrap();
    let failed = status_of(
        api.patch_status("c", &PatchParams::default(), &Patch::Json::<()>(patch))
            .await,
    );
    assert_eq!((failed.code, failed.reason.as_str()), (422, "Invalid"));
    assert_eq!(
        failed.message,
        "the server rejected our request due to an error in our request"
    );
    // The same patch with the current version wins.
    let current = api.get("c").await.unwrap().metadata.resource_version.unwrap();
    let patch: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/resourceVersion", "value": current},
        {"op": "add", "path": "/status", "value": {"claim": {"holder": "mac-1", "epoch": 1}}}
    ]))
    .unwrap();
    let won = api
        .patch_status("c", &PatchParams::default(), &Patch::Json::<()>(patch))
        .await
        .unwrap();
    assert_eq!(won.data["status"]["claim"]["holder"], json!("mac-1"));
    // A later fenced write tests the holder rather than the version.
    let fenced: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/status/claim/holder", "value": "mac-2"},
        {"op": "replace", "path": "/status/phase", "value": "Succeeded"}
    ]))
    .unwrap();
    assert_eq!(
        status_of(
            api.patch_status("c", &PatchParams::default(), &Patch::Json::<()>(fenced))
                .await
        )
        .code,
        422
    );
    // `replace` of an absent path fails too.
    let replace: json_patch::Patch =
        serde_json::from_value(json!([{"op": "replace", "path": "/status/phase", "value": "Running"}])).unwrap();
    assert_eq!(
        status_of(
            api.patch_status("c", &PatchParams::default(), &Patch::Json::<()>(replace))
                .await
        )
        .code,
        422
    );
}

#[tokio::test]
async fn validation_errors_are_invalid_status_with_causes() {
    let emu = emulator().await;
    let api = macbuilds(&emu.client(), "default");
    let bad = macbuild(
        "bad",
        json!({"timeoutSeconds": "soon", "maxAttempts": 9, "steps": [{"run": ["a"]}, {"name": "b"}, {"name": "c"}, {"name": "d"}]}),
    );
    let s = status_of(api.create(&PostParams::default(), &bad).await);
    assert_eq!((s.code, s.reason.as_str()), (422, "Invalid"));
    assert!(
        s.message.starts_with("MacBuild.tartan.dev \"bad\" is invalid: ["),
        "{}",
        s.message
    );
    let details = s.details.unwrap();
    assert_eq!(
        (details.kind.as_str(), details.group.as_str()),
        ("MacBuild", "tartan.dev")
    );
    let causes: Vec<(String, String, String)> = details
        .causes
        .iter()
        .map(|c| (c.reason.clone(), c.field.clone(), c.message.clone()))
        .collect();
    assert!(causes.contains(&(
        "FieldValueTypeInvalid".into(),
        "spec.timeoutSeconds".into(),
        "Invalid value: \"soon\": spec.timeoutSeconds in body must be of type integer: \"string\"".into()
    )));
    assert!(causes.contains(&(
        "FieldValueInvalid".into(),
        "spec.maxAttempts".into(),
        "Invalid value: 9: spec.maxAttempts in body should be less than or equal to 3".into()
    )));
    assert!(causes.contains(&(
        "FieldValueTooMany".into(),
        "spec.steps".into(),
        "Too many: 4: must have at most 3 items".into()
    )));
    assert!(causes.contains(&(
        "FieldValueRequired".into(),
        "spec.steps[0].name".into(),
        "Required value".into()
    )));
    assert!(causes.contains(&(
        "FieldValueRequired".into(),
        "spec.image".into(),
        "Required value".into()
    )));

    // Enum on status, through the status subresource.
    api.create(&PostParams::default(), &macbuild("ok", json!({"image": "x"})))
        .await
        .unwrap();
    let e = status_of(
        api.patch_status(
            "ok",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Exploded"}})),
        )
        .await,
    );
    assert_eq!(e.code, 422);
    assert_eq!(
        e.message,
        "MacBuild.tartan.dev \"ok\" is invalid: status.phase: Unsupported value: \"Exploded\": supported values: \"Pending\", \"Running\", \"Succeeded\", \"Failed\""
    );
    // Bad names.
    let n = status_of(
        api.create(&PostParams::default(), &macbuild("Upper_Case", json!({"image": "x"})))
            .await,
    );
    assert_eq!(n.code, 422);
    assert!(
        n.message
            .contains("metadata.name: Invalid value: \"Upper_Case\": a lowercase RFC 1123 subdomain")
    );
}

#[tokio::test]
async fn pruning_defaults_and_nullable() {
    let emu = emulator().await;
    let api = macbuilds(&emu.client(), "default");
    let o = macbuild(
        "p",
        json!({"image": "x", "unknownField": {"a": 1}, "hostSelector": {"xcode": "16"}, "note": null, "cancelRequested": null}),
    );
    let created = api.create(&PostParams::default(), &o).await.unwrap();
    assert!(created.data["spec"].get("unknownField").is_none());
    assert_eq!(created.data["spec"]["hostSelector"], json!({"xcode": "16"}));
    assert!(
        created.data["spec"].get("note").is_some_and(|v| v.is_null()),
        "nullable null kept"
    );
    assert!(
        created.data["spec"].get("cancelRequested").is_none(),
        "non-nullable null dropped"
    );
    let st = api
        .patch_status(
            "p",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Running", "bogus": 1, "claim": {"holder": "h", "x": 2}}})),
        )
        .await
        .unwrap();
    assert_eq!(st.data["status"], json!({"phase": "Running", "claim": {"holder": "h"}}));
}

#[tokio::test]
async fn tekton_customrun_status_pruning_keeps_extra_fields() {
    let emu = emulator().await;
    let api = customruns(&emu.client(), "default");
    let cr: kube::api::DynamicObject = serde_json::from_value(json!({
        "apiVersion": "tekton.dev/v1beta1", "kind": "CustomRun",
        "metadata": {"name": "build-42-mac-build"},
        "spec": {"customRef": {"apiVersion": "tartan.dev/v1alpha1", "kind": "MacBuild"}, "params": [{"name": "image", "value": "sequoia"}], "timeout": "30m"}
    }))
    .unwrap();
    let created = api.create(&PostParams::default(), &cr).await.unwrap();
    assert_eq!(created.metadata.generation, Some(1));
    let st = api
        .patch_status(
            "build-42-mac-build",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {
                "conditions": [{"type": "Succeeded", "status": "Unknown", "reason": "Running", "vendorField": "dropped"}],
                "arbitraryField": "dropped",
                "extraFields": {"attempt": "build-42-mac-build#1", "nested": {"kept": true}},
                "results": [{"name": "attempt", "value": "build-42-mac-build#1"}],
                "observedGeneration": 1
            }})),
        )
        .await
        .unwrap();
    let status = &st.data["status"];
    assert!(status.get("arbitraryField").is_none(), "unknown status field pruned");
    assert!(status["conditions"][0].get("vendorField").is_none());
    assert_eq!(
        status["extraFields"],
        json!({"attempt": "build-42-mac-build#1", "nested": {"kept": true}})
    );
    assert_eq!(status["results"][0]["value"], json!("build-42-mac-build#1"));
    // Results must be strings in this schema.
    let bad = status_of(
        api.patch_status(
            "build-42-mac-build",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"results": [{"name": "count", "value": 3}]}})),
        )
        .await,
    );
    assert_eq!(bad.code, 422);
    assert!(bad.message.contains("status.results[0].value"), "{}", bad.message);
    // Tekton patches spec of finished runs: generation goes up, status untouched.
    let p = api
        .patch(
            "build-42-mac-build",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"status": "RunCancelled"}})),
        )
        .await
        .unwrap();
    assert_eq!(p.metadata.generation, Some(2));
    assert_eq!(p.data["status"]["observedGeneration"], json!(1));
}

#[tokio::test]
async fn server_side_apply_and_unsupported_patch_types() {
    let emu = emulator().await;
    let api = macbuilds(&emu.client(), "default");
    let applied = api
        .patch(
            "ssa",
            &PatchParams::apply("tartan-test"),
            &Patch::Apply(json!({"apiVersion": "tartan.dev/v1alpha1", "kind": "MacBuild", "spec": {"image": "x"}})),
        )
        .await
        .unwrap();
    assert_eq!(applied.data["spec"]["image"], json!("x"));
    let st = api
        .patch_status(
            "ssa",
            &PatchParams::apply("tartan-test").force(),
            &Patch::Apply(
                json!({"apiVersion": "tartan.dev/v1alpha1", "kind": "MacBuild", "status": {"phase": "Pending"}}),
            ),
        )
        .await
        .unwrap();
    assert_eq!(st.data["status"]["phase"], json!("Pending"));
    assert_eq!(st.data["spec"]["image"], json!("x"));
    let smp = status_of(
        api.patch(
            "ssa",
            &PatchParams::default(),
            &Patch::Strategic(json!({"spec": {"image": "y"}})),
        )
        .await,
    );
    assert_eq!((smp.code, smp.reason.as_str()), (415, "UnsupportedMediaType"));
}
