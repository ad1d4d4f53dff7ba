//! Every way a gateway request can fail, where the fault lies, and the OpenAI error object each
//! becomes. As in pingora's error model, an error carries its source (the client, a node, the
//! gateway, the policy) so the status follows from it: the client's fault is a 4xx, a node's a
//! 502/503, the gateway's own a 500.

use bytes::Bytes;
use pd_policy::Api;
use pd_wire::{ErrorBody, sse};

/// Where a failure came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorSource {
    /// The client sent something wrong (4xx).
    Downstream,
    /// A node failed or refused (5xx, or the node's own 4xx passed through).
    Upstream,
    /// The gateway itself (500).
    Internal,
    /// The routing policy rejected or failed.
    Policy,
}

/// A failed request. Rendered as `{"error": {"message", "type", "param", "code"}}` with
/// [`GatewayError::status`].
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// The body is not JSON, or a field is wrong (400).
    #[error("{message}")]
    InvalidRequest {
        /// What is wrong, for the client.
        message: String,
        /// The field at fault, when known.
        param: Option<String>,
    },
    /// No node ever registered this model (404).
    #[error("The model `{0}` does not exist.")]
    ModelNotFound(String),
    /// `previous_response_id` names no stored response (404).
    #[error("{0}")]
    PreviousResponseNotFound(String),
    /// The state store did not answer when a response this gateway does not hold in memory
    /// had to be read from it (a `previous_response_id`, `GET` or `DELETE /v1/responses/{id}`)
    /// (503). Requests that need no stored state are served as usual.
    #[error(
        "Stored responses are unavailable right now (the gateway's state store does not answer: {0}); requests without previous_response_id are served. Retry later, or send the whole conversation in `input`."
    )]
    StateUnavailable(String),
    /// `GET` or `DELETE /v1/responses/{id}` of a response not stored (never was, `store: false`,
    /// evicted, expired or deleted) (404).
    #[error("Response with id '{0}' not found.")]
    ResponseNotFound(String),
    /// A `/v1/` call without one of the gateway's API keys, when it has some (401).
    #[error(
        "Incorrect API key provided: send one of the gateway's keys as `Authorization: Bearer KEY`."
    )]
    Unauthorized,
    /// Every slot of `--max-concurrent-requests` busy and the waiting line full, or the wait
    /// for a slot ran out (429).
    #[error("{}", overloaded_message(*.0))]
    Overloaded(crate::admission::Refused),
    /// No route for this path (404).
    #[error("Unknown request URL: {method} {path}. Please check the URL for typos.")]
    UnknownRoute {
        /// The request's method.
        method: String,
        /// The request's path.
        path: String,
    },
    /// The body is larger than the route's limit (413), said by its `content-length` or found
    /// while reading it.
    #[error("Request body is larger than the limit of {limit} bytes.")]
    PayloadTooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// The client did not send its request's head or body within the deadline (408).
    #[error("The {what} did not arrive within {} ms.", .limit.as_millis())]
    ReadTimeout {
        /// What was being read ("request head", "request body").
        what: &'static str,
        /// The deadline.
        limit: std::time::Duration,
    },
    /// The request ran past `--request-timeout-secs` (504).
    #[error("The request did not complete within {} s (the gateway's request timeout).", .limit.as_secs())]
    Timeout {
        /// The deadline.
        limit: std::time::Duration,
    },
    /// The model is registered but no live node can serve this request now (503).
    #[error("no live node can serve model `{model}` now: {why}")]
    NoCapacity {
        /// The requested model.
        model: String,
        /// Which role was missing, or that every candidate failed.
        why: String,
    },
    /// The policy refused the request with its own status.
    #[error("{message}")]
    Rejected {
        /// 400..=599, checked when the decision was validated.
        status: u16,
        /// The policy's message.
        message: String,
    },
    /// The policy failed and the operator chose to fail requests instead of falling back (503).
    #[error("the routing policy failed: {policy} {version}: {error}")]
    PolicyFailed {
        /// The policy's name.
        policy: String,
        /// Its version.
        version: String,
        /// How it failed.
        error: pd_policy::PolicyError,
    },
    /// A node answered with an error; its status and body are passed through.
    #[error("node error {status}")]
    Node {
        /// The node's status.
        status: u16,
        /// The node's body (an OpenAI error object).
        body: Bytes,
    },
    /// A node broke off or broke the protocol mid-answer (502).
    #[error("{0}")]
    BadGateway(#[from] NodeFailure),
    /// The gateway failed (500).
    #[error("internal error: {0}")]
    Internal(#[from] InternalError),
}

/// How a node failed a request it had started to answer.
#[derive(Debug, thiserror::Error)]
pub enum NodeFailure {
    /// The node left the cluster's view mid-answer and did not come back.
    #[error("{node} left the view mid-answer and did not come back")]
    Left {
        /// The node's engine id.
        node: String,
    },
    /// A decode node of a spread request left the view.
    #[error("a decode node left the view mid-answer and did not come back")]
    DecodeLeft,
    /// Reading a whole answer failed.
    #[error("node answer broke: {0}")]
    AnswerBroke(crate::upstream::UpstreamError),
    /// A streamed answer broke off.
    #[error("node stream broke: {0}")]
    StreamBroke(crate::upstream::UpstreamError),
    /// The node sent nothing more of its answer for `--node-idle-timeout-ms`.
    #[error("{node} sent nothing of its answer for {} ms", .after.as_millis())]
    Silent {
        /// The node's engine id (or address).
        node: String,
        /// The deadline it missed.
        after: std::time::Duration,
    },
    /// A spread request's decode node ended its stream without `[DONE]`.
    #[error("a decode node's stream ended early")]
    StreamEndedEarly,
    /// The spread children's answers could not be merged.
    #[error(transparent)]
    Merge(#[from] crate::spread::MergeError),
}

/// The gateway's own failures.
#[derive(Debug, thiserror::Error)]
pub enum InternalError {
    /// Writing JSON failed (a number serde_json cannot write).
    #[error("writing JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// A blocking task (tokenizing) panicked or was cancelled.
    #[error("a blocking task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
    /// The built-in fallback policy's decision did not validate.
    #[error("fallback policy: {0}")]
    Fallback(#[from] pd_policy::InvalidDecision),
    /// Rendering or tokenizing a prompt failed for a reason other than the request.
    #[error("{0}")]
    Prompt(String),
}

impl From<serde_json::Error> for GatewayError {
    fn from(e: serde_json::Error) -> Self {
        Self::Internal(InternalError::Json(e))
    }
}

impl From<tokio::task::JoinError> for GatewayError {
    fn from(e: tokio::task::JoinError) -> Self {
        Self::Internal(InternalError::Task(e))
    }
}

fn overloaded_message(why: crate::admission::Refused) -> &'static str {
    match why {
        crate::admission::Refused::QueueFull => {
            "The gateway is serving as many requests as it may and its waiting line is full; retry later."
        }
        crate::admission::Refused::QueueTimeout => {
            "The gateway is serving as many requests as it may and none finished while this one waited; retry later."
        }
    }
}

impl GatewayError {
    /// A 400 naming `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::InvalidRequest {
            message: message.into(),
            param: Some(param.into()),
        }
    }

    /// Where the failure came from.
    pub fn source_kind(&self) -> ErrorSource {
        match self {
            Self::InvalidRequest { .. }
            | Self::ModelNotFound(_)
            | Self::PreviousResponseNotFound(_)
            | Self::ResponseNotFound(_)
            | Self::UnknownRoute { .. }
            | Self::Overloaded(_)
            | Self::Unauthorized
            | Self::ReadTimeout { .. }
            | Self::PayloadTooLarge { .. } => ErrorSource::Downstream,
            Self::NoCapacity { .. }
            | Self::Node { .. }
            | Self::BadGateway(_)
            | Self::Timeout { .. } => ErrorSource::Upstream,
            Self::StateUnavailable(_) => ErrorSource::Internal,
            Self::Rejected { .. } | Self::PolicyFailed { .. } => ErrorSource::Policy,
            Self::Internal(_) => ErrorSource::Internal,
        }
    }

    /// The HTTP status.
    pub fn status(&self) -> u16 {
        match self {
            Self::InvalidRequest { .. } => 400,
            Self::Unauthorized => 401,
            Self::ModelNotFound(_)
            | Self::PreviousResponseNotFound(_)
            | Self::ResponseNotFound(_)
            | Self::UnknownRoute { .. } => 404,
            Self::ReadTimeout { .. } => 408,
            Self::PayloadTooLarge { .. } => 413,
            Self::Overloaded(_) => 429,
            Self::NoCapacity { .. } | Self::PolicyFailed { .. } | Self::StateUnavailable(_) => 503,
            Self::Rejected { status, .. } | Self::Node { status, .. } => *status,
            Self::BadGateway(NodeFailure::Silent { .. }) | Self::Timeout { .. } => 504,
            Self::BadGateway(_) => 502,
            Self::Internal(_) => 500,
        }
    }

    /// Seconds a client should wait before it retries (`retry-after`), for a refusal that
    /// passes: overload, no live node, the state store out.
    pub fn retry_after(&self) -> Option<u64> {
        match self {
            Self::Overloaded(_) | Self::NoCapacity { .. } | Self::StateUnavailable(_) => Some(1),
            _ => None,
        }
    }

    /// The `outcome` label of the request counter.
    pub fn outcome(&self) -> &'static str {
        if let Self::Node { status, .. } = self
            && *status < 500
        {
            // The node refused the request itself: the client's fault.
            return "client_error";
        }
        if let Self::Overloaded(_) = self {
            return "overloaded";
        }
        if let Self::StateUnavailable(_) = self {
            return "state_unavailable";
        }
        if let Self::Timeout { .. } | Self::BadGateway(NodeFailure::Silent { .. }) = self {
            return "timeout";
        }
        match self.source_kind() {
            ErrorSource::Downstream => "client_error",
            ErrorSource::Upstream => "node_error",
            ErrorSource::Policy => "rejected",
            ErrorSource::Internal => "internal_error",
        }
    }

    /// The response body: the node's own for [`GatewayError::Node`], else an OpenAI error object.
    pub fn body(&self) -> Bytes {
        if let Self::Node { body, .. } = self {
            return body.clone();
        }
        let (kind, code) = match self {
            Self::InvalidRequest { .. }
            | Self::PayloadTooLarge { .. }
            | Self::ResponseNotFound(_) => ("invalid_request_error", None),
            Self::ModelNotFound(_) => ("invalid_request_error", Some("model_not_found")),
            Self::PreviousResponseNotFound(_) => {
                ("invalid_request_error", Some("previous_response_not_found"))
            }
            Self::UnknownRoute { .. } => ("invalid_request_error", Some("unknown_url")),
            Self::ReadTimeout { .. } => ("invalid_request_error", Some("request_timeout")),
            Self::Timeout { .. } | Self::BadGateway(NodeFailure::Silent { .. }) => {
                ("timeout_error", Some("timeout"))
            }
            Self::Unauthorized => ("invalid_request_error", Some("invalid_api_key")),
            Self::Overloaded(_) => ("rate_limit_error", Some("rate_limit_exceeded")),
            Self::Rejected { .. } => ("invalid_request_error", Some("policy_rejected")),
            Self::NoCapacity { .. } | Self::PolicyFailed { .. } => {
                ("service_unavailable_error", Some("no_capacity"))
            }
            Self::BadGateway(_) | Self::Node { .. } => ("upstream_error", None),
            Self::StateUnavailable(_) => ("service_unavailable_error", Some("state_unavailable")),
            Self::Internal(_) => ("internal_error", None),
        };
        let param = match self {
            Self::InvalidRequest { param, .. } => param.clone(),
            Self::PreviousResponseNotFound(_) => Some("previous_response_id".to_owned()),
            _ => None,
        };
        let body = ErrorBody::new(kind, self.to_string())
            .param(param)
            .code(code);
        Bytes::from(body.to_json())
    }

    /// The error as the last event of a stream already under way (its 200 is sent): on chat and
    /// completions the error object as a data frame (what vLLM and our nodes write), on
    /// `/v1/responses` an `error` event (`type`, `code`, `message`, `param`) that also carries
    /// the error object, so that the `openai` SDKs raise instead of ending the stream quietly.
    pub fn stream_event(&self, api: Api) -> Bytes {
        let body = self.body();
        let mut out = Vec::with_capacity(body.len() + 96);
        match api {
            Api::Responses => {
                let event = match serde_json::from_slice::<ErrorBody>(&body) {
                    Ok(e) => e.responses_event(),
                    // A node's own body that is not an error object: its text as the message.
                    Err(_) => ErrorBody::new("upstream_error", String::from_utf8_lossy(&body))
                        .responses_event(),
                };
                sse::write_json(&mut out, Some("error"), &event);
            }
            Api::ChatCompletions | Api::Completions => {
                sse::write_event(&mut out, None, &String::from_utf8_lossy(&body));
            }
        }
        Bytes::from(out)
    }
}

/// An error and its causes, `: `-joined (hyper's or wasmtime's own message alone says little,
/// e.g. "client error (Connect)").
pub(crate) fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cause = c.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_follow_the_source() {
        let e = GatewayError::ModelNotFound("m".into());
        assert_eq!(e.status(), 404);
        let v: serde_json::Value = serde_json::from_slice(&e.body()).unwrap();
        assert_eq!(v["error"]["code"], "model_not_found");
        assert_eq!(
            GatewayError::from(NodeFailure::StreamEndedEarly).status(),
            502
        );
        assert_eq!(
            GatewayError::Rejected {
                status: 429,
                message: "slow down".into()
            }
            .status(),
            429
        );
        let e = GatewayError::invalid("messages", "bad");
        let v: serde_json::Value = serde_json::from_slice(&e.body()).unwrap();
        assert_eq!(v["error"]["param"], "messages");
        assert_eq!(e.outcome(), "client_error");
        assert_eq!(e.retry_after(), None);
    }

    /// A store outage is its own outcome (not an internal error) and, like no capacity, a 503
    /// the client retries after a second.
    #[test]
    fn passing_refusals_say_when_to_retry() {
        let e = GatewayError::StateUnavailable("down".into());
        assert_eq!(
            (e.status(), e.outcome(), e.retry_after()),
            (503, "state_unavailable", Some(1))
        );
        let e = GatewayError::NoCapacity {
            model: "m".into(),
            why: "none".into(),
        };
        assert_eq!((e.status(), e.retry_after()), (503, Some(1)));
    }

    #[test]
    fn a_stream_ends_with_an_error_event_the_sdks_raise_on() {
        let e = GatewayError::from(NodeFailure::Left { node: "d0".into() });
        for api in [Api::ChatCompletions, Api::Completions] {
            let ev = e.stream_event(api);
            let data = ev
                .strip_prefix(b"data: ")
                .and_then(|d| d.strip_suffix(b"\n\n"))
                .expect("one data frame");
            let v: serde_json::Value = serde_json::from_slice(data).unwrap();
            assert_eq!(v["error"]["type"], "upstream_error");
            assert_eq!(
                v["error"]["message"],
                "d0 left the view mid-answer and did not come back"
            );
        }
        let ev = e.stream_event(Api::Responses);
        let data = ev
            .strip_prefix(b"event: error\ndata: ")
            .and_then(|d| d.strip_suffix(b"\n\n"))
            .expect("one error event");
        let v: serde_json::Value = serde_json::from_slice(data).unwrap();
        assert_eq!(v["type"], "error");
        assert_eq!(v["code"], "upstream_error");
        assert_eq!(v["message"], v["error"]["message"]);
    }
}
