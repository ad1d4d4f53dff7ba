//! The Endpoint Picker protocol's wire, on Envoy's `ext_proc` v3 types (`envoy-types`): the
//! headers and metadata read from a `ProcessingRequest`, and the `ProcessingResponse`s the
//! picker answers with. No state, no IO.
//!
//! The protocol (Gateway API Inference Extension, "Endpoint Picker Protocol"):
//! - the data plane MAY restrict the pick to a subset, in the request's metadata under
//!   `envoy.lb.subset_hint` → `x-gateway-destination-endpoint-subset` (a list of `ip:port`, or
//!   one comma-separated string);
//! - the picker names the endpoint in the `x-gateway-destination-endpoint` header and, the same
//!   value, in the dynamic metadata `envoy.lb` → `x-gateway-destination-endpoint`; further
//!   candidates under `x-gateway-destination-endpoint-fallback`;
//! - no endpoint: an immediate 503; a request to shed: an immediate 429;
//! - on the response the data plane reports the endpoint that served under `envoy.lb` →
//!   `x-gateway-destination-endpoint-served` (Envoy itself can report it as the
//!   `upstream.address` response attribute instead, which is read as well).

use std::collections::HashMap;

use envoy_types::pb::envoy::config::core::v3::{
    HeaderValue, HeaderValueOption, Metadata, header_value_option::HeaderAppendAction,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpHeaders,
    ImmediateResponse, ProcessingRequest, ProcessingResponse, TrailersResponse, body_mutation,
    processing_response,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};

use crate::error::GatewayError;

/// The header (and metadata key) naming the picked endpoint.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The metadata key of the fallback endpoints.
pub const FALLBACK: &str = "x-gateway-destination-endpoint-fallback";
/// The metadata key the data plane reports the serving endpoint under.
pub const SERVED: &str = "x-gateway-destination-endpoint-served";
/// The metadata key of the subset the pick must come from.
pub const SUBSET: &str = "x-gateway-destination-endpoint-subset";
/// The namespace of the picked and served endpoints.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The namespace of the subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// Envoy's own attribute for the upstream host's address (`response_attributes`).
pub const UPSTREAM_ADDRESS: &str = "upstream.address";
/// The namespace Envoy puts the attributes it sends under.
pub const ATTRIBUTES_NAMESPACE: &str = "envoy.filters.http.ext_proc";

/// A request's or response's headers as `(name, value)` pairs, names lower-case.
#[derive(Debug, Default, Clone)]
pub struct Headers(Vec<(String, String)>);

impl Headers {
    /// The headers of an `ext_proc` headers message (Envoy sends values in `raw_value`).
    pub fn of(h: &HttpHeaders) -> Self {
        let list = h.headers.as_ref().map_or_else(Vec::new, |m| {
            m.headers
                .iter()
                .map(|v| {
                    let value = if v.raw_value.is_empty() {
                        v.value.clone()
                    } else {
                        String::from_utf8_lossy(&v.raw_value).into_owned()
                    };
                    (v.key.to_ascii_lowercase(), value)
                })
                .collect()
        });
        Self(list)
    }

    /// The first value of `name` (lower-case).
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The bearer key of `authorization`.
    pub fn bearer(&self) -> Option<&str> {
        self.get("authorization")?.strip_prefix("Bearer ")
    }
}

/// The strings of a metadata value: a list of strings, or one comma-separated string.
fn strings(v: &Value) -> Vec<String> {
    match &v.kind {
        Some(Kind::StringValue(s)) => s
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect(),
        Some(Kind::ListValue(l)) => l.values.iter().flat_map(strings).collect(),
        _ => Vec::new(),
    }
}

/// `namespace` → `key` of a request's metadata context.
fn metadata_value<'a>(m: Option<&'a Metadata>, namespace: &str, key: &str) -> Option<&'a Value> {
    m?.filter_metadata.get(namespace)?.fields.get(key)
}

/// The subset the data plane restricts the pick to: `None` when it sets none (any endpoint
/// may be picked), `Some(empty)` when it sets an empty one (nothing may).
pub fn subset(req: &ProcessingRequest) -> Option<Vec<String>> {
    metadata_value(req.metadata_context.as_ref(), SUBSET_NAMESPACE, SUBSET).map(strings)
}

/// The endpoint the data plane reports as having served the request: the protocol's
/// metadata, else Envoy's `upstream.address` attribute.
pub fn served(req: &ProcessingRequest) -> Option<String> {
    let from_metadata = metadata_value(req.metadata_context.as_ref(), LB_NAMESPACE, SERVED);
    let from_attribute = || {
        let attrs: &HashMap<String, Struct> = &req.attributes;
        attrs
            .get(ATTRIBUTES_NAMESPACE)
            .and_then(|s| s.fields.get(UPSTREAM_ADDRESS))
    };
    from_metadata
        .or_else(from_attribute)
        .and_then(|v| strings(v).into_iter().next())
}

fn string_value(s: impl Into<String>) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.into())),
    }
}

fn set_header(name: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: name.to_owned(),
            raw_value: value.as_bytes().to_vec(),
            ..HeaderValue::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..HeaderValueOption::default()
    }
}

/// What the picker tells the data plane about one request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pick {
    /// The endpoint (`ip:port`).
    pub primary: String,
    /// Endpoints to try after it, best first.
    pub fallback: Vec<String>,
    /// Headers to set on the request (the prefill node's address for a split).
    pub set: Vec<(&'static str, String)>,
    /// Headers to remove from it (a client's own copy of what only the picker may set).
    pub remove: Vec<&'static str>,
    /// The body to send instead of the client's (its untrusted `kv_transfer_params` removed).
    pub body: Option<Vec<u8>>,
}

impl Pick {
    fn mutation(&self) -> HeaderMutation {
        let mut set_headers = vec![set_header(DESTINATION, &self.primary)];
        set_headers.extend(self.set.iter().map(|(k, v)| set_header(k, v)));
        HeaderMutation {
            set_headers,
            remove_headers: self.remove.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    fn metadata(&self) -> Struct {
        let mut lb = Struct::default();
        lb.fields
            .insert(DESTINATION.to_owned(), string_value(&self.primary));
        if !self.fallback.is_empty() {
            lb.fields
                .insert(FALLBACK.to_owned(), string_value(self.fallback.join(",")));
        }
        let mut top = Struct::default();
        top.fields.insert(
            LB_NAMESPACE.to_owned(),
            Value {
                kind: Some(Kind::StructValue(lb)),
            },
        );
        top
    }

    fn common(&self) -> CommonResponse {
        CommonResponse {
            header_mutation: Some(self.mutation()),
            body_mutation: self.body.clone().map(|b| BodyMutation {
                mutation: Some(body_mutation::Mutation::Body(b)),
            }),
            ..CommonResponse::default()
        }
    }

    /// The answer to a request's headers (a request without a body).
    pub fn on_headers(&self) -> ProcessingResponse {
        ProcessingResponse {
            dynamic_metadata: Some(self.metadata()),
            response: Some(processing_response::Response::RequestHeaders(
                HeadersResponse {
                    response: Some(self.common()),
                },
            )),
            ..ProcessingResponse::default()
        }
    }

    /// The answer to a request's (buffered) body.
    pub fn on_body(&self) -> ProcessingResponse {
        ProcessingResponse {
            dynamic_metadata: Some(self.metadata()),
            response: Some(processing_response::Response::RequestBody(BodyResponse {
                response: Some(self.common()),
            })),
            ..ProcessingResponse::default()
        }
    }
}

/// Go on unchanged, after the request's headers (its body comes next).
pub fn continue_headers() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::RequestHeaders(
            HeadersResponse::default(),
        )),
        ..ProcessingResponse::default()
    }
}

/// Go on unchanged, after a part of a streamed request body.
pub fn continue_body() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::RequestBody(
            BodyResponse::default(),
        )),
        ..ProcessingResponse::default()
    }
}

/// Go on unchanged, after the response's headers.
pub fn continue_response_headers() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::ResponseHeaders(
            HeadersResponse::default(),
        )),
        ..ProcessingResponse::default()
    }
}

/// Go on unchanged, after a part of the response body.
pub fn continue_response_body() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::ResponseBody(
            BodyResponse::default(),
        )),
        ..ProcessingResponse::default()
    }
}

/// Go on unchanged, after the request's (`response` false) or the response's trailers: a data
/// plane configured to send them waits for an answer.
pub fn continue_trailers(response: bool) -> ProcessingResponse {
    let go_on = TrailersResponse::default();
    ProcessingResponse {
        response: Some(if response {
            processing_response::Response::ResponseTrailers(go_on)
        } else {
            processing_response::Response::RequestTrailers(go_on)
        }),
        ..ProcessingResponse::default()
    }
}

/// Answer the client at once with `e` as an OpenAI error (and `retry-after` for a refusal that
/// passes, as the gateway's front door answers it).
pub fn immediate(e: &GatewayError) -> ProcessingResponse {
    let mut set_headers = vec![set_header("content-type", "application/json")];
    if let Some(seconds) = e.retry_after() {
        set_headers.push(set_header("retry-after", &seconds.to_string()));
    }
    ProcessingResponse {
        response: Some(processing_response::Response::ImmediateResponse(
            ImmediateResponse {
                status: Some(HttpStatus {
                    code: i32::from(e.status()),
                }),
                headers: Some(HeaderMutation {
                    set_headers,
                    remove_headers: Vec::new(),
                }),
                body: e.body().to_vec(),
                details: "pd_gateway_picker".to_owned(),
                ..ImmediateResponse::default()
            },
        )),
        ..ProcessingResponse::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::google::protobuf::ListValue;

    fn lb_request(namespace: &str, key: &str, v: Value) -> ProcessingRequest {
        let mut inner = Struct::default();
        inner.fields.insert(key.to_owned(), v);
        let mut m = Metadata::default();
        m.filter_metadata.insert(namespace.to_owned(), inner);
        ProcessingRequest {
            metadata_context: Some(m),
            ..ProcessingRequest::default()
        }
    }

    #[test]
    fn the_subset_reads_as_a_list_or_a_joined_string_and_absent_means_any() {
        let list = Value {
            kind: Some(Kind::ListValue(ListValue {
                values: vec![string_value("10.0.0.1:80"), string_value("10.0.0.2:80")],
            })),
        };
        let req = lb_request(SUBSET_NAMESPACE, SUBSET, list);
        assert_eq!(
            subset(&req),
            Some(vec!["10.0.0.1:80".to_owned(), "10.0.0.2:80".to_owned()])
        );
        let req = lb_request(SUBSET_NAMESPACE, SUBSET, string_value("a:1, b:2"));
        assert_eq!(subset(&req), Some(vec!["a:1".to_owned(), "b:2".to_owned()]));
        let req = lb_request(SUBSET_NAMESPACE, SUBSET, string_value(""));
        assert_eq!(subset(&req), Some(vec![]));
        assert_eq!(subset(&ProcessingRequest::default()), None);
    }

    #[test]
    fn served_comes_from_the_protocol_metadata_or_envoys_attribute() {
        let req = lb_request(LB_NAMESPACE, SERVED, string_value("10.0.0.9:8000"));
        assert_eq!(served(&req).as_deref(), Some("10.0.0.9:8000"));
        let req = lb_request(
            ATTRIBUTES_NAMESPACE,
            UPSTREAM_ADDRESS,
            string_value("1.2.3.4:5"),
        );
        let req = ProcessingRequest {
            attributes: req
                .metadata_context
                .unwrap()
                .filter_metadata
                .into_iter()
                .collect(),
            ..ProcessingRequest::default()
        };
        assert_eq!(served(&req).as_deref(), Some("1.2.3.4:5"));
        assert_eq!(served(&ProcessingRequest::default()), None);
    }

    #[test]
    fn a_pick_sets_the_header_and_the_same_value_in_envoy_lb() {
        let pick = Pick {
            primary: "10.0.0.1:8000".into(),
            fallback: vec!["10.0.0.2:8000".into(), "10.0.0.3:8000".into()],
            set: vec![("x-prefiller-host-port", "10.0.0.4:8000".into())],
            remove: vec!["x-other"],
            body: None,
        };
        let r = pick.on_body();
        let lb = &r.dynamic_metadata.as_ref().unwrap().fields[LB_NAMESPACE];
        let Some(Kind::StructValue(lb)) = &lb.kind else {
            panic!("envoy.lb is a struct")
        };
        assert_eq!(strings(&lb.fields[DESTINATION]), vec!["10.0.0.1:8000"]);
        assert_eq!(
            strings(&lb.fields[FALLBACK]),
            vec!["10.0.0.2:8000", "10.0.0.3:8000"]
        );
        let Some(processing_response::Response::RequestBody(b)) = r.response else {
            panic!("a body response")
        };
        let m = b.response.unwrap().header_mutation.unwrap();
        let set: Vec<(String, Vec<u8>)> = m
            .set_headers
            .iter()
            .map(|h| {
                let h = h.header.as_ref().unwrap();
                (h.key.clone(), h.raw_value.clone())
            })
            .collect();
        assert_eq!(
            set,
            vec![
                (DESTINATION.to_owned(), b"10.0.0.1:8000".to_vec()),
                (
                    "x-prefiller-host-port".to_owned(),
                    b"10.0.0.4:8000".to_vec()
                ),
            ]
        );
        assert_eq!(m.remove_headers, vec!["x-other"]);
    }
}
