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

/// Where a stream's engine events come from: one request's [`Events`], or several requests'
/// merged and tagged by their position ([`Merged`]: a completions request with a list of
/// prompts).
pub(crate) trait EventSource: Send + 'static {
    /// What one `recv` yields.
    type Event: Send;
    /// Next event; `None` once every request ended.
    fn recv(&mut self) -> impl std::future::Future<Output = Option<Self::Event>> + Send;
}

impl EventSource for Events {
    type Event = RequestEvent;

    fn recv(&mut self) -> impl std::future::Future<Output = Option<RequestEvent>> + Send {
        Events::recv(self)
    }
}

/// Several requests' events as they come, each tagged with its request's position. Dropping
/// it drops every request's events (each aborts its request); so does one request's failure,
/// after which it yields nothing more.
#[derive(Debug)]
pub(crate) struct Merged(Vec<(usize, Events)>);

impl Merged {
    /// `streams[i]`'s events are tagged `i`.
    pub(crate) fn new(streams: Vec<Events>) -> Self {
        Self(streams.into_iter().enumerate().collect())
    }
}

impl EventSource for Merged {
    type Event = (usize, RequestEvent);

    async fn recv(&mut self) -> Option<(usize, RequestEvent)> {
        loop {
            if self.0.is_empty() {
                return None;
            }
            // Each `Events::recv` is cancel-safe (it only awaits channel receives), so the
            // ones that lose the race lose nothing.
            let (got, at, rest) = futures::future::select_all(
                self.0
                    .iter_mut()
                    .map(|(tag, s)| Box::pin(async move { (*tag, s.recv().await) })),
            )
            .await;
            drop(rest);
            match got {
                (tag, Some(event)) => {
                    if matches!(event, RequestEvent::Failed { .. }) {
                        // One request failed: the answer ends with it, the others are
                        // dropped (and aborted) rather than generating for nobody.
                        self.0.clear();
                    }
                    return Some((tag, event));
                }
                (_, None) => {
                    self.0.remove(at);
                }
            }
        }
    }
}

/// Turns one request's events (`E`: [`RequestEvent`], or tagged ones from [`Merged`]) into SSE
/// events, appended to `out`.
pub(crate) trait SseFormatter<E = RequestEvent>: Send + 'static {
    /// Events sent before the first engine event (e.g. the chat role chunk).
    fn prelude(&mut self, out: &mut Vec<Event>);
    /// Events for one engine event. A [`RequestEvent::Failed`] is the last event delivered.
    fn event(&mut self, event: E, out: &mut Vec<Event>);
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

enum State<S, F> {
    Start(S, F),
    Running(S, F),
    Done,
}

/// A `text/event-stream` response that drives `stream` through `formatter`, with a comment
/// after every `keep_alive` of silence.
pub(crate) fn sse_response<S: EventSource, F: SseFormatter<S::Event>>(
    stream: S,
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
