//! Server-sent-event bodies built over a request's [`Events`], framed by axum's [`Sse`].
//!
//! The body stream owns the [`Events`]: when hyper drops the body (client gone, connection
//! reset), the events drop with them and the engine aborts the request and frees its KV
//! blocks. Each endpoint supplies a [`SseFormatter`] that turns engine events into SSE events.
//! A stream with nothing to say for [`KEEP_ALIVE`] (queued, or waiting for a peer's KV) sends a
//! comment, so proxies and clients with idle timeouts keep the connection.

use std::convert::Infallible;
use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use pd_engine::RequestEvent;
use serde::Serialize;

use crate::disagg::Events;
use crate::error::ApiError;

/// Default silence before a keep-alive comment (`pd-node serve --sse-keep-alive`).
pub const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// The terminator of OpenAI chat and completion streams, `data: [DONE]`.
pub(crate) fn done() -> Event {
    Event::default().data("[DONE]")
}

/// Turns one request's events into SSE events, appended to `out`.
pub(crate) trait SseFormatter: Send + 'static {
    /// Events sent before the first engine event (e.g. the chat role chunk).
    fn prelude(&mut self, out: &mut Vec<Event>);
    /// Events for one engine event. A [`RequestEvent::Failed`] is the last event delivered.
    fn event(&mut self, event: RequestEvent, out: &mut Vec<Event>);
    /// Events after the last one: the usage chunk, `[DONE]`, or an error when the stream ended
    /// before every child finished.
    fn finish(&mut self, out: &mut Vec<Event>);
}

/// Appends `data: <json>`.
pub(crate) fn data_frame(out: &mut Vec<Event>, value: &impl Serialize) {
    out.push(json(Event::default(), value));
}

/// Appends `event: <name>` with `data: <json>`.
pub(crate) fn event_frame(out: &mut Vec<Event>, name: &str, value: &impl Serialize) {
    out.push(json(Event::default().event(name), value));
}

/// Appends the OpenAI error object as a data frame (how vLLM reports mid-stream failures).
pub(crate) fn error_frame(out: &mut Vec<Event>, error: &ApiError) {
    data_frame(out, &error.to_body());
}

fn json(event: Event, value: &impl Serialize) -> Event {
    // Our wire types contain no maps with non-string keys, so this cannot fail; if it ever did,
    // an empty object keeps the frame well formed.
    match serde_json::to_string(value) {
        Ok(text) => event.data(text),
        Err(_) => event.data("{}"),
    }
}

enum State<F> {
    Start(Events, F),
    Running(Events, F),
    Done,
}

/// A `text/event-stream` response that drives `stream` through `formatter`, with a comment
/// after every `keep_alive` of silence.
pub(crate) fn sse_response<F: SseFormatter>(
    stream: Events,
    formatter: F,
    keep_alive: Duration,
) -> Response {
    let batches = futures::stream::unfold(State::Start(stream, formatter), |state| async move {
        let mut out = Vec::new();
        let (mut stream, mut formatter) = match state {
            State::Done => return None,
            State::Start(stream, mut formatter) => {
                formatter.prelude(&mut out);
                (stream, formatter)
            }
            State::Running(stream, formatter) => (stream, formatter),
        };
        // Wait until an engine event produces at least one SSE event.
        while out.is_empty() {
            match stream.recv().await {
                Some(event) => formatter.event(event, &mut out),
                None => {
                    formatter.finish(&mut out);
                    drop(stream);
                    return (!out.is_empty()).then_some((out, State::Done));
                }
            }
        }
        Some((out, State::Running(stream, formatter)))
    });
    let events = futures::StreamExt::flat_map(batches, |batch| {
        futures::stream::iter(batch.into_iter().map(Ok::<_, Infallible>))
    });
    Sse::new(events)
        .keep_alive(KeepAlive::new().interval(keep_alive))
        .into_response()
}
