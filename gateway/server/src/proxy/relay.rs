//! Phase 4: the node's answer to the client as it arrives. A whole (not streamed) answer is read
//! first when it succeeded, so that what the request's capture takes out of it is gone from
//! what the client gets; a stream passes event by event. Spread children's answers are merged
//! into one ([`crate::spread`]). A node that sends nothing more for `--node-idle-timeout-ms`
//! ends the answer as one that broke off does (504, or a stream's error event).

use bytes::Bytes;
use pd_policy::Api;
use pingora::prelude::Session;
use serde_json::Value;
use tracing::warn;

use super::exchange::{Outcome, Progress};
use super::execute::sleep_or_never;
use super::prepare::Prepared;
use super::{Gateway, client_gone, header, request_id, respond};
use crate::answer::SseCapture;
use crate::cluster::NodeRef;
use crate::error::{GatewayError, NodeFailure};
use crate::spread;
use crate::upstream::{NodeResponse, UpstreamError};

/// The decode groups' answers of a spread request.
pub(super) struct Parts {
    /// Each group's node (watched: one that leaves ends the answer).
    pub(super) nodes: Vec<NodeRef>,
    pub(super) resps: Vec<NodeResponse>,
    /// Each group's first child's index among the request's `n`.
    pub(super) offsets: Vec<u32>,
}

/// Why a node's answer stopped before its end.
enum Cut {
    Broke(UpstreamError),
    /// Nothing for the idle timeout.
    Silent,
}

/// Resolves when any of `nodes` is gone ([`NodeRef::gone`]); never when `nodes` is empty.
async fn any_gone(nodes: &[NodeRef]) {
    if nodes.is_empty() {
        return std::future::pending().await;
    }
    futures::future::select_all(nodes.iter().map(|n| Box::pin(n.gone()))).await;
}

impl Gateway {
    /// `node`'s answer `resp`, to the client.
    pub(super) async fn relay(
        &self,
        session: &mut Session,
        req: &Prepared,
        st: &mut Progress,
        (node, mut resp): (&NodeRef, NodeResponse),
    ) -> Result<Outcome, GatewayError> {
        let capture = req.capture();
        let left = || {
            GatewayError::from(NodeFailure::Left {
                node: node.engine_id.to_string(),
            })
        };
        let idle = self.0.config.node_idle_timeout;
        let silent = || {
            GatewayError::from(NodeFailure::Silent {
                node: node.engine_id.to_string(),
                after: idle.unwrap_or_default(),
            })
        };
        let status = resp.status().as_u16();
        st.relayed = status;
        let content_type = resp.content_type().unwrap_or("application/json").to_owned();
        let streamed = content_type.starts_with("text/event-stream");
        if status == 200 && !streamed {
            let read = tokio::select! {
                b = st.timing.wait(resp.bytes()) => b,
                () = node.gone() => return Err(left()),
                () = sleep_or_never(idle) => return Err(silent()),
            };
            let body = match read {
                Ok(b) => b,
                Err(e) => return Err(NodeFailure::AnswerBroke(e).into()),
            };
            let body = match capture.json(&body, &mut st.captured) {
                Some(changed) => Bytes::from(changed),
                None => body,
            };
            st.timing.answered();
            self.keep_turn_now(req, &st.captured, &mut st.turn_kept)
                .await;
            respond(session, status, &content_type, body).await;
            return Ok(Outcome::Ok);
        }
        let mut sse = (status == 200).then(|| SseCapture::new(capture));
        let len = resp.content_length().and_then(|l| usize::try_from(l).ok());
        let h = header(status, &content_type, len, request_id(session));
        if session.write_response_header(h, false).await.is_err() {
            return Ok(Outcome::Aborted);
        }
        st.streaming = streamed;
        // Watch the client between chunks only for a chunked (streamed) answer: the client
        // cannot send its next request before the final chunk, which is written after this
        // loop. With a content length, the last body write completes the answer and a
        // keep-alive client may send its next request at once; an idle read would eat it.
        let mut watch = len.is_none();
        // The answer's last event went out: a break after it costs the client nothing.
        let mut answered = false;
        // Made once, not per chunk: it registers with the node's token when first polled.
        let gone = node.gone();
        tokio::pin!(gone);
        loop {
            let chunk = if watch {
                tokio::select! {
                    c = st.timing.wait(resp.chunk()) => c.map_err(Cut::Broke),
                    () = client_gone(session) => return Ok(Outcome::Aborted),
                    () = &mut gone => Err(Cut::Broke(UpstreamError::Gone)),
                    () = sleep_or_never(idle) => Err(Cut::Silent),
                }
            } else {
                tokio::select! {
                    c = st.timing.wait(resp.chunk()) => c.map_err(Cut::Broke),
                    () = &mut gone => Err(Cut::Broke(UpstreamError::Gone)),
                    () = sleep_or_never(idle) => Err(Cut::Silent),
                }
            };
            match chunk {
                Ok(Some(bytes)) => {
                    let bytes = match &mut sse {
                        Some(sse) => sse.feed(bytes),
                        None => bytes,
                    };
                    if bytes.is_empty() {
                        continue;
                    }
                    st.timing.answered();
                    // Once the answer's last event is out, the client has all of it and may
                    // close at once (the SDKs do on `[DONE]`): that is no abort, so stop
                    // watching for it while the node's stream ends.
                    if !answered && pd_wire::sse::ends_answer(&bytes) {
                        answered = true;
                        watch = false;
                        if let Some(sse) = &sse {
                            self.keep_turn_now(req, &sse.captured, &mut st.turn_kept)
                                .await;
                        }
                    }
                    if session
                        .write_response_body(Some(bytes), false)
                        .await
                        .is_err()
                    {
                        return Ok(Outcome::Aborted);
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    // The node broke off mid-answer. An event stream ends with an error event
                    // (no `[DONE]`), so the client knows its answer is cut; another body is
                    // cut where it stands.
                    let err = match e {
                        Cut::Broke(UpstreamError::Gone) => left(),
                        Cut::Broke(e) => NodeFailure::StreamBroke(e).into(),
                        Cut::Silent => silent(),
                    };
                    warn!("node stream broke: {err}");
                    let last = (sse.is_some() && !answered).then(|| err.stream_event(req.api));
                    let _ = session.write_response_body(last, true).await;
                    return Err(err);
                }
            }
        }
        st.timing.answered();
        if let Some(mut sse) = sse {
            let tail = sse.finish();
            if !tail.is_empty()
                && session
                    .write_response_body(Some(tail), false)
                    .await
                    .is_err()
            {
                return Ok(Outcome::Aborted);
            }
            st.captured = sse.captured;
        }
        let _ = session.write_response_body(None, true).await;
        Ok(Outcome::Ok)
    }

    /// Spread children's answers, merged: streamed when any group streams.
    pub(super) async fn relay_merged(
        &self,
        session: &mut Session,
        st: &mut Progress,
        parts: Parts,
    ) -> Result<Outcome, GatewayError> {
        let streamed = parts.resps.iter().any(|r| {
            r.content_type()
                .is_some_and(|c| c.starts_with("text/event-stream"))
        });
        if streamed {
            self.relay_merged_stream(session, st, parts).await
        } else {
            self.relay_merged_whole(session, st, parts).await
        }
    }

    /// Not streamed: every group's body, merged.
    async fn relay_merged_whole(
        &self,
        session: &mut Session,
        st: &mut Progress,
        parts: Parts,
    ) -> Result<Outcome, GatewayError> {
        let reads = futures::future::join_all(parts.resps.into_iter().map(NodeResponse::bytes));
        let idle = self.0.config.node_idle_timeout;
        let bodies = tokio::select! {
            b = st.timing.wait(reads) => b,
            () = sleep_or_never(idle) => {
                return Err(NodeFailure::Silent {
                    node: "a decode node".into(),
                    after: idle.unwrap_or_default(),
                }
                .into());
            }
            () = client_gone(session) => return Ok(Outcome::Aborted),
            () = any_gone(&parts.nodes) => return Err(NodeFailure::DecodeLeft.into()),
        };
        let bodies = bodies
            .into_iter()
            .collect::<Result<Vec<_>, _>>()
            .map_err(NodeFailure::AnswerBroke)?;
        let merged: Vec<(u32, &[u8])> = parts
            .offsets
            .iter()
            .zip(&bodies)
            .map(|(&offset, b)| (offset, b.as_ref()))
            .collect();
        let merged = spread::merge_json(&merged).map_err(NodeFailure::from)?;
        self.release_spread(&merged.leases);
        let bytes = Bytes::from(serde_json::to_vec(&merged.answer)?);
        st.timing.answered();
        respond(session, 200, "application/json", bytes).await;
        Ok(Outcome::Ok)
    }

    /// Streamed: events from every group as they arrive, indices moved, one `[DONE]` at the
    /// end.
    async fn relay_merged_stream(
        &self,
        session: &mut Session,
        st: &mut Progress,
        parts: Parts,
    ) -> Result<Outcome, GatewayError> {
        use futures::StreamExt;
        let h = header(200, "text/event-stream", None, request_id(session));
        if session.write_response_header(h, false).await.is_err() {
            return Ok(Outcome::Aborted);
        }
        st.streaming = true;
        let idle = self.0.config.node_idle_timeout;
        let mut merge = spread::SseMerge::new(parts.offsets);
        let mut streams = futures::stream::select_all(
            parts
                .resps
                .into_iter()
                .enumerate()
                .map(|(j, r)| r.bytes_stream().map(move |b| (j, b)).boxed()),
        );
        // Made once, not per event (it boxes a future per node).
        let gone = any_gone(&parts.nodes);
        tokio::pin!(gone);
        loop {
            let next = tokio::select! {
                n = st.timing.wait(streams.next()) => n.map(|(j, b)| (j, b.map_err(|e| Cut::Broke(e.into())))),
                () = client_gone(session) => return Ok(Outcome::Aborted),
                () = &mut gone => Some((0, Err(Cut::Broke(UpstreamError::Gone)))),
                () = sleep_or_never(idle) => Some((0, Err(Cut::Silent))),
            };
            let out = match next {
                Some((j, Ok(bytes))) => {
                    let out = merge.feed(j, &bytes);
                    self.release_spread(&merge.take_leases());
                    out
                }
                Some((_, Err(e))) => {
                    let err = GatewayError::from(match e {
                        Cut::Broke(e) => NodeFailure::StreamBroke(e),
                        Cut::Silent => NodeFailure::Silent {
                            node: "a decode node".into(),
                            after: idle.unwrap_or_default(),
                        },
                    });
                    warn!("decode stream broke: {err}");
                    // Children spread over nodes (n > 1) exist on chat and completions only,
                    // whose error frame is the same.
                    let _ = session
                        .write_response_body(Some(err.stream_event(Api::Completions)), true)
                        .await;
                    return Err(err);
                }
                None => break,
            };
            if !out.is_empty() {
                st.timing.answered();
                if session
                    .write_response_body(Some(Bytes::from(out)), false)
                    .await
                    .is_err()
                {
                    return Ok(Outcome::Aborted);
                }
            }
        }
        if !merge.complete() {
            // A node ended its stream without `[DONE]` (it reported an error frame): end the
            // merged stream the same way.
            let _ = session.write_response_body(None, true).await;
            return Err(NodeFailure::StreamEndedEarly.into());
        }
        let tail = merge.finish();
        st.timing.answered();
        let _ = session
            .write_response_body(Some(Bytes::from(tail)), true)
            .await;
        Ok(Outcome::Ok)
    }

    /// Releases the turns a spread request's decode nodes kept (their answers'
    /// `kv_transfer_params`, taken out of the client's answer): children on several nodes make
    /// no one holder to continue from.
    fn release_spread(&self, leases: &[Value]) {
        for v in leases {
            for params in pd_wire::kv::read(Some(v)).unwrap_or_default() {
                self.release(Some(&params), "spread_turn");
            }
        }
    }
}
