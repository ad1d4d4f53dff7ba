//! A decode node's stream through the gateway's capture (`pd_gateway::answer::SseCapture`, what
//! `proxy/relay.rs` runs every relayed stream through), cut into random chunks.
//!
//! Properties: for an untrusted client no retained turn's `kv_transfer_params` reach the
//! client, whatever the chunking; a trusted client gets the node's bytes unchanged; the bytes
//! sent and what was captured do not depend on the chunking.

use bytes::Bytes;
use pd_gateway::answer::{Capture, SseCapture};
use pd_policy::Api;

use crate::input::Input;
use crate::sse_stream::{assert_no_retained_params, cut, node_stream};

fn through(capture: Capture, chunks: &[&[u8]]) -> (Vec<u8>, pd_gateway::answer::Captured) {
    let mut sse = SseCapture::new(capture);
    let mut out = Vec::new();
    for c in chunks {
        out.extend_from_slice(&sse.feed(Bytes::copy_from_slice(c)));
    }
    out.extend_from_slice(&sse.finish());
    (out, sse.captured)
}

/// The target.
pub fn run(data: &[u8]) {
    crate::caught_panics_are_not_crashes();
    let mut input = Input::new(data);
    let api = input.pick(&[Api::ChatCompletions, Api::Completions, Api::Responses]);
    let capture = Capture {
        api,
        hide_params: input.bool(),
        want_response: input.bool(),
    };
    let node = node_stream(&mut input, 1, matches!(api, Api::Responses));
    let chunks = cut(&node.bytes, &mut input);
    let (out, captured) = through(capture, &chunks);
    let (whole, whole_captured) = through(capture, &[&node.bytes]);
    assert_eq!(
        out, whole,
        "the bytes sent depend on how the node's stream was cut"
    );
    assert_eq!(captured, whole_captured);
    if capture.hide_params {
        assert_no_retained_params(&out);
    } else {
        assert_eq!(out, node.bytes, "a trusted client's stream was changed");
    }
}
