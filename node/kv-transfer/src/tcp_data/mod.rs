//! Leased blocks over plain TCP, for peers UCX reaches only over TCP.
//!
//! Between machines without RDMA, UCX emulates one-sided reads on a socket at about a third of
//! what one TCP stream carries on the same link (BENCHMARKS.md, "KV pull between hosts"). Here
//! the owner sends the bytes of blocks under a live lease granted to the caller straight from
//! its pool ([`DataServer`]), and the reader receives them over several connections at once
//! straight into its own blocks ([`read_blocks`]). Nothing else changes: the reader still
//! confirms the lease after the bytes are in (`ConfirmLease`), so live then means live during
//! the whole send, and checks what the blocks hold against its prompt. [`pull`] is the
//! puller's side: a pull of a lease's blocks over such a port, cancel-safe.
//!
//! One request per connection. Little-endian throughout:
//! - hello: `PDKV`, version `1`, `u16` length + cluster token, `u16` length + the caller's
//!   engine id; the owner answers one byte (0: admitted);
//! - request: lease id (`u128`), generation (`u64`), the block ids to send (`u32` count, then
//!   `u32` each: every one must be a block of that lease, live for the caller);
//! - answer: `0` then those blocks' bytes in order, or `1`, a `u16` length and why.
//!
//! Under the cluster's mutual TLS (`--tls-*`) the same exchange runs inside a TLS session: the
//! owner accepts only certificates from the cluster CA, the reader checks the owner's names
//! its data host. The token is still checked inside.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pd_kv_pool::{BlockId, LeaseId};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::watch;

use crate::lease_authority::LeaseAuthority;

pub mod pull;

const MAGIC: &[u8; 5] = b"PDKV\x01";
/// Longest token or engine id a hello may carry.
const MAX_NAME: usize = 4096;
/// Most block ids one request may name.
pub const MAX_BLOCKS: u32 = 1 << 20;
/// How long a connection may take to say what it wants.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a data request failed.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// The socket failed.
    #[error("KV data connection: {0}")]
    Io(#[from] std::io::Error),
    /// The owner refused the request, saying why.
    #[error("the owner refused the KV data request: {0}")]
    Refused(String),
    /// The request was malformed or out of bounds.
    #[error("bad KV data request: {0}")]
    Bad(&'static str),
    /// The owner's address names no host a certificate could carry.
    #[error("KV data port under TLS: {0}")]
    Tls(#[from] pd_tls::TlsError),
}

/// Why the owner refuses a data request (sent to the reader as text).
#[derive(Debug, thiserror::Error)]
enum Refusal {
    /// The lease is not live for the reader.
    #[error("lease {lease}: {source}")]
    Lease {
        lease: LeaseId,
        source: pd_kv_pool::LeaseError,
    },
    /// A block named is not one of the lease's.
    #[error("blocks named are not lease {0}'s")]
    NotTheLeases(LeaseId),
    /// A block named lies outside the pool.
    #[error("a block outside the pool")]
    OutsidePool,
}

/// The owner's pool as bytes: where it starts, how long it is, how big a block is.
#[derive(Debug, Clone, Copy)]
pub struct PoolBytes {
    /// Address of block 0.
    pub base: usize,
    /// Bytes of blocks (the lease board after them is not served).
    pub len: usize,
    /// Bytes per block.
    pub block_bytes: usize,
}

/// Serves leased blocks' bytes to peers over TCP.
pub struct DataServer {
    pool: PoolBytes,
    /// Keeps the pool's memory alive as long as the server can read it.
    _keep: Arc<dyn Send + Sync>,
    authority: Arc<dyn LeaseAuthority>,
    token: watch::Receiver<Option<String>>,
    /// Requests refused (token, lease or bounds).
    refused: prometheus::IntCounter,
    /// Mutual TLS with the cluster CA ([`DataServer::with_tls`]); `None`: plain TCP.
    tls: Option<pd_tls::tokio_rustls::TlsAcceptor>,
}

impl std::fmt::Debug for DataServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataServer")
            .field("pool", &self.pool)
            .finish_non_exhaustive()
    }
}

impl DataServer {
    /// A server of `pool`, whose memory `keep` owns, deciding leases with `authority` and
    /// admitting callers that present `token` (none set: everyone, as the side channel does);
    /// refusals count in `refused`.
    ///
    /// # Safety
    /// `pool` must describe memory that stays mapped and readable while `keep` lives.
    pub unsafe fn new(
        pool: PoolBytes,
        keep: Arc<dyn Send + Sync>,
        authority: Arc<dyn LeaseAuthority>,
        token: watch::Receiver<Option<String>>,
        refused: prometheus::IntCounter,
    ) -> Self {
        Self {
            pool,
            _keep: keep,
            authority,
            token,
            refused,
            tls: None,
        }
    }

    /// Serves only over mutual TLS with `tls`'s CA.
    #[must_use]
    pub fn with_tls(mut self, tls: &pd_tls::ClusterTls) -> Self {
        self.tls = Some(tls.acceptor());
        self
    }

    /// Accepts connections on `listener` until `stop` resolves, each on a task of its own.
    pub async fn serve(
        self: Arc<Self>,
        listener: tokio::net::TcpListener,
        stop: impl std::future::Future<Output = ()>,
    ) {
        tokio::pin!(stop);
        loop {
            tokio::select! {
                () = &mut stop => return,
                accepted = listener.accept() => {
                    let Ok((stream, peer)) = accepted else { continue };
                    let _ = stream.set_nodelay(true);
                    let me = self.clone();
                    tokio::spawn(async move {
                        let answered = match &me.tls {
                            Some(tls) => {
                                let shake = tokio::time::timeout(
                                    pd_tls::HANDSHAKE_TIMEOUT,
                                    tls.accept(stream),
                                );
                                match shake.await {
                                    Ok(Ok(s)) => me.answer(s).await,
                                    Ok(Err(e)) => {
                                        me.refused.inc();
                                        tracing::warn!(%peer, error = %e, "KV data port: TLS handshake refused");
                                        return;
                                    }
                                    Err(_) => return,
                                }
                            }
                            None => me.answer(stream).await,
                        };
                        if let Err(e) = answered {
                            tracing::debug!(%peer, error = %e, "KV data request ended");
                        }
                    });
                }
            }
        }
    }

    async fn answer<S: AsyncRead + AsyncWrite + Unpin>(&self, mut s: S) -> Result<(), DataError> {
        let asked = tokio::time::timeout(REQUEST_TIMEOUT, self.read_request(&mut s))
            .await
            .map_err(|_| DataError::Bad("no request in time"))??;
        let (peer, lease, generation, ids) = asked;
        if let Err(why) = self.check(&peer, lease, generation, &ids) {
            self.refused.inc();
            let why = why.to_string();
            let msg = why.as_bytes();
            let len = msg.len().min(u16::MAX as usize);
            s.write_u8(1).await?;
            s.write_u16_le(len as u16).await?;
            s.write_all(&msg[..len]).await?;
            return Ok(());
        }
        s.write_u8(0).await?;
        for id in &ids {
            let off = id.0 as usize * self.pool.block_bytes;
            // SAFETY: `check` kept the block inside the pool (`off + block_bytes <= len`); the
            // pool stays mapped while `_keep` lives (the constructor's contract); a block under
            // a live lease is not written until the lease ends, and a lease that ends during
            // the send is caught by the reader's confirmation after it.
            let bytes = unsafe {
                std::slice::from_raw_parts(
                    (self.pool.base + off) as *const u8,
                    self.pool.block_bytes,
                )
            };
            s.write_all(bytes).await?;
        }
        s.flush().await?;
        Ok(())
    }

    /// The hello and the request, bounded.
    async fn read_request<S: AsyncRead + AsyncWrite + Unpin>(
        &self,
        s: &mut S,
    ) -> Result<(String, LeaseId, u64, Vec<BlockId>), DataError> {
        let mut magic = [0u8; 5];
        s.read_exact(&mut magic).await?;
        if &magic != MAGIC {
            return Err(DataError::Bad("not a KV data hello"));
        }
        let token = read_name(s).await?;
        let peer = read_name(s).await?;
        let expected = self.token.borrow().clone().filter(|t| !t.is_empty());
        let admitted = expected
            .as_deref()
            .is_none_or(|t| crate::constant_time_eq(t.as_bytes(), token.as_bytes()));
        if !admitted {
            self.refused.inc();
            s.write_u8(1).await?;
            return Err(DataError::Refused("wrong cluster token".into()));
        }
        s.write_u8(0).await?;
        let lease = LeaseId(s.read_u128_le().await?);
        let generation = s.read_u64_le().await?;
        let n = s.read_u32_le().await?;
        if n == 0 || n > MAX_BLOCKS {
            return Err(DataError::Bad("block count out of bounds"));
        }
        let mut ids = Vec::with_capacity(n as usize);
        for _ in 0..n {
            ids.push(BlockId(s.read_u32_le().await?));
        }
        Ok((peer, lease, generation, ids))
    }

    /// The lease is live for `peer`, each of `ids` is one of its blocks and lies inside the
    /// pool.
    fn check(
        &self,
        peer: &str,
        lease: LeaseId,
        generation: u64,
        ids: &[BlockId],
    ) -> Result<(), Refusal> {
        let covered = self
            .authority
            .covers(lease, generation, peer, ids)
            .map_err(|source| Refusal::Lease { lease, source })?;
        if !covered {
            return Err(Refusal::NotTheLeases(lease));
        }
        let bb = self.pool.block_bytes;
        if ids
            .iter()
            .any(|b| (b.0 as usize).saturating_add(1).saturating_mul(bb) > self.pool.len)
        {
            return Err(Refusal::OutsidePool);
        }
        Ok(())
    }
}

async fn read_name<S: AsyncRead + Unpin>(s: &mut S) -> Result<String, DataError> {
    let len = s.read_u16_le().await? as usize;
    if len > MAX_NAME {
        return Err(DataError::Bad("name too long"));
    }
    let mut buf = vec![0u8; len];
    s.read_exact(&mut buf).await?;
    String::from_utf8(buf).map_err(|_| DataError::Bad("name is not UTF-8"))
}

/// What [`read_blocks`] reads, and from whom.
#[derive(Debug, Clone)]
pub struct DataRequest<'a> {
    /// `host:port` of the owner's data port.
    pub addr: &'a str,
    /// The cluster token (empty: none).
    pub token: &'a str,
    /// The caller's engine id (the lease's grantee).
    pub me: &'a str,
    /// The lease.
    pub lease: LeaseId,
    /// Its generation.
    pub generation: u64,
    /// The lease's blocks on the owner, in order.
    pub remote: &'a [BlockId],
    /// Where each lands here.
    pub local: &'a [BlockId],
    /// Bytes per block (both sides).
    pub block_bytes: usize,
    /// Connections to read over at once.
    pub connections: usize,
    /// Give up at.
    pub deadline: Instant,
    /// Mutual TLS with the cluster CA; `None`: plain TCP.
    pub tls: Option<&'a pd_tls::ClusterTls>,
}

/// Reads `req.remote[i]` into local block `req.local[i]` of the pool at `dst` (`dst_len`
/// bytes), over `req.connections` connections each taking a contiguous part; returns the bytes
/// read. Blocks the thread (run it off the async reactor).
///
/// # Safety
/// `dst .. dst + dst_len` must be this node's pool, mapped and writable, with the local blocks
/// reserved for this read (nothing else reads or writes them until it returns).
///
/// # Errors
/// A connection failed or the owner refused.
pub unsafe fn read_blocks(
    req: &DataRequest<'_>,
    dst: *mut u8,
    dst_len: usize,
) -> Result<usize, DataError> {
    // SAFETY: the caller's contract.
    unsafe { read_blocks_until(req, dst, dst_len, &Cancel::default()) }
}

/// Stops a [`read_blocks_until`] from another thread: its connections are shut down, so every
/// read returns at once, and no block is written after the reader threads return.
#[derive(Debug, Default)]
pub struct Cancel {
    stop: std::sync::atomic::AtomicBool,
    streams: std::sync::Mutex<Vec<TcpStream>>,
}

impl Cancel {
    /// Shuts every connection down; readers stop at their next read.
    pub fn cancel(&self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        for s in self
            .streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    fn stopped(&self) -> bool {
        self.stop.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Registers `s` (a clone) to be shut down on cancel; false when already cancelled.
    fn watch(&self, s: &TcpStream) -> bool {
        let mut streams = self.streams.lock().unwrap_or_else(|e| e.into_inner());
        if self.stopped() {
            return false;
        }
        if let Ok(c) = s.try_clone() {
            streams.push(c);
        }
        true
    }
}

/// [`read_blocks`], stopped early by `cancel`.
///
/// # Safety
/// As [`read_blocks`]. After it returns nothing writes the local blocks.
///
/// # Errors
/// As [`read_blocks`]; a cancelled read fails.
pub unsafe fn read_blocks_until(
    req: &DataRequest<'_>,
    dst: *mut u8,
    dst_len: usize,
    cancel: &Cancel,
) -> Result<usize, DataError> {
    let n = req.remote.len();
    if n == 0 || n != req.local.len() || n > MAX_BLOCKS as usize {
        return Err(DataError::Bad("block lists differ or are out of bounds"));
    }
    let bb = req.block_bytes;
    if req
        .local
        .iter()
        .any(|b| (b.0 as usize).saturating_add(1).saturating_mul(bb) > dst_len)
    {
        return Err(DataError::Bad("a local block outside the pool"));
    }
    let conns = req.connections.clamp(1, n);
    let per = n.div_ceil(conns);
    let dst = dst as usize;
    std::thread::scope(|scope| {
        let parts: Vec<_> = (0..n)
            .step_by(per)
            .map(|first| {
                let count = per.min(n - first);
                scope.spawn(move || {
                    // SAFETY: the caller's contract; parts write disjoint local blocks.
                    unsafe { read_part(req, first, count, dst as *mut u8, cancel) }
                })
            })
            .collect();
        let mut total = 0;
        for p in parts {
            total += p
                .join()
                .map_err(|_| DataError::Bad("a reader thread panicked"))??;
        }
        Ok(total)
    })
}

/// One connection's part: blocks `first .. first + count` of the request.
unsafe fn read_part(
    req: &DataRequest<'_>,
    first: usize,
    count: usize,
    dst: *mut u8,
    cancel: &Cancel,
) -> Result<usize, DataError> {
    let left = req.deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(DataError::Io(std::io::ErrorKind::TimedOut.into()));
    }
    let addr = std::net::ToSocketAddrs::to_socket_addrs(req.addr)?
        .next()
        .ok_or(DataError::Bad("no address"))?;
    let mut s = TcpStream::connect_timeout(&addr, left)?;
    if !cancel.watch(&s) {
        return Err(DataError::Bad("cancelled"));
    }
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(left))?;
    s.set_write_timeout(Some(left))?;
    match req.tls {
        Some(tls) => {
            let host = req.addr.rsplit_once(':').map_or(req.addr, |(h, _)| h);
            let conn = pd_tls::rustls::ClientConnection::new(
                tls.client_config(),
                pd_tls::server_name(host)?,
            )
            .map_err(std::io::Error::other)?;
            let mut s = pd_tls::rustls::StreamOwned::new(conn, s);
            // SAFETY: the caller's contract.
            unsafe { exchange(&mut s, req, first, count, dst, cancel) }
        }
        // SAFETY: the caller's contract.
        None => unsafe { exchange(&mut s, req, first, count, dst, cancel) },
    }
}

/// One connection's request and answer, over `s` (plain or TLS).
///
/// # Safety
/// As [`read_part`].
unsafe fn exchange<S: Read + Write>(
    s: &mut S,
    req: &DataRequest<'_>,
    first: usize,
    count: usize,
    dst: *mut u8,
    cancel: &Cancel,
) -> Result<usize, DataError> {
    let mut hello = Vec::with_capacity(16 + req.token.len() + req.me.len());
    hello.extend_from_slice(MAGIC);
    for name in [req.token, req.me] {
        hello.extend_from_slice(&(name.len().min(MAX_NAME) as u16).to_le_bytes());
        hello.extend_from_slice(&name.as_bytes()[..name.len().min(MAX_NAME)]);
    }
    hello.extend_from_slice(&req.lease.0.to_le_bytes());
    hello.extend_from_slice(&req.generation.to_le_bytes());
    hello.extend_from_slice(&(count as u32).to_le_bytes());
    for b in &req.remote[first..first + count] {
        hello.extend_from_slice(&b.0.to_le_bytes());
    }
    s.write_all(&hello)?;
    let mut status = [0u8; 1];
    s.read_exact(&mut status)?;
    if status[0] != 0 {
        return Err(DataError::Refused("wrong cluster token".into()));
    }
    s.read_exact(&mut status)?;
    if status[0] != 0 {
        let mut len = [0u8; 2];
        s.read_exact(&mut len)?;
        let mut why = vec![0u8; u16::from_le_bytes(len) as usize];
        s.read_exact(&mut why)?;
        return Err(DataError::Refused(
            String::from_utf8_lossy(&why).into_owned(),
        ));
    }
    let bb = req.block_bytes;
    for b in &req.local[first..first + count] {
        if cancel.stopped() || Instant::now() >= req.deadline {
            return Err(DataError::Bad("cancelled or past the deadline"));
        }
        // SAFETY: `read_blocks` checked the block lies inside the pool; the caller reserved it.
        let block = unsafe { std::slice::from_raw_parts_mut(dst.add(b.0 as usize * bb), bb) };
        s.read_exact(block)?;
    }
    Ok(count * bb)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease_authority::LocalBlocks;

    /// An owner with 8 blocks of 64 bytes (block i filled with i), one lease on blocks 5, 2, 7
    /// for "d0"; returns the server's address, the lease and its generation.
    async fn owner(token: Option<&str>) -> (String, LeaseId, u64, Arc<LocalBlocks>) {
        let bb = 64;
        let pool: Arc<Vec<u8>> = Arc::new((0..8u8).flat_map(|i| vec![i; bb]).collect());
        let blocks = Arc::new(LocalBlocks::new(8, Duration::from_secs(30), [7; 32]));
        let leased = vec![BlockId(5), BlockId(2), BlockId(7)];
        let lease = blocks.with(|a, l| {
            a.allocate_n(8).expect("blocks");
            for &b in &leased {
                a.share(b);
            }
            l.grant(leased.clone(), Default::default(), "d0", Instant::now())
        });
        let (_tx, rx) = watch::channel(token.map(str::to_owned));
        std::mem::forget(_tx);
        let registry = prometheus::IntCounter::new("refused", "refused").expect("counter");
        let bytes = PoolBytes {
            base: pool.as_ptr() as usize,
            len: pool.len(),
            block_bytes: bb,
        };
        // SAFETY: `pool` is kept alive by the server.
        let server =
            Arc::new(unsafe { DataServer::new(bytes, pool.clone(), blocks.clone(), rx, registry) });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        tokio::spawn(server.serve(listener, std::future::pending()));
        (addr, lease.id, lease.generation, blocks)
    }

    fn read(
        addr: &str,
        token: &str,
        me: &str,
        lease: LeaseId,
        generation: u64,
        remote: &[BlockId],
        conns: usize,
    ) -> Result<Vec<u8>, DataError> {
        let mut dst = vec![0xffu8; 4 * 64];
        let local: Vec<BlockId> = (0..remote.len() as u32).map(|i| BlockId(3 - i)).collect();
        let req = DataRequest {
            addr,
            token,
            me,
            lease,
            generation,
            remote,
            local: &local,
            block_bytes: 64,
            connections: conns,
            deadline: Instant::now() + Duration::from_secs(5),
            tls: None,
        };
        // SAFETY: `dst` is ours and outlives the call.
        unsafe { read_blocks(&req, dst.as_mut_ptr(), dst.len()) }?;
        Ok(dst)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn leased_blocks_arrive_in_place_and_nothing_else_is_served() {
        let (addr, lease, generation, _blocks) = owner(Some("secret")).await;
        let ids = [BlockId(5), BlockId(2), BlockId(7)];
        for conns in [1, 2, 3, 8] {
            let (a, l, g) = (addr.clone(), lease, generation);
            let got =
                tokio::task::spawn_blocking(move || read(&a, "secret", "d0", l, g, &ids, conns))
                    .await
                    .expect("thread")
                    .expect("served");
            // Local block 3 ← 5, 2 ← 2, 1 ← 7; block 0 untouched.
            assert!(got[..64].iter().all(|&b| b == 0xff));
            assert!(got[64..128].iter().all(|&b| b == 7));
            assert!(got[128..192].iter().all(|&b| b == 2));
            assert!(got[192..].iter().all(|&b| b == 5));
        }
        let refusals = [
            ("wrong", "d0", generation, ids.to_vec(), "token"),
            ("secret", "d1", generation, ids.to_vec(), "lease"),
            ("secret", "d0", generation + 1, ids.to_vec(), "lease"),
            (
                "secret",
                "d0",
                generation,
                vec![BlockId(5), BlockId(2), BlockId(6)],
                "not lease",
            ),
            ("secret", "d0", generation, vec![BlockId(0)], "not lease"),
        ];
        for (token, me, g, ids, says) in refusals {
            let a = addr.clone();
            let err = tokio::task::spawn_blocking(move || read(&a, token, me, lease, g, &ids, 1))
                .await
                .expect("thread")
                .expect_err("refused");
            assert!(
                err.to_string().contains(says) || matches!(err, DataError::Refused(_)),
                "{err}"
            );
        }
    }
}
