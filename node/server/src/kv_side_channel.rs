//! The node as a KV owner: its pool in UCX-allocated memory (so peers read it one-sidedly) and
//! the `KvPeer` side channel that publishes how to read it.
//!
//! Leases are granted by the engine when a prefill (`do_remote_decode`) finishes; this side
//! channel renews, confirms and releases them through [`EngineHandle::leases`].

use std::sync::{Arc, OnceLock};
use std::time::SystemTime;

use pd_engine::{EngineHandle, PoolMemory};
use pd_kv_pool::{KvPool, LeaseError, LeaseId};
use pd_kv_transfer::{CompatInfo, KvPeerService, LeaseAuthority, OwnerIdentity, PoolStats};
use pd_ucx::{Context, MemoryRegion, Worker};

/// Errors of setting up the side channel.
#[derive(Debug, thiserror::Error)]
pub enum KvSideChannelError {
    /// UCX failed.
    #[error("UCX: {0}")]
    Ucx(#[from] pd_ucx::Error),
    /// The engine was loaded without UCX pool memory.
    #[error("the engine's pool was not allocated through UCX")]
    NoRegion,
    /// The progress thread could not start.
    #[error("starting the UCX progress thread: {0}")]
    Thread(#[from] std::io::Error),
}

/// Records on a node's lease board ([`pd_kv_pool::LeaseBoard`]): leases beyond it are
/// confirmed through the side channel instead (128 KiB).
pub const LEASE_BOARD_SLOTS: usize = 4096;

/// UCX memory for the engine's pool and its lease board (one registered region: the pool, then
/// the board); hand [`UcxPool::pool_memory`] to the engine config.
#[derive(Debug, Clone)]
pub struct UcxPool {
    ctx: Context,
    /// The region and where the board starts in it (the pool's bytes, rounded up to 64).
    region: Arc<OnceLock<(Arc<MemoryRegion>, usize)>>,
}

impl UcxPool {
    /// A UCX context for the pool, offering peers `net_devices` only when given (UCX's
    /// `NET_DEVICES`: interface names, comma-separated), every interface otherwise.
    ///
    /// # Errors
    /// When UCX cannot start.
    pub fn new(net_devices: Option<&str>) -> Result<Self, KvSideChannelError> {
        // Wakeup: the owner's progress thread sleeps on the worker's event fd (asking for it
        // keeps the transports: pd-ucx tests/transport.rs).
        let features = pd_ucx::Features {
            wakeup: true,
            ..pd_ucx::Features::default()
        };
        let settings: Vec<(&str, &str)> = net_devices
            .map(|d| ("NET_DEVICES", d))
            .into_iter()
            .collect();
        Ok(Self {
            ctx: Context::with_config(features, &settings)?,
            region: Arc::new(OnceLock::new()),
        })
    }

    /// Whether this UCX can register GPU memory (see [`Context::registers_cuda_memory`]); false
    /// when the query fails.
    pub fn registers_cuda_memory(&self) -> bool {
        self.ctx.registers_cuda_memory().unwrap_or(false)
    }

    /// The engine's pool allocator: one UCX allocation of the pool's size plus the lease
    /// board, kept here for the handshake (base address, packed key).
    pub fn pool_memory(&self) -> PoolMemory {
        let ctx = self.ctx.clone();
        let slot = self.region.clone();
        PoolMemory(Arc::new(move |layout| {
            let board_at = layout.pool_bytes().next_multiple_of(64);
            let region = Arc::new(
                MemoryRegion::allocate_with(
                    &ctx,
                    board_at + pd_kv_pool::board_bytes(LEASE_BOARD_SLOTS),
                    // Asked for, not enforced by UCX 1.13's shared-memory transports (ARCHITECTURE.md).
                    pd_ucx::RemoteAccess::ReadOnly,
                )
                .map_err(|_| pd_kv_pool::AllocatorError::OutOfMemory {
                    bytes: layout.pool_bytes(),
                })?,
            );
            // SAFETY: UCX allocated `len` bytes, page aligned; the pool holds an Arc to the region
            // so the memory outlives it; only the engine thread writes it.
            let pool = unsafe {
                KvPool::from_raw(layout, region.as_ptr(), board_at, Box::new(region.clone()))?
            };
            let _ = slot.set((region, board_at));
            Ok(pool)
        }))
    }

    /// A puller thread reading peers' pools into this engine's pool (a decode node's).
    ///
    /// # Errors
    /// [`KvSideChannelError::NoRegion`] when the engine did not use [`UcxPool::pool_memory`].
    pub fn puller(
        &self,
        block_bytes: usize,
        via: pd_kv_transfer::PullVia,
    ) -> Result<pd_kv_transfer::Puller, KvSideChannelError> {
        let (region, _) = self
            .region
            .get()
            .ok_or(KvSideChannelError::NoRegion)?
            .clone();
        Ok(pd_kv_transfer::Puller::spawn_via(
            self.ctx.clone(),
            region,
            block_bytes,
            via,
        )?)
    }

    /// Starts a UCX progress thread and returns the `KvPeer` service of `engine`'s pool, as
    /// engine `engine_id` in its incarnation `epoch` (new at every start). Serve it with
    /// [`KvPeerService::into_guarded_server`] so only cluster members reach it.
    ///
    /// # Errors
    /// [`KvSideChannelError::NoRegion`] when the engine did not use [`UcxPool::pool_memory`].
    pub fn service(
        &self,
        engine: EngineHandle,
        engine_id: String,
        epoch: u64,
        data_port: u16,
    ) -> Result<KvPeerService<EngineLeases>, KvSideChannelError> {
        let (region, board_at) = self
            .region
            .get()
            .ok_or(KvSideChannelError::NoRegion)?
            .clone();
        let board_len = region.len().saturating_sub(board_at);
        // The beat's clock: `CLOCK_MONOTONIC`, then `Instant`, read together, so the lease
        // table's instants become readings of the clock the handshake states. In this order the
        // anchor's reading is early, if anything: beats look older than they are, never younger.
        let ns = pd_kv_transfer::monotonic_ns();
        let clock = pd_kv_pool::BeatClock {
            at: std::time::Instant::now(),
            ns,
        };
        // SAFETY: the region's tail past the pool (`board_at..`, 64-byte aligned) is ours alone:
        // the pool ends before it; the board keeps the region alive; only the lease table (under
        // its lock) writes it, peers read it.
        let board = unsafe {
            pd_kv_pool::LeaseBoard::from_raw(
                region.as_ptr().add(board_at),
                board_len,
                Box::new(region.clone()),
                Some(clock),
            )
        };
        let board_slots = board.slots();
        engine.leases().attach_board(board);
        let (tx, rx) = std::sync::mpsc::channel();
        let ctx = self.ctx.clone();
        std::thread::Builder::new()
            .name("pd-kv-progress".into())
            .spawn(move || {
                let worker = match Worker::new(&ctx) {
                    Ok(w) => w,
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        return;
                    }
                };
                let _ = tx.send(worker.address());
                // Serves AM-emulated operations and wireup; one-sided reads of UCX-allocated memory
                // need none of it. Sleeps on the worker's event fd between events.
                loop {
                    if worker.progress() == 0 && worker.wait_for_events().is_err() {
                        std::thread::sleep(std::time::Duration::from_micros(100));
                    }
                }
            })?;
        let worker_address = rx.recv().map_err(|_| KvSideChannelError::NoRegion)??;
        let info = engine.info();
        let identity = OwnerIdentity {
            engine_id,
            epoch,
            compat: CompatInfo::new(info.model_name.clone(), &info.kv_layout)
                .with_fingerprint(info.fingerprint.clone()),
            layout: info.kv_layout,
            worker_address,
            region_base: region.base(),
            // Block reads stay within the pool; the board is read at its own offset.
            region_len: board_at as u64,
            rkey: region.rkey_pack()?,
            transports: Vec::new(),
            board_offset: board_at as u64,
            board_slots,
            owner_clock: Some(pd_kv_transfer::OwnerClock::local()),
            kv_path: info.kv_path.to_string(),
            data_port,
            data_host: String::new(),
        };
        tracing::info!(
            engine_id = %identity.engine_id,
            pool_bytes = identity.region_len,
            block_bytes = info.kv_layout.block_bytes(),
            "KV pool registered with UCX"
        );
        Ok(KvPeerService::new(
            identity,
            Arc::new(EngineLeases { engine }),
        ))
    }
}

impl UcxPool {
    /// A server of the pool's leased blocks over TCP ([`pd_kv_transfer::tcp_data`]), deciding
    /// leases with `engine`'s lease book and admitting callers with the cluster token `token`.
    ///
    /// # Errors
    /// [`KvSideChannelError::NoRegion`] before the engine allocated its pool here.
    pub fn data_server(
        &self,
        engine: EngineHandle,
        token: tokio::sync::watch::Receiver<Option<String>>,
        refused: prometheus::IntCounter,
    ) -> Result<pd_kv_transfer::tcp_data::DataServer, KvSideChannelError> {
        let (region, board_at) = self
            .region
            .get()
            .ok_or(KvSideChannelError::NoRegion)?
            .clone();
        let pool = pd_kv_transfer::tcp_data::PoolBytes {
            base: region.as_ptr() as usize,
            // Blocks only: the lease board after them is not served.
            len: board_at,
            block_bytes: engine.info().kv_layout.block_bytes(),
        };
        // SAFETY: the region stays mapped while the server holds it (`keep`).
        Ok(unsafe {
            pd_kv_transfer::tcp_data::DataServer::new(
                pool,
                Arc::new(region),
                Arc::new(EngineLeases { engine }),
                token,
                refused,
            )
        })
    }
}

/// Lease decisions of a node: the engine's lease book.
#[derive(Debug)]
pub struct EngineLeases {
    engine: EngineHandle,
}

fn wall(deadline: std::time::Instant) -> SystemTime {
    pd_kv_transfer::lease_authority::to_system_time(deadline)
}

impl LeaseAuthority for EngineLeases {
    fn renew(&self, id: LeaseId, generation: u64, peer: &str) -> Result<SystemTime, LeaseError> {
        self.engine.leases().renew(id, generation, peer).map(wall)
    }

    fn confirm(
        &self,
        id: LeaseId,
        generation: u64,
        peer: &str,
    ) -> Result<(SystemTime, pd_kv_pool::LeaseContents), LeaseError> {
        self.engine
            .leases()
            .confirm(id, generation, peer)
            .map(|(deadline, contents)| (wall(deadline), contents))
    }

    fn covers(
        &self,
        id: LeaseId,
        generation: u64,
        peer: &str,
        blocks: &[pd_kv_pool::BlockId],
    ) -> Result<bool, LeaseError> {
        self.engine.leases().covers(id, generation, peer, blocks)
    }

    fn release(&self, id: LeaseId, generation: u64, peer: &str) -> Result<(), LeaseError> {
        self.engine.release_lease(id, generation, peer)
    }

    fn stats(&self) -> PoolStats {
        let leases = self.engine.lease_stats();
        PoolStats {
            total_blocks: self.engine.info().num_blocks,
            free_blocks: self.engine.free_blocks(),
            live_leases: leases.live,
            counts: leases.counts,
        }
    }
}
