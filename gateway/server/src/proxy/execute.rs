//! Phase 3: the plan run. One failover walk ([`Walk`]) goes over every candidate list — a whole request's, P's, each decode group's — before any byte reaches the
//! client: a node that cannot be reached, answers 5xx, leaves the view or (P) answers without
//! params is skipped, logged and counted (`pd_gateway_failovers_total{stage}`). So is one that
//! sends no byte of its answer's head within `--node-first-byte-timeout-ms` (a wedged engine
//! whose reporter still reports): P's head always, another node's when its answer is streamed
//! (a whole answer's head comes with its end, bounded by the request timeout only).

use bytes::Bytes;
use pingora::prelude::Session;
use serde_json::Value;
use tracing::{Instrument, warn};

use super::exchange::{Outcome, Progress};
use super::plan::{Plan, SplitPlan};
use super::prepare::Prepared;
use super::relay::Parts;
use super::{Gateway, client_gone, request_id};
use crate::cluster::{NodeRef, OnNode};
use crate::error::GatewayError;
use crate::openai::{self, LeaseRef};
use crate::spread;
use crate::upstream::{NodeResponse, REQUEST_ID, UpstreamError};
use pd_wire::KvTransferParams;

/// Why a candidate was not used.
pub(super) enum Failed {
    /// Unreachable, a 5xx, gone from the view, or an answer that cannot be used: the next.
    Next(String),
    /// The client left.
    Gone,
    /// The node refused the request itself (a 4xx): the client's fault, the same everywhere.
    Fatal(GatewayError),
}

/// One node's part of a request: who may serve it, what to send, under which failover label.
pub(super) struct Leg<'a> {
    pub(super) candidates: &'a [u32],
    pub(super) body: Bytes,
    pub(super) stage: &'static str,
    /// A reservation made at the decision, used when the node it names serves.
    pub(super) reserved: Option<OnNode>,
    /// The producer's lease the node is to pull (a decode leg).
    pub(super) lease: Option<&'a LeaseRef>,
}

/// A candidate list walked in order until one node serves; every node skipped is logged and
/// counted as a failover of the walk's stage, and its reason kept for the error when all fail.
/// Each caller's loop: `while let Some(node) = walk.next() { match attempt { Err(Failed::Next(e))
/// => walk.skip(node, e), other => return other } }`, then [`Walk::exhausted`].
pub(super) struct Walk<'r> {
    nodes: std::vec::IntoIter<&'r NodeRef>,
    stage: &'static str,
    why: Vec<String>,
    failovers: prometheus::IntCounter,
}

impl<'r> Walk<'r> {
    /// The next candidate.
    fn next(&mut self) -> Option<&'r NodeRef> {
        self.nodes.next()
    }

    /// Moves on from `node`, which failed with `why`; what else ended the attempt ends the walk.
    fn fail<T>(&mut self, node: &NodeRef, failed: Failed) -> Option<Result<T, Failed>> {
        match failed {
            Failed::Next(why) => {
                warn!(node = %node.engine_id, stage = self.stage, "failing over: {why}");
                self.failovers.inc();
                self.why.push(why);
                None
            }
            other => Some(Err(other)),
        }
    }

    /// Every candidate failed: why, each.
    fn exhausted<T>(self) -> Result<T, Failed> {
        Err(Failed::Next(format!(
            "every {} candidate failed: {}",
            self.stage,
            self.why.join("; ")
        )))
    }
}

/// Sleeps `t`, or forever when `None`.
pub(super) async fn sleep_or_never(t: Option<std::time::Duration>) {
    match t {
        Some(t) => tokio::time::sleep(t).await,
        None => std::future::pending().await,
    }
}

/// Counted on `node` while it serves: the decision's reservation when it names this node, else
/// from now.
fn open_on(node: &NodeRef, reserved: &mut Option<OnNode>) -> OnNode {
    match reserved.take() {
        Some(r) if r.conn() == node.conn => r.sent(),
        _ => node.open(),
    }
}

impl Gateway {
    /// Runs the plan; `reserved` are the decode nodes reserved at the decision.
    pub(super) async fn execute(
        &self,
        session: &mut Session,
        req: &Prepared,
        st: &mut Progress,
        reserved: Vec<OnNode>,
    ) -> Result<Outcome, GatewayError> {
        match &req.plan {
            Plan::Reject { status, message } => Err(GatewayError::Rejected {
                status: *status,
                message: message.clone(),
            }),
            Plan::Whole {
                candidates, stage, ..
            } => {
                let bytes = match req.pulled() {
                    // On the holder nothing moves (its prefix cache has the blocks, and it
                    // releases its own lease); any other node pulls the turn, then decodes.
                    Some(h) => openai::decode_bytes(&req.body, &h.as_pull()),
                    None => serde_json::to_vec(&req.body),
                };
                let leg = Leg {
                    candidates,
                    body: Bytes::from(bytes?),
                    stage,
                    reserved: None,
                    lease: None,
                };
                self.whole(session, req, st, leg).await
            }
            Plan::Split(split) => self.split(session, req, st, split, reserved).await,
        }
    }

    /// The failover walk over `candidates` (see [`Walk`]).
    fn walk<'r>(&self, req: &'r Prepared, candidates: &'r [u32], stage: &'static str) -> Walk<'r> {
        Walk {
            nodes: candidates
                .iter()
                .filter_map(|&i| req.snapshot.nodes.get(i as usize))
                .collect::<Vec<_>>()
                .into_iter(),
            stage,
            why: Vec::new(),
            failovers: self.0.metrics.failovers.with_label_values(&[stage]),
        }
    }

    /// How long `req`'s node may take to its answer's head on `stage`: P's always, another's
    /// when streamed.
    fn head_deadline(&self, req: &Prepared, stage: &str) -> Option<std::time::Duration> {
        (stage == "prefill" || req.analyzed.stream)
            .then_some(self.0.config.node_first_byte_timeout)
            .flatten()
    }

    /// Posts `body` to `node`; a connection failure, a 5xx, no answer's head within `head`
    /// or the node leaving the view while it works is [`Failed::Next`].
    async fn post(
        &self,
        node: &NodeRef,
        (path, head): (&str, Option<std::time::Duration>),
        body: Bytes,
        id: Option<http::HeaderValue>,
    ) -> Result<NodeResponse, Failed> {
        let addr = &*node.http_addr;
        let sent = tokio::select! {
            r = self.0.http.post_json((addr, node.bearer.as_ref()), path, body, id) => r,
            () = node.gone() => Err(UpstreamError::Gone),
            () = sleep_or_never(head) => {
                let ms = head.unwrap_or_default().as_millis();
                return Err(Failed::Next(format!("{addr} sent no answer within {ms} ms")));
            }
        };
        match sent {
            Ok(resp) if resp.status().is_server_error() => {
                let status = resp.status();
                let text = resp.text().await;
                Err(Failed::Next(format!("{addr} answered {status}: {text}")))
            }
            Ok(resp) => Ok(resp),
            Err(UpstreamError::Gone) => Err(Failed::Next(format!(
                "{addr} left the view and did not come back"
            ))),
            Err(e) => Err(Failed::Next(format!("{addr}: {e}"))),
        }
    }

    /// [`Gateway::post`] while watching the client, the time counted as waiting on nodes.
    async fn send(
        &self,
        session: &mut Session,
        st: &mut Progress,
        node: &NodeRef,
        (path, head, body): (&str, Option<std::time::Duration>, Bytes),
    ) -> Result<NodeResponse, Failed> {
        let id = session.req_header().headers.get(REQUEST_ID).cloned();
        tokio::select! {
            r = st.timing.wait(self.post(node, (path, head), body, id)) => r,
            () = client_gone(session) => Err(Failed::Gone),
        }
    }

    /// One node serves the request, the first of the leg's candidates that answers; its answer
    /// is relayed (and what the request's capture asks for taken from it). Traced as the leg's
    /// phase: `decode` on a decode node, else `generate` (one node computes it all).
    pub(super) async fn whole(
        &self,
        session: &mut Session,
        req: &Prepared,
        st: &mut Progress,
        leg: Leg<'_>,
    ) -> Result<Outcome, GatewayError> {
        let id = || request_id(session).unwrap_or_default();
        let span = match leg.stage {
            "decode" => pd_telemetry::phase!("decode", id(), otel.kind = "client"),
            stage => pd_telemetry::phase!("generate", id(), otel.kind = "client", stage),
        };
        self.serve_leg(session, req, st, leg).instrument(span).await
    }

    /// [`Gateway::whole`]'s walk and relay.
    async fn serve_leg(
        &self,
        session: &mut Session,
        req: &Prepared,
        st: &mut Progress,
        mut leg: Leg<'_>,
    ) -> Result<Outcome, GatewayError> {
        let path = req.path();
        let head = self.head_deadline(req, leg.stage);
        let mut walk = self.walk(req, leg.candidates, leg.stage);
        let served = loop {
            let Some(node) = walk.next() else {
                break walk.exhausted();
            };
            let open = open_on(node, &mut leg.reserved);
            match self
                .send(session, st, node, (path, head, leg.body.clone()))
                .await
            {
                Ok(resp) => break Ok((resp, open, node)),
                Err(f) => {
                    if let Some(end) = walk.fail(node, f) {
                        break end;
                    }
                }
            }
        };
        match served {
            Ok((resp, _open, node)) => {
                st.lease_left = leg
                    .lease
                    .is_some_and(|l| resp.could_not_reach(&l.side_channel));
                let relay = pd_telemetry::phase!("relay", request_id(session).unwrap_or_default());
                self.relay(session, req, st, (node, resp))
                    .instrument(relay)
                    .await
            }
            Err(Failed::Gone) => Ok(Outcome::Aborted),
            Err(Failed::Fatal(e)) => Err(e),
            Err(Failed::Next(why)) => Err(GatewayError::NoCapacity {
                model: req.analyzed.model.clone(),
                why,
            }),
        }
    }

    /// P, then D: one decode request (all children on one node, forked there), or one per
    /// group ([`Gateway::spread`]).
    async fn split(
        &self,
        session: &mut Session,
        req: &Prepared,
        st: &mut Progress,
        split: &SplitPlan,
        reserved: Vec<OnNode>,
    ) -> Result<Outcome, GatewayError> {
        let id = || request_id(session).unwrap_or_default();
        let prefill = pd_telemetry::phase!("prefill", id(), otel.kind = "client");
        let Some(mut params) = self
            .prefill(session, req, st, split)
            .instrument(prefill)
            .await?
        else {
            return Ok(Outcome::Aborted);
        };
        if split.spread() && params.len() >= split.groups.len() {
            for extra in params.drain(split.groups.len()..) {
                self.release(Some(&extra), "unused");
            }
            let id = || request_id(session).unwrap_or_default();
            let decode = pd_telemetry::phase!("decode", id(), otel.kind = "client");
            return self
                .spread(session, req, st, (split, params), reserved)
                .instrument(decode)
                .await;
        }
        // One group, or a P that granted one lease for several (a node without
        // `num_consumers`): all children on one decode node, the rest of the list failover.
        let first = params.remove(0);
        for extra in &params {
            self.release(Some(extra), "unused");
        }
        let lease = openai::lease_of(&first);
        let leg = Leg {
            candidates: &split.decode,
            body: Bytes::from(openai::decode_bytes(&req.body, &first)?),
            stage: "decode",
            // The first group's node; the other groups' reservations end here.
            reserved: reserved.into_iter().next(),
            lease: lease.as_ref(),
        };
        let outcome = self.whole(session, req, st, leg).await;
        match &outcome {
            // D could not reach P: its release cannot get through; this one can.
            Ok(Outcome::Ok) if st.lease_left => {
                self.release(Some(&first), "unreachable_from_decode");
            }
            Ok(Outcome::Ok) => {}
            Ok(Outcome::Aborted) => self.release(Some(&first), "client_left"),
            Err(_) => self.release(Some(&first), "decode_failed"),
        }
        outcome
    }

    /// Releases the lease `params` name at P, counted by `why`.
    pub(super) fn release(&self, params: Option<&KvTransferParams>, why: &'static str) {
        if let Some(lease) = params.and_then(openai::lease_of) {
            self.0.leases.release(lease, why);
        }
    }

    /// P prefills and answers with the params naming its leased blocks, one object per
    /// consumer asked for (or fewer, from a node that grants one). `None`: the client left.
    async fn prefill(
        &self,
        session: &mut Session,
        req: &Prepared,
        st: &mut Progress,
        split: &SplitPlan,
    ) -> Result<Option<Vec<KvTransferParams>>, GatewayError> {
        let held = req.pulled().map(|h| h.for_prefill(split.consumers));
        let body = openai::prefill_bytes(req.api, &req.body, split.consumers, held);
        let body = Bytes::from(body?);
        let path = req.path();
        let head = self.head_deadline(req, "prefill");
        let mut walk = self.walk(req, &split.prefill, "prefill");
        let served = loop {
            let Some(node) = walk.next() else {
                break walk.exhausted();
            };
            let _open = node.open();
            let answer = match self
                .send(session, st, node, (path, head, body.clone()))
                .await
            {
                Ok(resp) => self.prefill_answer(session, st, node, resp).await,
                Err(f) => Err(f),
            };
            match answer {
                Ok(params) => break Ok(params),
                Err(f) => {
                    if let Some(end) = walk.fail(node, f) {
                        break end;
                    }
                }
            }
        };
        match served {
            Ok(params) => Ok(Some(params)),
            Err(Failed::Gone) => Ok(None),
            Err(Failed::Fatal(e)) => Err(e),
            Err(Failed::Next(why)) => Err(GatewayError::NoCapacity {
                model: req.analyzed.model.clone(),
                why,
            }),
        }
    }

    /// P's answer read: its params, or why the next prefill node is tried. A client that leaves
    /// meanwhile costs no lease: the answer is read in the background and the leases it names
    /// released.
    async fn prefill_answer(
        &self,
        session: &mut Session,
        st: &mut Progress,
        node: &NodeRef,
        resp: NodeResponse,
    ) -> Result<Vec<KvTransferParams>, Failed> {
        let status = resp.status().as_u16();
        let mut read = Box::pin(resp.bytes());
        let idle = self.0.config.node_idle_timeout;
        let bytes = tokio::select! {
            b = st.timing.wait(&mut read) => b,
            () = sleep_or_never(idle) => {
                return Err(Failed::Next(format!(
                    "{} sent nothing of its answer for {} ms",
                    node.http_addr,
                    idle.unwrap_or_default().as_millis()
                )));
            }
            () = client_gone(session) => {
                let leases = self.0.leases.clone();
                tokio::spawn(async move {
                    if let Ok(body) = read.await
                        && let Ok(params) = openai::prefill_params(&body)
                    {
                        for lease in params.iter().filter_map(openai::lease_of) {
                            leases.release(lease, "client_left");
                        }
                    }
                });
                return Err(Failed::Gone);
            }
            // P hung mid-answer and did not come back. (A lease it granted expires there.)
            () = node.gone() => {
                return Err(Failed::Next(format!(
                    "{} left the view and did not come back",
                    node.http_addr
                )));
            }
        };
        let bytes = bytes.map_err(|e| Failed::Next(format!("{}: {e}", node.http_addr)))?;
        if status >= 400 {
            // The node refused the request itself (too long a prompt, a bad field).
            return Err(Failed::Fatal(GatewayError::Node {
                status,
                body: bytes,
            }));
        }
        openai::prefill_params(&bytes).map_err(|e| Failed::Next(e.to_string()))
    }

    /// D with the children spread: one decode request per group, each with its own lease and
    /// failover list, sent at once; their answers merged into one.
    async fn spread(
        &self,
        session: &mut Session,
        req: &Prepared,
        st: &mut Progress,
        (split, params): (&SplitPlan, Vec<KvTransferParams>),
        reserved: Vec<OnNode>,
    ) -> Result<Outcome, GatewayError> {
        let groups = &split.groups;
        self.0
            .metrics
            .spread
            .with_label_values(&[&groups.len().to_string()])
            .inc();
        // The client's seed, or one drawn here: children on different nodes must not share one.
        let seed = req
            .body
            .get("seed")
            .and_then(Value::as_i64)
            .unwrap_or_else(rand::random);
        let mut bodies = Vec::with_capacity(groups.len());
        for (g, p) in groups.iter().zip(&params) {
            let b = spread::group_body(&openai::decode_body(&req.body, p), g, seed);
            bodies.push(Bytes::from(serde_json::to_vec(&b)?));
        }
        let release_all = |why| {
            for p in &params {
                self.release(Some(p), why);
            }
        };
        let id = session.req_header().headers.get(REQUEST_ID).cloned();
        let path = req.path();
        let head = self.head_deadline(req, "decode");
        let mut reserved = reserved.into_iter();
        let sends = groups.iter().zip(bodies).map(|(g, body)| {
            let mut r = reserved.next();
            let mut walk = self.walk(req, &g.candidates, "decode");
            let id = id.clone();
            // Not watching the client here: the caller does, over all groups at once.
            async move {
                loop {
                    let Some(node) = walk.next() else {
                        break walk.exhausted();
                    };
                    let open = open_on(node, &mut r);
                    match self
                        .post(node, (path, head), body.clone(), id.clone())
                        .await
                    {
                        Ok(resp) => break Ok((resp, open, node.clone())),
                        Err(f) => {
                            if let Some(end) = walk.fail(node, f) {
                                break end;
                            }
                        }
                    }
                }
            }
        });
        let answers = tokio::select! {
            r = st.timing.wait(futures::future::join_all(sends)) => r,
            () = client_gone(session) => {
                release_all("client_left");
                return Ok(Outcome::Aborted);
            }
        };
        let mut resps = Vec::with_capacity(answers.len());
        // Each group's node stays counted busy until the merged answer is over.
        let mut _open = Vec::with_capacity(answers.len());
        let mut nodes = Vec::with_capacity(answers.len());
        for a in answers {
            match a {
                Ok((r, open, node)) => {
                    resps.push(r);
                    _open.push(open);
                    nodes.push(node);
                }
                Err(Failed::Next(why)) => {
                    release_all("decode_failed");
                    return Err(GatewayError::NoCapacity {
                        model: req.analyzed.model.clone(),
                        why,
                    });
                }
                Err(Failed::Gone | Failed::Fatal(_)) => {
                    release_all("client_left");
                    return Ok(Outcome::Aborted);
                }
            }
        }
        if let Some(i) = resps.iter().position(|r| !r.status().is_success()) {
            // A node refused its part (a 4xx): the client's fault, the same on every node.
            release_all("decode_failed");
            let r = resps.swap_remove(i);
            let status = r.status().as_u16();
            let body = r.bytes().await.unwrap_or_default();
            return Err(GatewayError::Node { status, body });
        }
        let parts = Parts {
            offsets: groups.iter().map(|g| g.offset).collect(),
            nodes,
            resps,
        };
        let relay = pd_telemetry::phase!("relay", request_id(session).unwrap_or_default());
        let outcome = self
            .relay_merged(session, st, parts)
            .instrument(relay)
            .await;
        match &outcome {
            Ok(Outcome::Ok) => {}
            Ok(Outcome::Aborted) => release_all("client_left"),
            Err(_) => release_all("decode_failed"),
        }
        outcome
    }
}
