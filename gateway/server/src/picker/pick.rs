//! One request's pick: the same reading, tokenizing, view and policy call as the gateway's own
//! front door (`proxy::prepare`), the decision turned into endpoints instead of upstream calls.
//!
//! A split names D as the endpoint and P in `x-prefiller-host-port` (the decode node runs the
//! prefill there first: `pd-node --prefiller-header`); one node serving alone is named
//! without it. What the picker cannot do here, it leaves to the nodes or refuses: no n>1
//! spreading (one decode node answers every child), no reverse pull of an earlier turn (a
//! retained turn's holder is still preferred through its prefix blocks), no stored
//! `/v1/responses` conversations (those need the gateway's own front door).

use std::net::SocketAddr;

use pd_policy::{Api, Request};
use pd_tokenize::prompt::GIVEN_IDS_FIELD;
use pd_wire::handoff::PREFILLER_HEADER;
use serde_json::Value;

use super::envoy::{DESTINATION, Headers, Pick};
use crate::admission::Admitted;
use crate::cluster::{NodeRef, OnNode, Snapshot};
use crate::error::GatewayError;
use crate::openai::{self, KV_FIELD};
use crate::proxy::Gateway;
use crate::proxy::plan::{self, Facts, Plan};
use crate::proxy::prepare::{check_fits, json_object};
use crate::secret;

/// What the data plane asked about.
#[derive(Debug, Clone, Copy)]
pub struct Asked<'a> {
    /// The request's path.
    pub path: &'a str,
    /// Its headers.
    pub headers: &'a Headers,
    /// Its whole body; `None` for a request without one.
    pub body: Option<&'a [u8]>,
    /// The endpoints the pick must come from (`None`: any).
    pub subset: Option<&'a [String]>,
}

/// A pick and what it holds.
#[derive(Debug)]
pub struct Picked {
    /// What the data plane is told.
    pub pick: Pick,
    /// `split`, `whole` or `any` (a request without a generation body).
    pub route: &'static str,
    /// The picked nodes, counted as open on them until the response's head (the next picks see
    /// them busy).
    pub open: Vec<OnNode>,
    /// A generation request's place under `--max-concurrent-requests` (shared with the front
    /// door: both load the same nodes), held until the data plane ends the exchange.
    pub slot: Option<Admitted>,
}

/// The header a node's credential goes in.
const AUTHORIZATION: &str = "authorization";

/// `host:port` as `ip:port`: the data plane dials the header's address as it is (an
/// `ORIGINAL_DST` cluster takes no name).
async fn ip_port(addr: &str) -> Option<String> {
    if let Ok(a) = addr.parse::<SocketAddr>() {
        return Some(a.to_string());
    }
    let mut found = tokio::net::lookup_host(addr).await.ok()?;
    found.next().map(|a| a.to_string())
}

/// The client's key swapped for what requests to `node` carry (the cluster token for a
/// registered node, a static node's own header): the client's key was checked here, and a node
/// may require a key its clients do not hold, as the front door does it. Without one, the
/// client's `authorization` goes on unchanged.
fn credential(pick: &mut Pick, node: &NodeRef) {
    if let Some(v) = node.bearer.as_ref().and_then(|v| v.to_str().ok()) {
        pick.set.push((AUTHORIZATION, v.to_owned()));
    }
}

/// The nodes of `indices` as endpoints, in order, those outside `subset` left out.
async fn endpoints(
    snapshot: &Snapshot,
    indices: &[u32],
    subset: Option<&[String]>,
) -> Vec<(String, NodeRef)> {
    let mut out = Vec::new();
    for &i in indices {
        let Some(node) = snapshot.nodes.get(i as usize) else {
            continue;
        };
        let Some(addr) = ip_port(&node.http_addr).await else {
            continue;
        };
        if subset.is_some_and(|s| !s.contains(&addr)) || out.iter().any(|(a, _)| *a == addr) {
            continue;
        }
        out.push((addr, node.clone()));
    }
    out
}

impl Gateway {
    fn picker_authorized(&self, headers: &Headers) -> bool {
        let config = &self.0.config;
        config.api_keys.is_empty()
            || headers.bearer().is_some_and(|key| {
                config
                    .api_keys
                    .iter()
                    .chain(&config.trusted_client_token)
                    .any(|k| secret::same_secret(key, k))
            })
    }

    fn picker_trusted(&self, headers: &Headers) -> bool {
        let token = self.0.config.trusted_client_token.as_deref();
        token.is_some_and(|t| headers.bearer().is_some_and(|k| secret::same_secret(k, t)))
    }

    /// A place under `--max-concurrent-requests` for `weight` requests: taken at once, waited
    /// for in line (the data plane's `message_timeout` must outlast `--queue-timeout-ms`), or
    /// refused (429).
    async fn picker_admit(&self, weight: usize) -> Result<Admitted, GatewayError> {
        let s = &self.0;
        let waited = std::time::Instant::now();
        let slot = s.admission.admit_weighted(weight).await;
        s.metrics.queue_wait.observe(waited.elapsed().as_secs_f64());
        slot.map_err(|why| self.refused(why))
    }

    fn no_endpoint(model: &str, why: &str) -> GatewayError {
        GatewayError::NoCapacity {
            model: model.to_owned(),
            why: why.to_owned(),
        }
    }

    /// Picks the endpoint(s) for one request.
    ///
    /// # Errors
    /// What the client is answered with at once: 401, 400 (an unreadable body, too long a
    /// prompt), 404 (an unknown model), 429 (no place under `--max-concurrent-requests`, or the
    /// policy sheds it), 503 (no live endpoint, or none in the subset).
    pub async fn pick(&self, asked: Asked<'_>) -> Result<Picked, GatewayError> {
        let guarded = asked.path.starts_with("/v1/");
        if guarded && !self.picker_authorized(asked.headers) {
            self.0.metrics.unauthorized.inc();
            return Err(GatewayError::Unauthorized);
        }
        match (openai::api_of(asked.path), asked.body) {
            (Some(api), Some(raw)) => self.pick_generation(api, raw, asked).await,
            _ => self.pick_any(asked.subset).await,
        }
    }

    /// A request that is not a generation (`/v1/models`, `/health`, ...): the live node with
    /// the fewest requests on it.
    async fn pick_any(&self, subset: Option<&[String]>) -> Result<Picked, GatewayError> {
        let s = &self.0;
        let mut best: Option<(u32, String, NodeRef)> = None;
        for model in s.cluster.live_models() {
            let snapshot = s.cluster.snapshot(&model, &[]);
            let all: Vec<u32> = (0..u32::try_from(snapshot.nodes.len()).unwrap_or(0)).collect();
            for (addr, node) in endpoints(&snapshot, &all, subset).await {
                let i = snapshot.nodes.iter().position(|n| n.conn == node.conn);
                let load = i
                    .and_then(|i| snapshot.view.nodes.get(i))
                    .map_or(u32::MAX, |n| n.running + n.waiting);
                if best.as_ref().is_none_or(|(l, _, _)| load < *l) {
                    best = Some((load, addr, node));
                }
            }
        }
        let (_, primary, node) =
            best.ok_or_else(|| Self::no_endpoint("", "no live node (in the subset)"))?;
        let mut pick = Pick {
            primary,
            remove: vec![PREFILLER_HEADER],
            ..Pick::default()
        };
        credential(&mut pick, &node);
        Ok(Picked {
            pick,
            route: "any",
            open: vec![node.open()],
            slot: None,
        })
    }

    async fn pick_generation(
        &self,
        api: Api,
        raw: &[u8],
        asked: Asked<'_>,
    ) -> Result<Picked, GatewayError> {
        let s = &self.0;
        let mut body = json_object(raw)?;
        // The prompt's ids are the gateway's to send, and kv_transfer_params only a trusted
        // client's: a client's own copy never reaches a node.
        let mut rewritten = body.remove(GIVEN_IDS_FIELD).is_some();
        let trusted = self.picker_trusted(asked.headers);
        let mut client_params = body.get(KV_FIELD).filter(|v| !v.is_null()).cloned();
        if client_params.is_some() && !trusted {
            body.remove(KV_FIELD);
            client_params = None;
            rewritten = true;
            s.metrics.kv_params_stripped.inc();
        }
        let analyzed = openai::analyze(api, &body, asked.headers.get("x-session-id"))?;
        let weight = match api {
            Api::Completions => analyzed.prompts,
            _ => 1,
        };
        let slot = self.picker_admit(weight).await?;
        let (tokens, hashes, block_size) = self.prompt_blocks(&analyzed).await?;
        let snapshot = s.cluster.snapshot(&analyzed.model, &hashes);
        check_fits(&snapshot, &analyzed, tokens.len())?;
        let request = Request {
            seq: s.router.next_seq(),
            api,
            prompt_tokens: u32::try_from(tokens.len()).unwrap_or(u32::MAX),
            block_size,
            block_hashes: hashes,
            prefix_blocks: snapshot.prefix_blocks.clone(),
            n: analyzed.n,
            max_tokens: analyzed.max_tokens,
            stream: analyzed.stream,
            conversation_key: analyzed.conversation_key.clone(),
        };
        let decided = s.router.decide(
            &request,
            &snapshot.view,
            &snapshot.measured,
            &snapshot.names,
        )?;
        let facts = Facts {
            held: None,
            reverse_pull: None,
            one_node: analyzed.scores_prompt || analyzed.prompts > 1,
            client_asks_prefill: client_params
                .as_ref()
                .map(|p| p.get("do_remote_decode") == Some(&Value::Bool(true))),
            n: analyzed.n,
        };
        let body = if rewritten {
            Some(serde_json::to_vec(&body).map_err(crate::error::InternalError::from)?)
        } else {
            None
        };
        let model = analyzed.model;
        let (route, dest, prefill) = match plan::plan(decided.decision.route, &facts).plan {
            Plan::Reject { status, message } => {
                return Err(GatewayError::Rejected { status, message });
            }
            Plan::Whole { candidates, .. } => ("whole", candidates, None),
            Plan::Split(sp) => {
                let prefill = endpoints(&snapshot, &sp.prefill, None).await;
                let first = prefill.into_iter().next().ok_or_else(|| {
                    Self::no_endpoint(&model, "no prefill node of the decision is reachable")
                })?;
                ("split", sp.decode, Some(first))
            }
        };
        let mut dest = endpoints(&snapshot, &dest, asked.subset).await.into_iter();
        let (primary, node) = dest.next().ok_or_else(|| {
            Self::no_endpoint(
                &model,
                "no node the policy chose is in the data plane's subset",
            )
        })?;
        let mut open = vec![node.open()];
        // A fallback gets the primary's credential: only nodes taking the same one qualify.
        let fallback = dest.filter(|(_, n)| n.bearer == node.bearer);
        let mut pick = Pick {
            primary,
            fallback: fallback.map(|(a, _)| a).collect(),
            body,
            ..Pick::default()
        };
        credential(&mut pick, &node);
        match prefill {
            Some((addr, p)) => {
                open.push(p.open());
                pick.set.push((PREFILLER_HEADER, addr));
            }
            None => pick.remove.push(PREFILLER_HEADER),
        }
        debug_assert!(!pick.set.iter().any(|(k, _)| *k == DESTINATION));
        Ok(Picked {
            pick,
            route,
            open,
            slot: Some(slot),
        })
    }
}
