//! A decode node's SSE stream as the SSE targets feed it to the gateway: events a node (ours or
//! vLLM) writes, built from the fuzzer's bytes — chunks, usage chunks, a retained turn's
//! `kv_transfer_params` in the last chunk or in `response.completed`, comments, errors, `[DONE]`,
//! junk — framed with any of the three line endings and with data split over lines between JSON
//! tokens; then cut into chunks at points the fuzzer picks. And the client's side: whether what
//! the gateway sent shows a retained turn's params.

use pd_wire::sse::{Event, Framer};
use serde_json::{Value, json};

use crate::input::Input;

/// What a node's answer may carry as `kv_transfer_params`: mostly a retained turn
/// (`do_remote_decode: true`), sometimes another shape.
pub fn params(input: &mut Input<'_>) -> Value {
    let mut retained = json!({
        "do_remote_decode": true,
        "do_remote_prefill": false,
        "remote_engine_id": input.string(8),
        "remote_block_ids": [input.byte(), input.byte()],
        "remote_host": "10.0.0.2",
        "remote_port": input.u16(),
        "remote_num_tokens": input.below(64),
        "remote_lease_id": format!("{:032x}", u128::from(input.u64())),
        "remote_lease_generation": input.u32(),
    });
    if input.bool() {
        retained[input.string(6)] = Value::String(input.string(6));
    }
    match input.byte() % 8 {
        0 => Value::Null,
        1 => json!({"do_remote_decode": false, "remote_engine_id": "d"}),
        2 => json!({"remote_engine_id": "d"}),
        _ => retained,
    }
}

/// Whether `v` is a retained turn's params (what an untrusted client must never see).
pub fn is_retained(v: Option<&Value>) -> bool {
    v.and_then(|p| p.get("do_remote_decode")) == Some(&Value::Bool(true))
}

/// `s` (serialized JSON) split after some commas between tokens: the data lines of one event.
fn split_lines(s: &str, input: &mut Input<'_>) -> Vec<String> {
    let mut cuts = Vec::new();
    let (mut in_string, mut escaped) = (false, false);
    for (i, c) in s.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if in_string => escaped = true,
            '"' => in_string = !in_string,
            ',' if !in_string && input.byte() < 32 => cuts.push(i + 1),
            _ => {}
        }
    }
    let mut lines = Vec::new();
    let mut at = 0;
    for c in cuts {
        lines.push(s[at..c].to_string());
        at = c;
    }
    lines.push(s[at..].to_string());
    lines
}

/// One event's text: optional `event:`/`id:` lines, the data lines, the blank line.
fn event(
    out: &mut Vec<u8>,
    input: &mut Input<'_>,
    name: Option<&str>,
    data: &str,
    json_data: bool,
) {
    let eol = input.pick(&["\n", "\r\n", "\r"]);
    if let Some(n) = name {
        out.extend_from_slice(format!("event: {n}{eol}").as_bytes());
    }
    if input.byte() < 16 {
        out.extend_from_slice(format!("id: {}{eol}", input.u16()).as_bytes());
    }
    let lines = if json_data {
        split_lines(data, input)
    } else {
        vec![data.to_string()]
    };
    for l in lines {
        let sep = if input.byte() < 16 { ":" } else { ": " };
        out.extend_from_slice(format!("data{sep}{l}{eol}").as_bytes());
    }
    out.extend_from_slice(eol.as_bytes());
}

/// A chunk of a chat or completions stream (choices `0..children`).
pub fn chunk(input: &mut Input<'_>, children: u32) -> Value {
    let mut v = json!({
        "id": format!("cmpl-{}", input.byte()),
        "object": "chat.completion.chunk",
        "choices": [{"index": input.below(children.max(1) as usize), "delta": {"content": input.string(12)}}],
    });
    if input.byte() < 32 {
        v["usage"] = json!({"prompt_tokens": input.byte(), "completion_tokens": input.byte(), "total_tokens": 3});
    }
    v
}

/// A whole node stream: its bytes, and the retained params it carried (in order).
#[derive(Debug, Default)]
pub struct NodeStream {
    /// The bytes the node wrote.
    pub bytes: Vec<u8>,
    /// Every `kv_transfer_params` value written (null included), in order.
    pub params: Vec<Value>,
    /// Whether it ended with `[DONE]`.
    pub done: bool,
}

/// A node's stream for the `children` completions of one group.
pub fn node_stream(input: &mut Input<'_>, children: u32, responses: bool) -> NodeStream {
    let mut s = NodeStream::default();
    for _ in 0..input.below(10) {
        match input.byte() % 9 {
            0..=2 => {
                let c = chunk(input, children);
                event(&mut s.bytes, input, None, &c.to_string(), true);
            }
            3 => {
                let p = params(input);
                s.params.push(p.clone());
                let v = json!({"id": "cmpl-9", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}, "kv_transfer_params": p});
                event(&mut s.bytes, input, None, &v.to_string(), true);
            }
            4 if responses => {
                let p = params(input);
                s.params.push(p.clone());
                let name = input.pick(&["response.completed", "response.incomplete"]);
                let v = json!({"type": name, "sequence_number": input.byte(), "response": {"id": "resp_1", "object": "response", "output": [], "kv_transfer_params": p}});
                event(&mut s.bytes, input, Some(name), &v.to_string(), true);
            }
            5 => s.bytes.extend_from_slice(b": keep-alive\n\n"),
            6 => {
                let v = json!({"error": {"message": input.string(16), "type": "x", "code": 500}});
                event(&mut s.bytes, input, None, &v.to_string(), true);
            }
            7 => {
                let junk = input.string(24).replace(['\r', '\n'], " ");
                event(&mut s.bytes, input, None, &junk, false);
            }
            _ => {
                let c = chunk(input, children);
                event(&mut s.bytes, input, Some("message"), &c.to_string(), true);
            }
        }
    }
    if input.byte() < 224 {
        s.done = true;
        s.bytes.extend_from_slice(b"data: [DONE]\n\n");
    }
    s
}

/// `bytes` cut at points the input picks.
pub fn cut<'b>(bytes: &'b [u8], input: &mut Input<'_>) -> Vec<&'b [u8]> {
    let mut out = Vec::new();
    let mut rest = bytes;
    while !rest.is_empty() {
        let n = if input.is_empty() {
            rest.len()
        } else {
            1 + input.below(rest.len().min(96))
        };
        let (a, b) = rest.split_at(n.min(rest.len()));
        out.push(a);
        rest = b;
    }
    out
}

/// The events a client dispatches from `bytes` (an event without its blank line at the end of
/// the stream is discarded, as the standard says).
pub fn client_events(bytes: &[u8]) -> Vec<Event> {
    let mut f = Framer::new();
    f.push(bytes);
    std::iter::from_fn(|| f.next_event())
        .map(|e| Event::parse(&e))
        .collect()
}

/// Panics when a client reading `bytes` sees a retained turn's `kv_transfer_params`.
pub fn assert_no_retained_params(bytes: &[u8]) {
    for e in client_events(bytes) {
        let Some(v) = e.json() else {
            continue;
        };
        let shown = is_retained(v.get(pd_wire::kv::FIELD))
            || is_retained(v.get("response").and_then(|r| r.get(pd_wire::kv::FIELD)));
        assert!(
            !shown,
            "a retained turn's kv_transfer_params reached the client: {}",
            String::from_utf8_lossy(bytes)
        );
    }
}
