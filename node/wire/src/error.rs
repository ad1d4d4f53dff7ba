//! The OpenAI error object: `{"error": {"message", "type", "param", "code"}}`, the body of every
//! failed request (from a node or from the gateway) and the last data frame of a stream that
//! failed after its 200.

use serde::{Deserialize, Serialize};

/// `{"error": {...}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorObject,
}

/// The OpenAI error object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorObject {
    /// What went wrong, for a person.
    pub message: String,
    /// The class: `invalid_request_error`, `rate_limit_error`, `upstream_error`, ...
    #[serde(rename = "type")]
    pub kind: String,
    /// The request field at fault, when one is.
    #[serde(default)]
    pub param: Option<String>,
    /// A machine-readable code (`model_not_found`, `invalid_api_key`, ...), when there is one.
    #[serde(default)]
    pub code: Option<String>,
}

impl ErrorBody {
    /// An error of class `kind`.
    pub fn new(kind: &str, message: impl Into<String>) -> Self {
        Self {
            error: ErrorObject {
                message: message.into(),
                kind: kind.to_owned(),
                param: None,
                code: None,
            },
        }
    }

    /// Names the request field at fault.
    #[must_use]
    pub fn param(mut self, param: Option<impl Into<String>>) -> Self {
        self.error.param = param.map(Into::into);
        self
    }

    /// Adds a machine-readable code.
    #[must_use]
    pub fn code(mut self, code: Option<impl Into<String>>) -> Self {
        self.error.code = code.map(Into::into);
        self
    }

    /// The JSON text.
    pub fn to_json(&self) -> String {
        // Strings only: serializing cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The `/v1/responses` stream's `error` event payload (`type`, `code`, `message`, `param`,
    /// and the error object itself), which the `openai` SDKs raise on.
    pub fn responses_event(&self) -> serde_json::Value {
        let e = &self.error;
        serde_json::json!({
            "type": "error",
            "code": e.code.as_deref().unwrap_or(&e.kind),
            "message": e.message,
            "param": e.param,
            "error": e,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_object_has_every_field_even_when_null() {
        let b = ErrorBody::new("invalid_request_error", "bad").param(Some("n"));
        let v: serde_json::Value = serde_json::from_str(&b.to_json()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"error": {"message": "bad", "type": "invalid_request_error",
                "param": "n", "code": null}})
        );
        assert_eq!(serde_json::from_value::<ErrorBody>(v).unwrap(), b);
        let ev = b.code(Some("x")).responses_event();
        assert_eq!(ev["code"], "x");
        assert_eq!(ev["error"]["message"], "bad");
    }
}
