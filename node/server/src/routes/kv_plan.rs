//! A request's `kv_transfer_params` read against this node's role and peers ([`KvPlan`]):
//! what it asks (produce, consume, nothing), the producers it may contact, and the leases it
//! releases when it goes no further.

use std::sync::Arc;

use pd_engine::KvTransfer;

use super::AppState;
use crate::disagg::Disagg;
use crate::error::ApiError;
use crate::kv_params::{self, KvDirective};

impl AppState {
    /// Reads a request's `kv_transfer_params` and checks it against this node's role. A list
    /// form holds at most one object per completion (`n`): each names a lease this node would
    /// renew and release, so the bound caps what one request can make it hold.
    pub(crate) fn kv_directive(
        &self,
        params: Option<&serde_json::Value>,
        n: usize,
    ) -> Result<KvPlan, ApiError> {
        if let Some(serde_json::Value::Array(items)) = params
            && items.len() > n.max(1)
        {
            return Err(ApiError::InvalidRequest {
                message: format!(
                    "{} lists {} objects; at most one per completion (n = {n})",
                    kv_params::FIELD,
                    items.len()
                ),
                param: Some(kv_params::FIELD.into()),
            });
        }
        let mut d = kv_params::parse(params)?;
        let asked = match &d {
            KvDirective::None => None,
            KvDirective::Produce { .. } => Some("produce"),
            KvDirective::Consume(_) => Some("consume"),
            KvDirective::Incomplete { .. } => Some("incomplete"),
        };
        if let Some(directive) = asked {
            self.disagg
                .node_metrics
                .kv_params_requests
                .with_label_values(&[directive])
                .inc();
        }
        let role = self.disagg.role;
        let refuse = |what: &str, role_needed: &str| ApiError::InvalidRequest {
            message: format!(
                "{what} needs a node started with --kv-role {role_needed}; this node is {}",
                role.as_str()
            ),
            param: Some(kv_params::FIELD.into()),
        };
        match &d {
            KvDirective::None => {}
            KvDirective::Produce { .. } if !role.produces() || self.disagg.advert.is_none() => {
                return Err(refuse("do_remote_decode", "kv_producer"));
            }
            KvDirective::Produce { held, .. } => self.check_peers(held)?,
            // A prefill node pulls too (a turn's history, back from its holder), so it also
            // serves a request that pulls and then decodes here: a policy may keep a turn
            // whole on P.
            KvDirective::Consume(_) | KvDirective::Incomplete { .. }
                if !role.pulls() || self.disagg.consumer.is_none() =>
            {
                return Err(refuse("do_remote_prefill", "kv_consumer or kv_producer"));
            }
            KvDirective::Consume(remotes) => {
                if let Err(refused) = self.check_peers(remotes) {
                    if !self.recomputes_instead() {
                        return Err(refused);
                    }
                    // A producer the gateways no longer list (it left the view after the
                    // request was routed): not contacted, the prompt computed here.
                    self.disagg
                        .metrics
                        .recomputes
                        .with_label_values(&["peer_not_allowed"])
                        .inc();
                    tracing::warn!(error = %refused, "computing locally instead");
                    d = KvDirective::None;
                }
            }
            KvDirective::Incomplete { missing } => {
                // As vLLM: no pull. Unlike vLLM: counted and logged.
                self.disagg
                    .metrics
                    .incomplete_params
                    .with_label_values(&[missing])
                    .inc();
                tracing::warn!(
                    missing,
                    "kv_transfer_params asks for a remote prefill but lacks a field: computing locally"
                );
            }
        }
        Ok(KvPlan {
            directive: d,
            disagg: self.disagg.clone(),
        })
    }

    /// Whether a pull that cannot be made is computed here instead (`--kv-load-failure-policy
    /// recompute`).
    fn recomputes_instead(&self) -> bool {
        self.disagg
            .consumer
            .as_ref()
            .is_some_and(|c| c.config().policy == pd_kv_transfer::FailurePolicy::Recompute)
    }

    /// Refuses params naming a peer this node may not pull from, before anything is contacted
    /// (not even to release the lease): `remote_host` comes from the client.
    fn check_peers(&self, remotes: &[kv_params::Remote]) -> Result<(), ApiError> {
        if remotes.is_empty() {
            return Ok(());
        }
        let Some(consumer) = &self.disagg.consumer else {
            return Err(ApiError::InvalidRequest {
                message: "this node cannot pull KV: it was started without --kv-port".into(),
                param: Some(kv_params::FIELD.into()),
            });
        };
        match remotes
            .iter()
            .find_map(|r| consumer.check_peer(&r.host, r.port).err())
        {
            Some(refusal) => Err(ApiError::InvalidRequest {
                message: refusal.to_string(),
                param: Some(format!("{}.remote_host", kv_params::FIELD)),
            }),
            None => Ok(()),
        }
    }
}

/// A request's P/D directive between parsing and submission. Dropped before it reaches
/// [`AppState::events`] (a later 4xx, an engine refusal), it releases the producer's leases at
/// once instead of leaving them to expire.
#[derive(Debug)]
pub(crate) struct KvPlan {
    pub(super) directive: KvDirective,
    pub(super) disagg: Arc<Disagg>,
}

impl KvPlan {
    /// The engine's part.
    pub(crate) fn transfer(&self) -> KvTransfer {
        match self.directive {
            KvDirective::Produce {
                consumers,
                ref held,
            } if held.is_empty() => KvTransfer::Produce { consumers },
            KvDirective::Produce { consumers, .. } => KvTransfer::PullThenProduce { consumers },
            KvDirective::Consume(_) => KvTransfer::Consume,
            KvDirective::None | KvDirective::Incomplete { .. } => KvTransfer::Local,
        }
    }

    /// Checks the params against the tokenized prompt, in this engine's blocks and under its
    /// binding key: a mismatch is the caller's error (400 naming the field), found before
    /// anything is read.
    pub(crate) fn check_prompt(
        &self,
        prompt: &[u32],
        engine: &pd_engine::EngineInfo,
    ) -> Result<(), ApiError> {
        if let KvDirective::Consume(remotes) | KvDirective::Produce { held: remotes, .. } =
            &self.directive
        {
            for r in remotes {
                let (block_size, key) = (engine.block_size, &engine.binding_key);
                let checked = pd_kv_transfer::consumer::check_prompt(r, prompt, block_size, key);
                checked.map_err(|e| ApiError::InvalidRequest {
                    message: format!("kv_transfer_params do not match this request: {e}"),
                    param: Some(format!("{}.{}", kv_params::FIELD, e.field)),
                })?;
            }
        }
        Ok(())
    }
}

impl Drop for KvPlan {
    fn drop(&mut self) {
        if let KvDirective::Consume(remotes) | KvDirective::Produce { held: remotes, .. } =
            &self.directive
        {
            self.disagg.release(remotes);
        }
    }
}
