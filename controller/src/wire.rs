//! Watched objects read without their `managedFields`.
//!
//! The real apiserver sends every object with its managedFields (a JSON tree per field manager),
//! and a watch's list after a restart is parsed whole before the cache's trim drops them: at
//! 10,000 runs that tree, held for every object of the list at once, set the controller's peak
//! memory. Read through [`Unmanaged`], each object leaves the field managers' trees behind as it
//! is parsed, one object at a time.

use kube::Resource;
use kube::api::ObjectMeta;
use kube::runtime::watcher;
use serde::de::{DeserializeOwned, Error as _, IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_json::Value;
use std::borrow::Cow;
use std::marker::PhantomData;

/// `K` as the API sends it, but for `metadata.managedFields`, which is dropped while parsing.
#[derive(Clone, Debug)]
pub struct Unmanaged<K>(pub K);

impl<K: Resource> Resource for Unmanaged<K> {
    type DynamicType = K::DynamicType;
    type Scope = K::Scope;

    fn kind(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::kind(dt)
    }
    fn group(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::group(dt)
    }
    fn version(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::version(dt)
    }
    fn api_version(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::api_version(dt)
    }
    fn plural(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::plural(dt)
    }
    fn meta(&self) -> &ObjectMeta {
        self.0.meta()
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        self.0.meta_mut()
    }
}

impl<'de, K: DeserializeOwned + Resource> Deserialize<'de> for Unmanaged<K> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(ObjectVisitor(PhantomData))
    }
}

/// Reads an object's fields but `metadata` as JSON values, and its metadata but
/// `managedFields` (skipped unparsed), then builds `K` from them.
struct ObjectVisitor<K>(PhantomData<K>);

impl<'de, K: DeserializeOwned + Resource> Visitor<'de> for ObjectVisitor<K> {
    type Value = Unmanaged<K>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "a Kubernetes object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut fields: A) -> Result<Self::Value, A::Error> {
        let mut rest = serde_json::Map::new();
        let mut meta = ObjectMeta::default();
        while let Some(key) = fields.next_key::<String>()? {
            if key == "metadata" {
                meta = fields.next_value::<MetaWithoutManagedFields>()?.0;
            } else {
                rest.insert(key, fields.next_value::<Value>()?);
            }
        }
        rest.insert("metadata".into(), Value::Object(Default::default()));
        let mut object: K = serde_json::from_value(Value::Object(rest)).map_err(A::Error::custom)?;
        *object.meta_mut() = meta;
        Ok(Unmanaged(object))
    }
}

struct MetaWithoutManagedFields(ObjectMeta);

impl<'de> Deserialize<'de> for MetaWithoutManagedFields {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct MetaVisitor;
        impl<'de> Visitor<'de> for MetaVisitor {
            type Value = MetaWithoutManagedFields;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                write!(f, "an object's metadata")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut fields: A) -> Result<Self::Value, A::Error> {
                let mut kept = serde_json::Map::new();
                while let Some(key) = fields.next_key::<String>()? {
                    if key == "managedFields" {
                        fields.next_value::<IgnoredAny>()?;
                    } else {
                        kept.insert(key, fields.next_value::<Value>()?);
                    }
                }
                serde_json::from_value(Value::Object(kept))
                    .map(MetaWithoutManagedFields)
                    .map_err(A::Error::custom)
            }
        }
        d.deserialize_map(MetaVisitor)
    }
}

/// A watch event of [`Unmanaged`] objects as one of the objects themselves.
pub fn unwrap_event<K>(event: watcher::Event<Unmanaged<K>>) -> watcher::Event<K> {
    match event {
        watcher::Event::Apply(o) => watcher::Event::Apply(o.0),
        watcher::Event::Delete(o) => watcher::Event::Delete(o.0),
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitApply(o) => watcher::Event::InitApply(o.0),
        watcher::Event::InitDone => watcher::Event::InitDone,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::customrun::CustomRun;
    use serde_json::json;
    use tartan_api::MacBuild;

    #[test]
    fn an_object_reads_the_same_but_for_its_managed_fields() {
        let run = json!({
            "apiVersion": "tekton.dev/v1beta1", "kind": "CustomRun",
            "metadata": {"name": "b", "namespace": "ci", "uid": "u", "resourceVersion": "7",
                "labels": {"a": "b"},
                "managedFields": [{"manager": "tekton", "operation": "Update", "fieldsType": "FieldsV1",
                    "fieldsV1": {"f:spec": {"f:params": {}}}}]},
            "spec": {"customRef": {"apiVersion": "tartan.dev/v1alpha1", "kind": "MacBuild"}},
        });
        let read: Unmanaged<CustomRun> = serde_json::from_value(run.clone()).unwrap();
        let mut whole: CustomRun = serde_json::from_value(run).unwrap();
        assert!(whole.metadata.managed_fields.is_some());
        whole.metadata.managed_fields = None;
        assert_eq!(
            serde_json::to_value(&read.0).unwrap(),
            serde_json::to_value(&whole).unwrap()
        );
        assert_eq!(Unmanaged::<MacBuild>::plural(&()), MacBuild::plural(&()));
        assert_eq!(
            Unmanaged::<CustomRun>::url_path(&(), Some("ci")),
            CustomRun::url_path(&(), Some("ci"))
        );
    }

    /// Watch events come through serde's buffered content (the event's `type` tag), lists as
    /// plain JSON: both reach the object the same way.
    #[test]
    fn a_watch_event_and_a_list_carry_the_object_without_managed_fields() {
        let event = r#"{"type": "MODIFIED", "object": {"apiVersion": "tartan.dev/v1alpha1", "kind": "MacBuild",
            "metadata": {"name": "b", "namespace": "ci", "resourceVersion": "9",
                "managedFields": [{"manager": "tartan-agent", "fieldsV1": {"f:status": {"f:phase": {}}}}]},
            "spec": {"image": "img", "steps": []}, "status": {"phase": "Running"}}}"#;
        match serde_json::from_str::<kube::core::WatchEvent<Unmanaged<MacBuild>>>(event).unwrap() {
            kube::core::WatchEvent::Modified(mb) => {
                assert_eq!(mb.0.metadata.resource_version.as_deref(), Some("9"));
                assert!(mb.0.metadata.managed_fields.is_none());
                assert!(mb.0.status.is_some());
            }
            other => panic!("{other:?}"),
        }
        let list = format!(
            r#"{{"apiVersion": "v1", "kind": "List", "metadata": {{"resourceVersion": "10"}}, "items": [{}]}}"#,
            &event[event.find(r#"{"apiVersion""#).unwrap()..event.len() - 1]
        );
        let list: kube::core::ObjectList<Unmanaged<MacBuild>> = serde_json::from_str(&list).unwrap();
        assert_eq!(list.items.len(), 1);
        assert!(list.items[0].0.metadata.managed_fields.is_none());
    }

    #[test]
    fn what_is_not_an_object_of_the_kind_is_an_error() {
        assert!(serde_json::from_value::<Unmanaged<CustomRun>>(json!({"metadata": 5})).is_err());
        assert!(serde_json::from_value::<Unmanaged<CustomRun>>(json!([1])).is_err());
    }
}
