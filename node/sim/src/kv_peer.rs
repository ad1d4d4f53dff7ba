//! The side channel of a simulated node (`pd.kv.v1.KvPeer`), as far as a router uses it: lease
//! renewal, confirmation and release against the fleet's lease table. There are no blocks to
//! read: `Handshake` and `PoolStats` answer `UNIMPLEMENTED`.

use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use pd_rpc::kv::kv_peer_server::KvPeer;
use pd_rpc::kv::{
    HandshakeReply, HandshakeRequest, LeaseRef, LeaseReply, PoolStatsReply, PoolStatsRequest,
};
use tonic::{Request, Response, Status};

use crate::state::Leases;

/// The service, shared by every node of a fleet.
#[derive(Debug, Clone)]
pub(crate) struct SimKvPeer(pub(crate) Arc<Leases>);

impl SimKvPeer {
    fn reply(&self, lease: &LeaseRef, release: bool) -> Result<Response<LeaseReply>, Status> {
        let id = u128::from_str_radix(&lease.lease_id, 16)
            .map_err(|_| Status::invalid_argument("lease_id must be 32 hex digits"))?;
        let deadline = self.0.deadline(id);
        if release {
            self.0.release(id);
        }
        let reply = match deadline {
            Some(at) => LeaseReply {
                live: true,
                deadline_unix_ms: unix_ms(at),
                ..LeaseReply::default()
            },
            None => LeaseReply {
                reason: "unknown".into(),
                ..LeaseReply::default()
            },
        };
        Ok(Response::new(reply))
    }
}

fn unix_ms(at: Instant) -> i64 {
    let now = SystemTime::now() + at.saturating_duration_since(Instant::now());
    now.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

#[tonic::async_trait]
impl KvPeer for SimKvPeer {
    async fn handshake(
        &self,
        _: Request<HandshakeRequest>,
    ) -> Result<Response<HandshakeReply>, Status> {
        Err(Status::unimplemented(
            "a simulated node holds no KV to read",
        ))
    }

    async fn renew_lease(&self, r: Request<LeaseRef>) -> Result<Response<LeaseReply>, Status> {
        self.reply(r.get_ref(), false)
    }

    async fn confirm_lease(&self, r: Request<LeaseRef>) -> Result<Response<LeaseReply>, Status> {
        self.reply(r.get_ref(), false)
    }

    async fn release_lease(&self, r: Request<LeaseRef>) -> Result<Response<LeaseReply>, Status> {
        self.reply(r.get_ref(), true)
    }

    async fn pool_stats(
        &self,
        _: Request<PoolStatsRequest>,
    ) -> Result<Response<PoolStatsReply>, Status> {
        Err(Status::unimplemented("a simulated node has no pool"))
    }
}
