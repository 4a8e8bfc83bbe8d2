//! The emulator's clock, on its own so that the store and the built-in types (a CRD's status)
//! both read it without depending on each other.

/// Current time as the apiserver writes `metav1.Time` (RFC 3339, whole seconds, UTC).
pub fn now() -> String {
    let t = k8s_openapi::jiff::Timestamp::now();
    k8s_openapi::jiff::Timestamp::from_second(t.as_second())
        .map(|t| t.to_string())
        .unwrap_or_default()
}
