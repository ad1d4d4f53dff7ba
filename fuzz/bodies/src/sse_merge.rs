//! The streams of an n>1 request's groups merged (`pd_gateway::spread::SseMerge`, what
//! `proxy/relay.rs::relay_merged_stream` runs), each cut into random chunks and interleaved in
//! a random order.
//!
//! Properties: no group's retained `kv_transfer_params` reach the client (trusted or not: a
//! spread keeps no turn), each is handed to the caller to release instead; every choice sent
//! is one of the group's children moved by its offset; the merge is complete exactly when every
//! group sent `[DONE]`, and its end is `[DONE]`.

use pd_gateway::spread::SseMerge;
use serde_json::Value;

use crate::input::Input;
use crate::sse_stream::{assert_no_retained_params, client_events, cut, node_stream};

/// The target.
pub fn run(data: &[u8]) {
    crate::caught_panics_are_not_crashes();
    let mut input = Input::new(data);
    let k = 1 + input.below(4);
    let children: Vec<u32> = (0..k).map(|_| 1 + input.below(4) as u32).collect();
    let offsets: Vec<u32> = children
        .iter()
        .scan(0, |acc, c| {
            let o = *acc;
            *acc += c;
            Some(o)
        })
        .collect();
    let n: u32 = children.iter().sum();
    let streams: Vec<_> = children
        .iter()
        .map(|&c| node_stream(&mut input, c, false))
        .collect();
    let mut chunks: Vec<Vec<&[u8]>> = streams
        .iter()
        .map(|s| {
            let mut c = cut(&s.bytes, &mut input);
            c.reverse();
            c
        })
        .collect();
    let mut merge = SseMerge::new(offsets);
    let mut out = Vec::new();
    let mut leases = Vec::new();
    while chunks.iter().any(|c| !c.is_empty()) {
        let mut j = input.below(k);
        while chunks[j].is_empty() {
            j = (j + 1) % k;
        }
        let c = chunks[j].pop().expect("a chunk");
        out.extend_from_slice(&merge.feed(j, c));
        leases.extend(merge.take_leases());
    }
    assert_eq!(
        merge.complete(),
        streams.iter().all(|s| s.done),
        "complete() disagrees with the groups' [DONE]s"
    );
    let tail = merge.finish();
    assert!(tail.ends_with(b"data: [DONE]\n\n"));
    out.extend_from_slice(&tail);
    assert_no_retained_params(&out);
    // Every non-null params value a group sent is handed over for release. (A group whose
    // stream ends without `[DONE]` right after an event ended with `\r\r` keeps that event in
    // its framer: a `\r` last may be half of `\r\n`, and the merge learns of no end of a
    // group's stream; the relay answers such a stream as broken.)
    let sent = streams
        .iter()
        .flat_map(|s| &s.params)
        .filter(|p| !p.is_null())
        .count();
    if streams.iter().all(|s| s.done) {
        assert_eq!(
            leases.len(),
            sent,
            "params lost between the groups and the caller"
        );
    } else {
        assert!(leases.len() <= sent);
    }
    for e in client_events(&out) {
        let Some(v) = e.json() else { continue };
        if v.get("error").is_some() {
            continue;
        }
        assert!(v.get(pd_wire::kv::FIELD).is_none(), "params sent: {v}");
        for c in v
            .get("choices")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let i = c.get("index").and_then(Value::as_u64).unwrap_or(0);
            assert!(i < u64::from(n), "choice {i} of {n} children");
        }
    }
}
