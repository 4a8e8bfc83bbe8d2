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
use serde::de::{DeserializeSeed, IgnoredAny, IntoDeserializer, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, forward_to_deserialize_any};
use std::borrow::Cow;

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

impl<'de, K: Deserialize<'de>> Deserialize<'de> for Unmanaged<K> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        K::deserialize(Filtered {
            inner: d,
            level: Level::Object,
        })
        .map(Unmanaged)
    }
}

/// Where in the object a [`Filtered`] deserializer reads.
#[derive(Clone, Copy)]
enum Level {
    /// The object: its `metadata` is read through [`Level::Metadata`].
    Object,
    /// The object's metadata: its `managedFields` are skipped unparsed.
    Metadata,
}

/// A deserializer that hands `K`'s own `Deserialize` the object as it comes, but for the
/// managedFields, which it steps over without building them (no intermediate JSON tree).
struct Filtered<D> {
    inner: D,
    level: Level,
}

impl<'de, D: Deserializer<'de>> Deserializer<'de> for Filtered<D> {
    type Error = D::Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, D::Error> {
        self.inner.deserialize_map(FilteredVisitor {
            inner: visitor,
            level: self.level,
        })
    }

    fn is_human_readable(&self) -> bool {
        self.inner.is_human_readable()
    }

    forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
        bytes byte_buf option unit unit_struct newtype_struct seq tuple
        tuple_struct map struct enum identifier ignored_any
    }
}

struct FilteredVisitor<V> {
    inner: V,
    level: Level,
}

impl<'de, V: Visitor<'de>> Visitor<'de> for FilteredVisitor<V> {
    type Value = V::Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        self.inner.expecting(f)
    }

    fn visit_map<A: MapAccess<'de>>(self, fields: A) -> Result<V::Value, A::Error> {
        self.inner.visit_map(FilteredFields {
            inner: fields,
            level: self.level,
            next_is_metadata: false,
        })
    }
}

/// The fields of a map, read by name first so that the skipped ones never reach `K`.
struct FilteredFields<A> {
    inner: A,
    level: Level,
    next_is_metadata: bool,
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for FilteredFields<A> {
    type Error = A::Error;

    fn next_key_seed<S: DeserializeSeed<'de>>(&mut self, seed: S) -> Result<Option<S::Value>, A::Error> {
        loop {
            let Some(key) = self.inner.next_key::<String>()? else {
                return Ok(None);
            };
            match self.level {
                Level::Metadata if key == "managedFields" => {
                    self.inner.next_value::<IgnoredAny>()?;
                }
                level => {
                    self.next_is_metadata = matches!(level, Level::Object) && key == "metadata";
                    return seed.deserialize(key.into_deserializer()).map(Some);
                }
            }
        }
    }

    fn next_value_seed<S: DeserializeSeed<'de>>(&mut self, seed: S) -> Result<S::Value, A::Error> {
        if std::mem::take(&mut self.next_is_metadata) {
            self.inner.next_value_seed(MetadataSeed(seed))
        } else {
            self.inner.next_value_seed(seed)
        }
    }

    fn size_hint(&self) -> Option<usize> {
        self.inner.size_hint()
    }
}

/// The seed of an object's metadata, given the metadata through a [`Filtered`] deserializer.
struct MetadataSeed<S>(S);

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for MetadataSeed<S> {
    type Value = S::Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<S::Value, D::Error> {
        self.0.deserialize(Filtered {
            inner: d,
            level: Level::Metadata,
        })
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

    /// A watch event whose `object` comes before its `type` is buffered by serde before the
    /// object is read; managedFields anywhere in the metadata, and metadata anywhere in the
    /// object, are all read the same way.
    #[test]
    fn field_order_does_not_matter() {
        let events = [
            r#"{"object": {"spec": {"image": "img", "steps": []}, "metadata": {"managedFields": [{"manager": "m"}],
                "name": "b", "resourceVersion": "9"}, "kind": "MacBuild", "apiVersion": "tartan.dev/v1alpha1"},
                "type": "ADDED"}"#,
            r#"{"type": "ADDED", "object": {"metadata": {"name": "b", "resourceVersion": "9",
                "managedFields": [{"manager": "m", "fieldsV1": {"f:metadata": {"f:managedFields": {}}}}]},
                "kind": "MacBuild", "apiVersion": "tartan.dev/v1alpha1", "spec": {"image": "img", "steps": []}}}"#,
        ];
        for event in events {
            match serde_json::from_str::<kube::core::WatchEvent<Unmanaged<MacBuild>>>(event).unwrap() {
                kube::core::WatchEvent::Added(mb) => {
                    assert_eq!(mb.0.metadata.name.as_deref(), Some("b"), "{event}");
                    assert_eq!(mb.0.metadata.resource_version.as_deref(), Some("9"), "{event}");
                    assert!(mb.0.metadata.managed_fields.is_none(), "{event}");
                    assert_eq!(mb.0.spec.image, "img", "{event}");
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn what_is_not_an_object_of_the_kind_is_an_error() {
        assert!(serde_json::from_value::<Unmanaged<CustomRun>>(json!({"metadata": 5})).is_err());
        assert!(serde_json::from_value::<Unmanaged<CustomRun>>(json!([1])).is_err());
    }

    /// Shapes off the proptest's path read as the whole object does (or fail as it does): keys
    /// spelled with escapes, duplicate keys, a null or absent metadata, managedFields outside
    /// the object's own metadata, a malformed managedFields (skipped unread, where the whole
    /// object fails: the only difference, and a lenient one).
    #[test]
    fn unusual_shapes_read_as_the_whole_object_does() {
        let same = [
            r#"{"metad\u0061ta": {"name": "b", "managed\u0046ields": [{"manager": "m"}]}, "spec": {}}"#,
            r#"{"metadata": {"name": "b", "labels": {"managedFields": "x"}}, "spec": {"customSpec": {"metadata": {"labels": {"a": "b"}}}}}"#,
            r#"{"metadata": {"name": "b"}, "managedFields": [1], "spec": {}}"#,
            r#"{"metadata": {"name": "b", "managedFields": [], "managedFields": [{"manager": "m"}]}, "spec": {}}"#,
            r#"{"metadata": {"name": "a"}, "metadata": {"name": "b"}, "spec": {}}"#,
            r#"{"metadata": null, "spec": {}}"#,
            r#"{"spec": {}}"#,
            r#"{"metadata": [], "spec": {}}"#,
            r#"{"metadata": {"name": "b", "managedFields": null}, "spec": {}, "status": null}"#,
        ];
        for object in same {
            let whole = serde_json::from_str::<CustomRun>(object).map(|mut r| {
                r.metadata.managed_fields = None;
                serde_json::to_value(r).unwrap()
            });
            let read = serde_json::from_str::<Unmanaged<CustomRun>>(object).map(|r| serde_json::to_value(r.0).unwrap());
            match (&whole, &read) {
                (Ok(w), Ok(r)) => assert_eq!(w, r, "{object}"),
                (Err(_), Err(_)) => {}
                _ => panic!("{object}: whole {whole:?}, read {read:?}"),
            }
        }
        let malformed = r#"{"metadata": {"name": "b", "managedFields": "not a list"}, "spec": {}}"#;
        assert!(serde_json::from_str::<CustomRun>(malformed).is_err());
        assert_eq!(
            serde_json::from_str::<Unmanaged<CustomRun>>(malformed)
                .unwrap()
                .0
                .metadata
                .name
                .as_deref(),
            Some("b")
        );
    }

    /// Any JSON value, for the field managers' trees and for labels' values.
    fn any_json() -> impl proptest::strategy::Strategy<Value = serde_json::Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            "[a-z:.{}\\\"]{0,8}".prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
                proptest::collection::btree_map("[a-z:.]{1,6}", inner, 0..4)
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// A JSON object written with its fields in the given order (serde_json's maps sort them).
    fn object_in_order(fields: &[(String, String)], order: &[u8]) -> String {
        let mut fields: Vec<(usize, &(String, String))> = fields.iter().enumerate().collect();
        fields.sort_by_key(|(i, _)| order.get(*i).copied().unwrap_or(0));
        let fields: Vec<String> = fields.iter().map(|(_, (k, v))| format!("{k:?}: {v}")).collect();
        format!("{{{}}}", fields.join(", "))
    }

    proptest::proptest! {
        /// Whatever the field managers wrote, in whatever order the object's and its metadata's
        /// fields come, in a list or in a watch event with its type before or after the object,
        /// the object reads as the whole one does without its managedFields.
        #[test]
        fn any_object_reads_as_the_whole_one_without_managed_fields(
            trees in proptest::collection::vec(any_json(), 0..4),
            labels in proptest::collection::btree_map("[a-z./]{1,12}", "[a-z0-9]{0,8}", 0..4),
            order in proptest::collection::vec(proptest::prelude::any::<u8>(), 8),
            meta_order in proptest::collection::vec(proptest::prelude::any::<u8>(), 8),
            type_first in proptest::prelude::any::<bool>(),
        ) {
            let managed: Vec<serde_json::Value> = trees
                .into_iter()
                .enumerate()
                .map(|(i, tree)| json!({"manager": format!("m{i}"), "operation": "Update",
                    "fieldsType": "FieldsV1", "fieldsV1": {"f:junk": tree}}))
                .collect();
            let meta = object_in_order(
                &[
                    ("name".into(), r#""b""#.into()),
                    ("namespace".into(), r#""ci""#.into()),
                    ("resourceVersion".into(), r#""7""#.into()),
                    ("managedFields".into(), serde_json::to_string(&managed).unwrap()),
                    ("labels".into(), serde_json::to_string(&labels).unwrap()),
                    ("uid".into(), r#""u""#.into()),
                ],
                &meta_order,
            );
            let object = object_in_order(
                &[
                    ("apiVersion".into(), r#""tekton.dev/v1beta1""#.into()),
                    ("kind".into(), r#""CustomRun""#.into()),
                    ("metadata".into(), meta),
                    ("spec".into(), r#"{"customRef": {"apiVersion": "tartan.dev/v1alpha1", "kind": "MacBuild"},
                        "params": [{"name": "managedFields", "value": "kept"}]}"#.into()),
                    ("status".into(), r#"{"conditions": [{"type": "Succeeded", "status": "True"}]}"#.into()),
                ],
                &order,
            );
            let mut whole: CustomRun = serde_json::from_str(&object).unwrap();
            proptest::prop_assert_eq!(whole.metadata.managed_fields.as_ref().map(Vec::len), Some(managed.len()));
            whole.metadata.managed_fields = None;
            let whole = serde_json::to_value(&whole).unwrap();

            let read: Unmanaged<CustomRun> = serde_json::from_str(&object).unwrap();
            proptest::prop_assert_eq!(&serde_json::to_value(&read.0).unwrap(), &whole);

            let list = format!(r#"{{"metadata": {{"resourceVersion": "8"}}, "items": [{object}, {object}]}}"#);
            let list: kube::core::ObjectList<Unmanaged<CustomRun>> = serde_json::from_str(&list).unwrap();
            for item in &list.items {
                proptest::prop_assert_eq!(&serde_json::to_value(&item.0).unwrap(), &whole);
            }

            let event = if type_first {
                format!(r#"{{"type": "MODIFIED", "object": {object}}}"#)
            } else {
                format!(r#"{{"object": {object}, "type": "MODIFIED"}}"#)
            };
            match serde_json::from_str::<kube::core::WatchEvent<Unmanaged<CustomRun>>>(&event).unwrap() {
                kube::core::WatchEvent::Modified(run) => {
                    proptest::prop_assert_eq!(&serde_json::to_value(&run.0).unwrap(), &whole);
                }
                other => proptest::prop_assert!(false, "{other:?}"),
            }
        }
    }
}
