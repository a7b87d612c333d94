//! API errors and the `Status` objects that carry them.

use std::fmt;

use serde_json::{json, Value};

use super::resources::ResourceType;

/// A failed request, as the server reports it in a `Status` body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status code (404, 409, ...).
    pub code: u16,
    /// Machine-readable reason (`NotFound`, `Conflict`, ...).
    pub reason: String,
    pub message: String,
    /// `details` of the Status (name, group, kind, causes), if any.
    pub details: Option<Value>,
    /// Sent as `Retry-After` and `details.retryAfterSeconds`.
    pub retry_after_seconds: Option<u64>,
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}: {}", self.code, self.reason, self.message)
    }
}

impl std::error::Error for ApiError {}

/// The reason Kubernetes gives for a status code.
pub fn reason_for(code: u16) -> &'static str {
    match code {
        400 => "BadRequest",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "NotFound",
        405 => "MethodNotAllowed",
        406 => "NotAcceptable",
        409 => "Conflict",
        410 => "Expired",
        413 => "RequestEntityTooLarge",
        415 => "UnsupportedMediaType",
        422 => "Invalid",
        429 => "TooManyRequests",
        500 => "InternalError",
        503 => "ServiceUnavailable",
        504 => "Timeout",
        _ => "Unknown",
    }
}

impl ApiError {
    /// An error with the usual reason for `code`.
    pub fn new(code: u16, message: impl Into<String>) -> Self {
        Self {
            code,
            reason: reason_for(code).to_string(),
            message: message.into(),
            details: None,
            retry_after_seconds: None,
        }
    }

    fn with_details(mut self, rt: &ResourceType, name: &str) -> Self {
        let mut details = json!({"name": name, "kind": rt.plural});
        if !rt.group.is_empty() {
            details["group"] = json!(rt.group);
        }
        self.details = Some(details);
        self
    }

    pub fn not_found(rt: &ResourceType, name: &str) -> Self {
        Self::new(404, format!("{} \"{name}\" not found", rt.qualified_name()))
            .with_details(rt, name)
    }

    pub fn already_exists(rt: &ResourceType, name: &str) -> Self {
        Self::new(
            409,
            format!("{} \"{name}\" already exists", rt.qualified_name()),
        )
        .with_details(rt, name)
        .reason("AlreadyExists")
    }

    pub fn conflict(rt: &ResourceType, name: &str, why: &str) -> Self {
        Self::new(
            409,
            format!(
                "Operation cannot be fulfilled on {} \"{name}\": {why}",
                rt.qualified_name()
            ),
        )
        .with_details(rt, name)
    }

    pub fn stale(rt: &ResourceType, name: &str) -> Self {
        Self::conflict(
            rt,
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        )
    }

    /// 422 Invalid: `field` failed validation.
    pub fn invalid(rt: &ResourceType, name: &str, field: &str, problem: &str) -> Self {
        let mut err = Self::new(
            422,
            format!("{} \"{name}\" is invalid: {field}: {problem}", rt.kind),
        )
        .with_details(rt, name);
        if let Some(details) = err.details.as_mut() {
            details["kind"] = json!(rt.kind);
            details["causes"] =
                json!([{"reason": "FieldValueInvalid", "message": problem, "field": field}]);
        }
        err
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, message)
    }

    pub fn expired(message: impl Into<String>) -> Self {
        Self::new(410, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(500, message)
    }

    pub fn reason(mut self, reason: &str) -> Self {
        self.reason = reason.to_string();
        self
    }

    /// The `Status` object for this error.
    pub fn to_status(&self) -> Value {
        let mut status = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        let mut details = self.details.clone();
        if let Some(secs) = self.retry_after_seconds {
            details.get_or_insert_with(|| json!({}))["retryAfterSeconds"] = json!(secs);
        }
        if let Some(details) = details {
            status["details"] = details;
        }
        status
    }
}
