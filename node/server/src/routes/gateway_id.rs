//! `x-pd-gateway-id`: the gateway a request came through (the `gateway_id` of its
//! `RegisterAck`). A prefill node tags the leases it grants for the request with it, and
//! releases them when that gateway's registry stream ends (`crate::report`), so a gateway that
//! died does not leave its leases to their deadline.

use std::sync::Arc;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;

/// The header a gateway names itself in on every request it posts to a node.
pub const GATEWAY_ID_HEADER: &str = "x-pd-gateway-id";

/// Longest gateway id taken; a longer one is ignored (the request's leases stay untagged).
pub const MAX_GATEWAY_ID_BYTES: usize = 128;

/// The request's [`GATEWAY_ID_HEADER`], when present, non-empty, at most
/// [`MAX_GATEWAY_ID_BYTES`] and printable ASCII; `None` otherwise (never a rejection).
#[derive(Debug, Clone, Default)]
pub(crate) struct GatewayId(pub(crate) Option<Arc<str>>);

impl GatewayId {
    /// Reads it from `headers`.
    pub(crate) fn from_headers(headers: &axum::http::HeaderMap) -> Self {
        let id = headers
            .get(GATEWAY_ID_HEADER)
            .and_then(|v| v.to_str().ok())
            .filter(|v| {
                !v.is_empty()
                    && v.len() <= MAX_GATEWAY_ID_BYTES
                    && v.bytes().all(|b| b.is_ascii_graphic())
            })
            .map(Arc::from);
        Self(id)
    }
}

impl<S: Send + Sync> FromRequestParts<S> for GatewayId {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(Self::from_headers(&parts.headers))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::{HeaderMap, HeaderValue};

    fn of(value: &[u8]) -> Option<Arc<str>> {
        let mut h = HeaderMap::new();
        h.insert(
            GATEWAY_ID_HEADER,
            HeaderValue::from_bytes(value).expect("a header value"),
        );
        GatewayId::from_headers(&h).0
    }

    #[test]
    fn a_bounded_printable_id_is_taken_anything_else_ignored() {
        assert_eq!(of(b"pd-gateway-1a2b").as_deref(), Some("pd-gateway-1a2b"));
        let longest = "g".repeat(MAX_GATEWAY_ID_BYTES);
        assert_eq!(of(longest.as_bytes()).as_deref(), Some(longest.as_str()));
        assert_eq!(of("g".repeat(MAX_GATEWAY_ID_BYTES + 1).as_bytes()), None);
        assert_eq!(of(b""), None);
        assert_eq!(of(b"has space"), None);
        assert_eq!(of(b"caf\xc3\xa9"), None);
        assert_eq!(GatewayId::from_headers(&HeaderMap::new()).0, None);
    }
}
