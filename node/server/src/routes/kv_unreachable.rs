//! `x-pd-kv-unreachable`: on a decode node's answers, the producers it could not reach lately
//! (their KV side channels, `http://host:port`, comma-separated, at most
//! [`MAX_UNREACHABLE_NAMED`]): a pull from them ran past its deadline or was refused, and the
//! node computes those prompts itself for a while (`pd_kv_transfer::consumer::suspects`). Its
//! release of such a producer's lease cannot get through either; the gateway, which may still
//! reach the producer, releases the lease it had it grant for the request, instead of leaving
//! the blocks held until the lease expires. Absent when there is none.

use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderValue;
use axum::response::Response;

use crate::disagg::Disagg;

/// The header.
pub const KV_UNREACHABLE_HEADER: &str = "x-pd-kv-unreachable";

/// Producers named at most.
pub const MAX_UNREACHABLE_NAMED: usize = 16;

/// Adds [`KV_UNREACHABLE_HEADER`] to `resp` when this node's consumer has producers it could
/// not reach.
pub(crate) async fn name_unreachable(
    State(disagg): State<Arc<Disagg>>,
    mut resp: Response,
) -> Response {
    let Some(consumer) = &disagg.consumer else {
        return resp;
    };
    let mut peers = consumer.unreachable();
    if peers.is_empty() {
        return resp;
    }
    peers.sort();
    peers.truncate(MAX_UNREACHABLE_NAMED);
    if let Ok(v) = HeaderValue::from_str(&peers.join(",")) {
        resp.headers_mut().insert(KV_UNREACHABLE_HEADER, v);
    }
    resp
}
