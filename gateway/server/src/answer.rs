//! What the gateway reads from a node's answer on its way to the client: a retained turn's
//! `kv_transfer_params` (kept in the conversation index; removed from the answer unless the
//! client is trusted, since they name a lease on a node) and, on `/v1/responses`, the response
//! object (its id and output, kept for `previous_response_id`).
//!
//! A whole JSON answer is read at once ([`Capture::json`]). A stream goes through
//! [`SseCapture`] event by event: an event that mentions neither is passed on as the node wrote
//! it (a chunk of whole such events without a copy); only the final chunk or
//! `response.completed` / `response.incomplete` event is parsed and, if needed, rewritten.

use bytes::Bytes;
use pd_policy::Api;
use pd_wire::KvTransferParams;
use pd_wire::sse::{Event, Framer};
use serde_json::Value;

use crate::openai::KV_FIELD;

const PARAMS_NEEDLE: &[u8] = b"\"kv_transfer_params\"";
const FINAL_RESPONSE_NEEDLES: [&[u8]; 2] = [b"response.completed", b"response.incomplete"];

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    memchr::memmem::find(hay, needle).is_some()
}

/// What to take from an answer, and what to leave in it.
#[derive(Debug, Clone, Copy)]
pub struct Capture {
    /// The API the answer is on.
    pub api: Api,
    /// Remove a retained turn's `kv_transfer_params` from what the client sees.
    pub hide_params: bool,
    /// Keep the `/v1/responses` response object.
    pub want_response: bool,
}

/// What was taken.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Captured {
    /// A retained turn's `kv_transfer_params` (`do_remote_decode: true`).
    pub params: Option<KvTransferParams>,
    /// The final response object (`/v1/responses`).
    pub response: Option<Value>,
    /// Params were removed from the answer.
    pub hidden: bool,
}

impl Capture {
    /// Whether anything in the answer could matter to this capture.
    fn interested(&self, bytes: &[u8]) -> bool {
        contains(bytes, PARAMS_NEEDLE)
            || (self.want_response && FINAL_RESPONSE_NEEDLES.iter().any(|n| contains(bytes, n)))
    }

    /// Takes what it wants from `obj` (a whole answer, a stream chunk, or a response object);
    /// `true` when `obj` changed. A retained turn's params are hidden even when they do not
    /// read as params (they name a lease either way).
    fn take(&self, obj: &mut Value, out: &mut Captured) -> bool {
        let Some(raw) = obj.get(KV_FIELD) else {
            return false;
        };
        if raw.get("do_remote_decode") != Some(&Value::Bool(true)) {
            return false;
        }
        out.params = KvTransferParams::from_value(raw).ok();
        if !self.hide_params {
            return false;
        }
        out.hidden = true;
        obj.as_object_mut().and_then(|o| o.remove(KV_FIELD));
        true
    }

    /// A whole (not streamed) JSON answer: what it holds, and the bytes for the client when
    /// they changed (`None`: pass the node's bytes on).
    pub fn json(&self, body: &[u8], out: &mut Captured) -> Option<Vec<u8>> {
        let responses = self.want_response && matches!(self.api, Api::Responses);
        if !(responses || self.interested(body)) {
            return None;
        }
        let mut v: Value = serde_json::from_slice(body).ok()?;
        let changed = self.take(&mut v, out);
        if self.want_response && v.get("object").and_then(Value::as_str) == Some("response") {
            out.response = Some(v.clone());
        }
        changed.then(|| serde_json::to_vec(&v).ok()).flatten()
    }

    /// One SSE event as it came: the event for the client when it changed.
    fn event(&self, raw: &[u8], out: &mut Captured) -> Option<Vec<u8>> {
        if !self.interested(raw) {
            return None;
        }
        let mut event = Event::parse(raw);
        let mut v = event.json()?;
        let final_response = matches!(
            v.get("type").and_then(Value::as_str),
            Some("response.completed" | "response.incomplete")
        );
        let changed = if final_response {
            let r = v.get_mut("response")?;
            let changed = self.take(r, out);
            if self.want_response {
                out.response = Some(r.clone());
            }
            changed
        } else {
            self.take(&mut v, out)
        };
        if !changed {
            return None;
        }
        event.data = Some(v.to_string());
        Some(event.to_bytes())
    }
}

/// A stream's capture: feed it the node's chunks, write what it returns.
#[derive(Debug)]
pub struct SseCapture {
    capture: Capture,
    /// The stream cut into whole events (any SSE line ending).
    framer: Framer,
    /// What was taken so far.
    pub captured: Captured,
}

impl SseCapture {
    /// A capture of one stream.
    pub fn new(capture: Capture) -> Self {
        Self {
            capture,
            framer: Framer::new(),
            captured: Captured::default(),
        }
    }

    /// The next chunk of the node's stream; returns the bytes to send the client now (events
    /// are passed on whole: a partial one waits for its end; untouched ones as they came).
    pub fn feed(&mut self, chunk: Bytes) -> Bytes {
        if self.framer.is_empty() && chunk.ends_with(b"\n\n") && !self.capture.interested(&chunk) {
            return chunk;
        }
        self.framer.push(&chunk);
        let mut out = Vec::new();
        while let Some(raw) = self.framer.next_event() {
            match self.capture.event(&raw, &mut self.captured) {
                Some(changed) => out.extend_from_slice(&changed),
                None => out.extend_from_slice(&raw),
            }
        }
        Bytes::from(out)
    }

    /// The end of the stream: anything left (an unterminated last event), as it came.
    pub fn finish(&mut self) -> Bytes {
        Bytes::from(self.framer.finish())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn retained() -> Value {
        json!({"do_remote_decode": true, "remote_engine_id": "d1", "remote_num_tokens": 16})
    }

    fn typed() -> KvTransferParams {
        KvTransferParams::from_value(&retained()).unwrap()
    }

    fn cap(api: Api, hide: bool) -> Capture {
        Capture {
            api,
            hide_params: hide,
            want_response: matches!(api, Api::Responses),
        }
    }

    #[test]
    fn a_whole_answer_loses_its_params_for_an_untrusted_client() {
        let body =
            json!({"id": "cmpl-1", "choices": [{"text": "x"}], "kv_transfer_params": retained()});
        let bytes = serde_json::to_vec(&body).unwrap();
        let mut got = Captured::default();
        let out = cap(Api::Completions, true).json(&bytes, &mut got).unwrap();
        let out: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(out.get(KV_FIELD), None);
        assert_eq!(out["choices"], body["choices"]);
        assert_eq!(got.params, Some(typed()));
        assert!(got.hidden);
        // A trusted client sees them; the index still gets them.
        let mut got = Captured::default();
        assert_eq!(cap(Api::Completions, false).json(&bytes, &mut got), None);
        assert_eq!(got.params, Some(typed()));
        // Nothing to take: the node's bytes pass untouched.
        let plain = br#"{"id":"cmpl-2","choices":[]}"#;
        let mut got = Captured::default();
        assert_eq!(cap(Api::Completions, true).json(plain, &mut got), None);
        assert_eq!(got, Captured::default());
    }

    #[test]
    fn a_response_object_is_kept() {
        let body = json!({"id": "resp_1", "object": "response", "output": [], "kv_transfer_params": retained()});
        let mut got = Captured::default();
        let out = cap(Api::Responses, true)
            .json(&serde_json::to_vec(&body).unwrap(), &mut got)
            .unwrap();
        let out: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(out.get(KV_FIELD), None);
        assert_eq!(got.response.as_ref().unwrap()["id"], "resp_1");
        assert_eq!(got.response.unwrap().get(KV_FIELD), None);
        assert_eq!(got.params, Some(typed()));
    }

    #[test]
    fn streams_pass_untouched_but_for_the_final_chunk() {
        let mut sse = SseCapture::new(cap(Api::ChatCompletions, true));
        let a = Bytes::from_static(b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n");
        let out = sse.feed(a.clone());
        assert_eq!(out, a);
        assert_eq!(out.as_ptr(), a.as_ptr(), "passed on without a copy");
        let last = format!(
            "data: {}\n\ndata: [DONE]\n\n",
            json!({"choices": [], "kv_transfer_params": retained()})
        );
        // Split mid-event: nothing goes out until the event ends.
        let (x, y) = last.split_at(20);
        assert!(sse.feed(Bytes::from(x.to_owned())).is_empty());
        let out = sse.feed(Bytes::from(y.to_owned()));
        let text = String::from_utf8(out.to_vec()).unwrap();
        assert!(!text.contains("kv_transfer_params"), "{text}");
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        assert!(text.starts_with("data: {\"choices\":[]}\n\n"), "{text}");
        assert_eq!(sse.captured.params, Some(typed()));
        assert!(sse.finish().is_empty());
    }

    #[test]
    fn a_streamed_response_is_captured_from_its_completed_event() {
        let mut sse = SseCapture::new(cap(Api::Responses, true));
        let resp = json!({"id": "resp_9", "object": "response", "output": [], "kv_transfer_params": retained()});
        let ev = format!(
            "event: response.completed\ndata: {}\n\n",
            json!({"type": "response.completed", "sequence_number": 7, "response": resp})
        );
        let out = sse.feed(Bytes::from(ev));
        let text = String::from_utf8(out.to_vec()).unwrap();
        assert!(
            text.starts_with("event: response.completed\ndata: {"),
            "{text}"
        );
        assert!(!text.contains("kv_transfer_params"), "{text}");
        assert_eq!(sse.captured.response.as_ref().unwrap()["id"], "resp_9");
        assert_eq!(sse.captured.params, Some(typed()));
    }

    /// A node framing with `\r\n` and splitting data over lines is read the same.
    #[test]
    fn crlf_framed_multi_line_events_are_captured_and_rewritten() {
        let mut sse = SseCapture::new(cap(Api::ChatCompletions, true));
        let body = json!({"choices": [], "kv_transfer_params": retained()}).to_string();
        // Split between two JSON tokens: the lines join with `\n`, which JSON reads as space.
        let (a, b) = body.split_at(body.find(",\"kv").unwrap() + 1);
        let ev = format!("id: 3\r\ndata: {a}\r\ndata: {b}\r\n\r\ndata: [DONE]\r\n\r\n");
        let (x, y) = ev.split_at(ev.len() - 3);
        let mut out = sse.feed(Bytes::from(x.to_owned())).to_vec();
        out.extend_from_slice(&sse.feed(Bytes::from(y.to_owned())));
        let text = String::from_utf8(out).unwrap();
        assert!(!text.contains("kv_transfer_params"), "{text}");
        assert!(text.starts_with("id: 3\ndata: {"), "{text}");
        assert!(text.ends_with("data: [DONE]\r\n\r\n"), "{text}");
        assert_eq!(sse.captured.params, Some(typed()));
    }
}
