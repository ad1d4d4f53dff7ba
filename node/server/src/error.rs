//! Every way an API request can fail, and how each maps to a status and an OpenAI error object.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use pd_engine::EngineError;

use pd_wire::ErrorBody;

/// A failed API request. Rendered as `{"error": {"message", "type", "param", "code"}}` with the
/// status of [`ApiError::status`].
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The request body is not JSON, or not the JSON this endpoint takes (400).
    #[error("{message}")]
    InvalidRequest {
        /// What is wrong, for the client.
        message: String,
        /// The request field at fault, when known.
        param: Option<String>,
    },
    /// The request names a model this node does not serve (404).
    #[error("The model `{0}` does not exist.")]
    ModelNotFound(String),
    /// No route matches the path (404).
    #[error("Unknown request URL: {method} {path}. Please check the URL for typos.")]
    UnknownRoute {
        /// The request's method.
        method: String,
        /// The request's path.
        path: String,
    },
    /// The route exists but not for this method (405).
    #[error("Method {method} is not allowed for {path}.")]
    MethodNotAllowed {
        /// The request's method.
        method: String,
        /// The request's path.
        path: String,
    },
    /// `/v1/` without the node's API key (401).
    #[error(
        "Incorrect API key provided: send the node's key (--api-key) as `Authorization: Bearer KEY`."
    )]
    InvalidApiKey,
    /// The body is larger than the limit (413).
    #[error("Request body is larger than the limit of {limit} bytes.")]
    PayloadTooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// The engine refused the request or is gone (400 when invalid, 503 when shut down, else 500).
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The tokenizer failed on input that should have been valid (500).
    #[error("tokenizer error: {0}")]
    Tokenize(#[from] pd_tokenize::TokenizeError),
    /// The engine failed while running the request (500).
    #[error("generation failed: {0}")]
    GenerationFailed(String),
    /// The engine's event stream ended before every child finished (503).
    #[error("the engine stopped before the request finished")]
    EngineStopped,
    /// A blocking helper task panicked or was cancelled (500).
    #[error("internal task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
    /// The prefill node named in `x-prefiller-host-port` could not be asked, or answered with
    /// nothing to pull (502).
    #[error("the prefill node {addr} failed: {why}")]
    PrefillFailed {
        /// The node, as the header named it.
        addr: String,
        /// What went wrong.
        why: String,
    },
}

impl ApiError {
    /// A 400 naming `param`.
    pub(crate) fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::InvalidRequest {
            message: message.into(),
            param: Some(param.into()),
        }
    }

    /// Renames the engine's `param` (it speaks `max_tokens`, `logprobs`) to the field this
    /// endpoint's client actually sent (`max_completion_tokens`, `top_logprobs`...).
    pub(crate) fn rename_param(mut self, from: &str, to: &'static str) -> Self {
        if let Self::Engine(EngineError::Invalid(invalid)) = &mut self
            && invalid.param == Some(from)
        {
            invalid.param = Some(to);
        }
        self
    }

    /// The HTTP status this error is answered with.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::InvalidRequest { .. } => StatusCode::BAD_REQUEST,
            Self::ModelNotFound(_) | Self::UnknownRoute { .. } => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            Self::InvalidApiKey => StatusCode::UNAUTHORIZED,
            Self::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Engine(EngineError::Invalid(_)) => StatusCode::BAD_REQUEST,
            Self::Engine(EngineError::Shutdown | EngineError::LeaseCapacity { .. })
            | Self::EngineStopped => StatusCode::SERVICE_UNAVAILABLE,
            Self::Engine(_) | Self::Tokenize(_) | Self::GenerationFailed(_) | Self::Task(_) => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
            Self::PrefillFailed { .. } => StatusCode::BAD_GATEWAY,
        }
    }

    /// The OpenAI `error.type`.
    pub fn error_type(&self) -> &'static str {
        let status = self.status();
        if status == StatusCode::SERVICE_UNAVAILABLE {
            "service_unavailable_error"
        } else if status.is_server_error() {
            "server_error"
        } else {
            "invalid_request_error"
        }
    }

    /// The OpenAI `error.param`: the request field at fault.
    pub fn param(&self) -> Option<&str> {
        match self {
            Self::InvalidRequest { param, .. } => param.as_deref(),
            Self::ModelNotFound(_) => Some("model"),
            Self::Engine(EngineError::Invalid(invalid)) => invalid.param,
            _ => None,
        }
    }

    /// The OpenAI `error.code`: a stable machine-readable name, where there is one.
    pub fn code(&self) -> Option<&'static str> {
        match self {
            Self::ModelNotFound(_) => Some("model_not_found"),
            Self::UnknownRoute { .. } => Some("unknown_url"),
            Self::MethodNotAllowed { .. } => Some("method_not_allowed"),
            Self::PayloadTooLarge { .. } => Some("payload_too_large"),
            Self::InvalidApiKey => Some("invalid_api_key"),
            Self::Engine(EngineError::Shutdown) | Self::EngineStopped => Some("engine_unavailable"),
            Self::Engine(EngineError::LeaseCapacity { .. }) => Some("kv_lease_capacity"),
            Self::PrefillFailed { .. } => Some("prefill_failed"),
            _ => None,
        }
    }

    /// The JSON body of this error.
    pub(crate) fn to_body(&self) -> ErrorBody {
        ErrorBody::new(self.error_type(), self.to_string())
            .param(self.param())
            .code(self.code())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::error!(status = status.as_u16(), error = %self, "request failed");
        } else {
            tracing::debug!(status = status.as_u16(), error = %self, "request rejected");
        }
        (status, axum::Json(self.to_body())).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_errors_map_to_status_and_param() {
        let invalid = ApiError::from(EngineError::Invalid(pd_engine::InvalidRequest {
            message: "n must be between 1 and 128".into(),
            param: Some("n"),
        }));
        assert_eq!(invalid.status(), StatusCode::BAD_REQUEST);
        assert_eq!(invalid.error_type(), "invalid_request_error");
        assert_eq!(invalid.param(), Some("n"));

        let gone = ApiError::from(EngineError::Shutdown);
        assert_eq!(gone.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(gone.to_body().error.kind, "service_unavailable_error");
    }

    #[test]
    fn unknown_model_is_404_with_code() {
        let e = ApiError::ModelNotFound("gpt-x".into());
        assert_eq!(e.status(), StatusCode::NOT_FOUND);
        assert_eq!(e.code(), Some("model_not_found"));
        assert_eq!(e.param(), Some("model"));
    }
}
