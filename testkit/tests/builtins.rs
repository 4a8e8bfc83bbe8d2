//! Built-in types Tartan uses: Leases (renewal fenced by resourceVersion), Events (core v1 and
//! events.k8s.io/v1 over one store, as kube's Recorder and `kubectl describe` use them), Secrets.

mod common;

use common::*;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event as CoreEvent, Secret};
use kube::Resource;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use serde_json::json;

#[tokio::test]
async fn lease_renewal_is_fenced_by_resource_version() {
    let emu = emulator().await;
    let leases: Api<Lease> = Api::namespaced(emu.client(), "default");
    let lease: Lease = serde_json::from_value(json!({
        "metadata": {"name": "agent-mac-1"},
        "spec": {"holderIdentity": "mac-1", "leaseDurationSeconds": 20, "renewTime": "2026-01-01T00:00:00.000000Z"}
    }))
    .unwrap();
    let created = leases.create(&PostParams::default(), &lease).await.unwrap();
    assert!(created.metadata.generation.is_none(), "leases do not track generation");
    let rv = created.metadata.resource_version.clone().unwrap();
    let renew = |rv: &str, t: &str| {
        Patch::Merge(
            json!({"metadata": {"resourceVersion": rv}, "spec": {"renewTime": t, "holderIdentity": "mac-1", "leaseDurationSeconds": 20}}),
        )
    };
    let renewed = leases
        .patch(
            "agent-mac-1",
            &PatchParams::default(),
            &renew(&rv, "2026-01-01T00:00:05.000000Z"),
        )
        .await
        .unwrap();
    assert_eq!(
        json_of(&renewed.spec.unwrap().renew_time.unwrap()),
        json!("2026-01-01T00:00:05.000000Z")
    );
    let stale = status_of(
        leases
            .patch(
                "agent-mac-1",
                &PatchParams::default(),
                &renew(&rv, "2026-01-01T00:00:10.000000Z"),
            )
            .await,
    );
    assert_eq!((stale.code, stale.reason.as_str()), (409, "Conflict"));
    assert_eq!(
        stale.message,
        "Operation cannot be fulfilled on leases.coordination.k8s.io \"agent-mac-1\": the object has been modified; please apply your changes to the latest version and try again"
    );
    assert_eq!(
        status_of(leases.get("agent-mac-2").await).message,
        "leases.coordination.k8s.io \"agent-mac-2\" not found"
    );
}

#[tokio::test]
async fn recorder_events_show_up_as_core_events_for_describe() {
    let emu = emulator().await;
    let client = emu.client();
    let builds = macbuilds(&client, "default");
    let mb = builds
        .create(&PostParams::default(), &macbuild("ev", json!({"image": "x"})))
        .await
        .unwrap();
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "macbuild-controller".into(),
            instance: Some("c-0".into()),
        },
    );
    let reference = mb.object_ref(&macbuild_resource());
    recorder
        .publish(
            &Event {
                type_: EventType::Normal,
                reason: "Claimed".into(),
                note: Some("claimed by mac-1".into()),
                action: "Claim".into(),
                secondary: None,
            },
            &reference,
        )
        .await
        .unwrap();
    // Same event again: the recorder patches it into a series.
    recorder
        .publish(
            &Event {
                type_: EventType::Normal,
                reason: "Claimed".into(),
                note: Some("claimed by mac-1".into()),
                action: "Claim".into(),
                secondary: None,
            },
            &reference,
        )
        .await
        .unwrap();
    let core: Api<CoreEvent> = Api::namespaced(client.clone(), "default");
    let selector = format!(
        "involvedObject.name=ev,involvedObject.namespace=default,involvedObject.kind=MacBuild,involvedObject.uid={}",
        mb.metadata.uid.clone().unwrap()
    );
    let events = core.list(&ListParams::default().fields(&selector)).await.unwrap();
    assert_eq!(events.items.len(), 1);
    let e = &events.items[0];
    assert_eq!(e.reason.as_deref(), Some("Claimed"));
    assert_eq!(e.message.as_deref(), Some("claimed by mac-1"));
    assert_eq!(e.reporting_component.as_deref(), Some("macbuild-controller"));
    assert_eq!(e.involved_object.name.as_deref(), Some("ev"));
    assert!(e.series.is_some(), "second publish became a series");
    let none = core
        .list(&ListParams::default().fields("involvedObject.name=other"))
        .await
        .unwrap();
    assert!(none.items.is_empty());
}

#[tokio::test]
async fn secrets_take_string_data() {
    let emu = emulator().await;
    let secrets: Api<Secret> = Api::namespaced(emu.client(), "default");
    let s: Secret =
        serde_json::from_value(json!({"metadata": {"name": "s3"}, "stringData": {"key": "hello"}})).unwrap();
    let created = secrets.create(&PostParams::default(), &s).await.unwrap();
    assert_eq!(created.type_.as_deref(), Some("Opaque"));
    assert_eq!(created.data.unwrap()["key"].0, b"hello".to_vec());
    assert!(created.string_data.is_none());
}
