//! `metav1.Status` errors with the codes, reasons and messages kube-apiserver uses.

use serde_json::{Map, Value, json};

use super::schema::FieldError;

/// An API error, rendered as a `Status` object.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub code: u16,
    pub reason: &'static str,
    pub message: String,
    pub details: Option<Value>,
}

/// Group and resource (plural) of the object an error is about, e.g. `macbuilds.tartan.dev`.
#[derive(Debug, Clone)]
pub struct GroupResource<'a> {
    pub group: &'a str,
    pub resource: &'a str,
}

impl GroupResource<'_> {
    pub fn qualified(&self) -> String {
        if self.group.is_empty() {
            self.resource.to_string()
        } else {
            format!("{}.{}", self.resource, self.group)
        }
    }

    fn details(&self, name: &str) -> Value {
        let mut d = Map::new();
        if !name.is_empty() {
            d.insert("name".into(), json!(name));
        }
        if !self.group.is_empty() {
            d.insert("group".into(), json!(self.group));
        }
        d.insert("kind".into(), json!(self.resource));
        Value::Object(d)
    }
}

impl ApiError {
    pub fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            code,
            reason,
            message: message.into(),
            details: None,
        }
    }

    pub fn with_details(mut self, details: Value) -> Self {
        self.details = Some(details);
        self
    }

    pub fn not_found(gr: &GroupResource, name: &str) -> Self {
        Self::new(404, "NotFound", format!("{} \"{}\" not found", gr.qualified(), name)).with_details(gr.details(name))
    }

    pub fn already_exists(gr: &GroupResource, name: &str) -> Self {
        Self::new(
            409,
            "AlreadyExists",
            format!("{} \"{}\" already exists", gr.qualified(), name),
        )
        .with_details(gr.details(name))
    }

    pub fn conflict(gr: &GroupResource, name: &str, why: &str) -> Self {
        Self::new(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {} \"{}\": {}",
                gr.qualified(),
                name,
                why
            ),
        )
        .with_details(gr.details(name))
    }

    pub fn stale(gr: &GroupResource, name: &str) -> Self {
        Self::conflict(
            gr,
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        )
    }

    /// 422 Invalid, as `errors.NewInvalid(GroupKind, name, errs)` builds it.
    pub fn invalid(group: &str, kind: &str, name: &str, errs: &[FieldError]) -> Self {
        let qualified_kind = if group.is_empty() {
            kind.to_string()
        } else {
            format!("{kind}.{group}")
        };
        let rendered: Vec<String> = errs.iter().map(FieldError::to_string).collect();
        let agg = match rendered.len() {
            1 => rendered[0].clone(),
            _ => format!("[{}]", rendered.join(", ")),
        };
        let causes: Vec<Value> = errs
            .iter()
            .map(|e| json!({"reason": e.reason(), "message": e.body(), "field": e.field}))
            .collect();
        let mut details = Map::new();
        if !name.is_empty() {
            details.insert("name".into(), json!(name));
        }
        if !group.is_empty() {
            details.insert("group".into(), json!(group));
        }
        details.insert("kind".into(), json!(kind));
        details.insert("causes".into(), Value::Array(causes));
        Self::new(422, "Invalid", format!("{qualified_kind} \"{name}\" is invalid: {agg}"))
            .with_details(Value::Object(details))
    }

    /// `errors.NewForbidden(resource, name, err)`.
    pub fn forbidden(gr: &GroupResource, name: &str, why: &str) -> Self {
        let message = if name.is_empty() {
            format!("{} is forbidden: {}", gr.qualified(), why)
        } else {
            format!("{} \"{}\" is forbidden: {}", gr.qualified(), name, why)
        };
        Self::new(403, "Forbidden", message).with_details(gr.details(name))
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequest", message)
    }

    pub fn method_not_allowed() -> Self {
        Self::new(
            405,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource",
        )
    }

    pub fn unsupported_media_type(content_type: &str, accepted: &[&str]) -> Self {
        Self::new(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format - accepted media types include: {}",
                accepted.join(", ")
            ),
        )
        .with_details(json!({"causes": [{"reason": "UnsupportedMediaType", "message": content_type}]}))
    }

    /// A 404 for a path that names no served resource (`errors.NewNotFound` with empty resource).
    pub fn no_route() -> Self {
        Self::new(404, "NotFound", "the server could not find the requested resource").with_details(json!({}))
    }

    pub fn expired(message: String) -> Self {
        Self::new(410, "Expired", message)
    }

    pub fn unavailable() -> Self {
        Self::new(
            503,
            "ServiceUnavailable",
            "the server is currently unable to handle the request",
        )
    }

    pub fn internal(message: impl std::fmt::Display) -> Self {
        Self::new(500, "InternalError", format!("Internal error occurred: {message}"))
    }

    pub fn to_status(&self) -> Value {
        let mut s = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if let Some(d) = &self.details {
            s["details"] = d.clone();
        }
        s
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.code, self.reason, self.message)
    }
}

impl std::error::Error for ApiError {}

pub type ApiResult<T> = Result<T, ApiError>;
