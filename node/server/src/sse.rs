//! Server-sent-event bodies built over a request's [`Events`].
//!
//! The body stream owns the [`Events`]: when hyper drops the body (client gone, connection
//! reset), the events drop with them and the engine aborts the request and frees its KV
//! blocks. Each endpoint supplies a [`SseFormatter`] that turns engine events into frames.

use std::convert::Infallible;

use axum::body::Body;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use pd_engine::RequestEvent;
use serde::Serialize;

use crate::disagg::Events;
use crate::error::ApiError;

/// The terminator of OpenAI chat and completion streams.
pub(crate) const DONE: &[u8] = b"data: [DONE]\n\n";

/// Turns one request's events into SSE frames, appended to `out`.
pub(crate) trait SseFormatter: Send + 'static {
    /// Frames sent before the first engine event (e.g. the chat role chunk).
    fn prelude(&mut self, out: &mut Vec<u8>);
    /// Frames for one engine event. A [`RequestEvent::Failed`] is the last event delivered.
    fn event(&mut self, event: RequestEvent, out: &mut Vec<u8>);
    /// Frames after the last event: the usage chunk, `[DONE]`, or an error when the stream ended
    /// before every child finished.
    fn finish(&mut self, out: &mut Vec<u8>);
}

/// Appends `data: <json>\n\n`.
pub(crate) fn data_frame(out: &mut Vec<u8>, value: &impl Serialize) {
    out.extend_from_slice(b"data: ");
    write_json(out, value);
    out.extend_from_slice(b"\n\n");
}

/// Appends `event: <name>\ndata: <json>\n\n`.
pub(crate) fn event_frame(out: &mut Vec<u8>, name: &str, value: &impl Serialize) {
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(name.as_bytes());
    out.push(b'\n');
    data_frame(out, value);
}

/// Appends the OpenAI error object as a data frame (how vLLM reports mid-stream failures).
pub(crate) fn error_frame(out: &mut Vec<u8>, error: &ApiError) {
    data_frame(out, &error.to_body());
}

fn write_json(out: &mut Vec<u8>, value: &impl Serialize) {
    // Our wire types contain no maps with non-string keys, so this cannot fail; if it ever did,
    // an empty object keeps the frame well formed.
    if serde_json::to_writer(&mut *out, value).is_err() {
        out.extend_from_slice(b"{}");
    }
}

enum State<F> {
    Start(Events, F),
    Running(Events, F),
    Done,
}

/// A `text/event-stream` response that drives `stream` through `formatter`.
pub(crate) fn sse_response<F: SseFormatter>(stream: Events, formatter: F) -> Response {
    let body = futures::stream::unfold(State::Start(stream, formatter), |state| async move {
        let mut out = Vec::new();
        let (mut stream, mut formatter) = match state {
            State::Done => return None,
            State::Start(stream, mut formatter) => {
                formatter.prelude(&mut out);
                (stream, formatter)
            }
            State::Running(stream, formatter) => (stream, formatter),
        };
        // Skip events that produce no frame: an empty chunk would look like the end of the body.
        while out.is_empty() {
            match stream.recv().await {
                Some(event) => formatter.event(event, &mut out),
                None => {
                    formatter.finish(&mut out);
                    drop(stream);
                    return (!out.is_empty())
                        .then(|| (Ok::<_, Infallible>(Bytes::from(out)), State::Done));
                }
            }
        }
        Some((Ok(Bytes::from(out)), State::Running(stream, formatter)))
    });
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(body),
    )
        .into_response()
}
