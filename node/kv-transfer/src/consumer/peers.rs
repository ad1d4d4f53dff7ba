//! A consumer's side channels to producers: one client per producer address (at most
//! [`super::MAX_PEER_CLIENTS`]), handshakes cached per address and redone when a producer
//! restarted, the check that the producer is the engine and incarnation the params name, the
//! beat of its lease board as mapped here, and the release of its leases.

use std::time::Duration;

use super::{Consumer, MAX_PEER_CLIENTS, Remote};
use crate::peer::{PeerClient, PeerInfo, TransferError};

impl Consumer {
    /// The side-channel client of the producer at `addr` (cached; no lock held across the
    /// connect).
    pub(super) async fn client(&self, addr: &str) -> Result<PeerClient, TransferError> {
        if let Some(c) = self
            .clients
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(addr)
        {
            return Ok(c.clone());
        }
        let c = PeerClient::connect(addr, &self.cfg.engine_id, self.cfg.tls.as_ref())
            .await?
            .with_cluster_token(self.cfg.cluster_token.clone());
        let mut clients = self.clients.lock().unwrap_or_else(|p| p.into_inner());
        if clients.len() >= MAX_PEER_CLIENTS
            && let Some(old) = clients.keys().find(|k| *k != addr).cloned()
        {
            // Bounded: the dropped producer reconnects (and handshakes) when it is named again.
            clients.remove(&old);
            self.handshakes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .invalidate(&old);
        }
        clients.insert(addr.to_string(), c.clone());
        Ok(c)
    }

    /// Forgets a producer after a failure, so the next request connects and handshakes afresh
    /// (and the puller opens a new endpoint to `engine_id`).
    pub(super) fn forget(&self, addr: &str, engine_id: &str) {
        self.clients
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(addr);
        self.handshakes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .invalidate(addr);
        self.puller.forget(engine_id);
    }

    /// A handshake with the producer at `addr` (cached unless `fresh`; no lock held across the
    /// call).
    async fn handshake(
        &self,
        client: &mut PeerClient,
        addr: &str,
        fresh: bool,
    ) -> Result<PeerInfo, TransferError> {
        if !fresh
            && let Some(p) = self
                .handshakes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .lookup(addr)
        {
            return Ok(p);
        }
        let p = client
            .handshake(&self.compat, self.epoch, self.cfg.skip_compat_check)
            .await?;
        self.handshakes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .observe(addr, p.clone());
        Ok(p)
    }

    /// How long ago (by the producer's clock, as the cached handshake of the incarnation the
    /// params name stated it) the lease board of `remote`'s producer, mapped here, beat (granted
    /// a lease); `None` when its board is not mapped here, it never beat, or no such handshake
    /// is cached.
    pub(super) fn board_beat_age(&self, remote: &Remote) -> Option<Duration> {
        let epoch = remote.epoch?;
        let cache = self.handshakes.lock().unwrap_or_else(|p| p.into_inner());
        cache
            .cached(&remote.side_channel())
            .filter(|peer| peer.engine_id == remote.engine_id && peer.epoch == epoch)
            .and_then(|peer| peer.owner_clock)
            .zip(self.puller.board_beat(&remote.engine_id, epoch))
            .and_then(|(clock, beat)| clock.age(beat, crate::monotonic_ns()))
    }

    /// Reaches the producer of `remote` and checks it is the engine and incarnation the params
    /// name (cancellable: nothing is written locally yet).
    pub(super) async fn prepare(
        &self,
        remote: &Remote,
    ) -> Result<(PeerClient, PeerInfo), TransferError> {
        let addr = remote.side_channel();
        let mut client = self.client(&addr).await?;
        let mut peer = self.handshake(&mut client, &addr, false).await?;
        let named = |peer: &PeerInfo| remote.epoch.is_none_or(|e| e == peer.epoch);
        if peer.engine_id != remote.engine_id || !named(&peer) {
            // The producer restarted (another id, or the same id in a new incarnation): the
            // cached handshake's worker and keys are the old process's. Ask again once.
            peer = self.handshake(&mut client, &addr, true).await?;
        }
        if peer.engine_id != remote.engine_id {
            return Err(TransferError::Mismatch(format!(
                "remote_engine_id is {:?} but {addr} is engine {:?}",
                remote.engine_id, peer.engine_id
            )));
        }
        if !named(&peer) {
            // Params from an earlier incarnation: their lease and blocks died with it.
            return Err(TransferError::LeaseLost {
                lease: remote.lease.to_string(),
                reason: "stale_epoch".into(),
            });
        }
        // Lease calls name the incarnation the reads go to; another one refuses them.
        client.name_owner_epoch(peer.epoch);
        Ok((client, peer))
    }

    /// Releases the leases of `remotes` (deduplicated) in the background; unacknowledged
    /// releases are counted (the lease then ends by expiry on the producer). Outside a tokio
    /// runtime (a node shutting down) nothing is sent.
    pub fn release(self: &std::sync::Arc<Self>, remotes: &[Remote]) {
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let mut seen = std::collections::HashSet::new();
        for r in remotes {
            if !seen.insert((r.side_channel(), r.lease, r.generation)) {
                continue;
            }
            let consumer = self.clone();
            let r = r.clone();
            tokio::spawn(async move {
                let result = match consumer.client(&r.side_channel()).await {
                    Ok(mut c) => {
                        // Name the incarnation the params came from: a restarted producer
                        // refuses.
                        c.name_owner_epoch(r.epoch.unwrap_or(0));
                        c.release(r.lease, r.generation).await
                    }
                    Err(e) => Err(e),
                };
                if let Err(e) = result {
                    consumer.metrics.notification_failures.inc();
                    tracing::warn!(lease = %r.lease, producer = %r.engine_id, error = %e, "releasing a KV lease failed");
                }
            });
        }
    }
}
