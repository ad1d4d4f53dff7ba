//! Releasing a prefill node's lease from the gateway, over P's `pd.kv.v1.KvPeer` side channel:
//! when the client leaves between P's answer and D's pull, or D fails, P's blocks are freed at
//! once instead of when the lease expires. A release of a lease D already released answers
//! "not live" and changes nothing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pd_rpc::kv as pb;
use pd_rpc::kv::kv_peer_client::KvPeerClient;
use tonic::transport::Channel;
use tracing::{debug, warn};

use crate::metrics::Metrics;
use crate::openai::LeaseRef;

/// Limit on one release call.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(2);

/// Sends releases in the background, one lazily connected channel per side channel.
#[derive(Debug, Clone)]
pub struct LeaseReleaser {
    channels: Arc<Mutex<HashMap<String, Channel>>>,
    metrics: Metrics,
    /// The cluster token, sent with every call (P's side channel requires it).
    token: Option<tonic::metadata::AsciiMetadataValue>,
    /// Mutual TLS with the cluster CA; `None`: plain.
    tls: Option<pd_tls::ClusterTls>,
}

impl LeaseReleaser {
    /// A releaser counting into `metrics`, sending the cluster token `token`, over mutual TLS
    /// with `tls`'s CA when given.
    pub fn new(metrics: Metrics, token: &str, tls: Option<pd_tls::ClusterTls>) -> Self {
        Self {
            channels: Arc::default(),
            metrics,
            token: tonic::metadata::AsciiMetadataValue::try_from(token).ok(),
            tls,
        }
    }

    fn channel(&self, addr: &str) -> Option<Channel> {
        let mut channels = self.channels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = channels.get(addr) {
            return Some(c.clone());
        }
        let endpoint = pd_tls::grpc_endpoint(addr, self.tls.as_ref())
            .ok()?
            .connect_timeout(RELEASE_TIMEOUT)
            .timeout(RELEASE_TIMEOUT);
        let channel = endpoint.connect_lazy();
        channels.insert(addr.to_owned(), channel.clone());
        Some(channel)
    }

    /// Releases `lease` in the background; `why` labels the counter.
    pub fn release(&self, lease: LeaseRef, why: &'static str) {
        let Some(channel) = self.channel(&lease.side_channel) else {
            warn!(addr = %lease.side_channel, "cannot release a lease at an invalid address");
            return;
        };
        let metrics = self.metrics.clone();
        let token = self.token.clone();
        tokio::spawn(async move {
            let mut client = KvPeerClient::new(channel);
            let request = pb::LeaseRef {
                lease_id: lease.lease_id.clone(),
                generation: lease.generation,
                peer_engine_id: String::new(),
                owner_epoch: lease.epoch,
            };
            let mut request = tonic::Request::new(request);
            if let Some(t) = token {
                request
                    .metadata_mut()
                    .insert(pd_rpc::CLUSTER_TOKEN_METADATA, t);
            }
            match client.release_lease(request).await {
                Ok(reply) => {
                    let reply = reply.into_inner();
                    debug!(lease = %lease.lease_id, live = reply.live, reason = %reply.reason, why, "released P's lease");
                    metrics.leases_released.with_label_values(&[why]).inc();
                }
                Err(status) => {
                    warn!(lease = %lease.lease_id, addr = %lease.side_channel, why, "releasing P's lease failed: {}", status.message());
                }
            }
        });
    }
}
