//! A standalone KV owner: a UCX-allocated pool with patterned blocks, one lease over a chosen
//! block list, and the `KvPeer` side channel. For transfer tests, benchmarks and debugging a
//! puller without an engine.
//!
//! ```sh
//! pd-kv-owner --blocks 32 --lease 7,2,3,11,5 --lease-ms 30000 --peer puller
//! # prints: OWNER http://127.0.0.1:PORT <lease id> <generation> <blocks>
//! ```
//! Block `b`, element `i` holds `pattern(b, i)` ([`pd_kv_transfer`]'s tests recompute it). The
//! process exits when its standard input closes.

use std::io::{BufRead, Write};
use std::sync::Arc;
use std::time::Duration;

use pd_kv_pool::{BlockId, KvDtype, KvLayout, KvPool};
use pd_kv_transfer::{CompatInfo, KvPeerService, LocalBlocks, OwnerIdentity};
use pd_ucx::{Context, MemoryRegion, Worker};

struct Args {
    blocks: usize,
    block_size: usize,
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
    lease: Vec<u32>,
    lease_ms: u64,
    peer: String,
    model: String,
}

/// Errors of this tool, printed by `main`.
type BoxResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

fn parse() -> BoxResult<Args> {
    let mut a = Args {
        blocks: 32,
        block_size: 16,
        layers: 2,
        kv_heads: 2,
        head_dim: 32,
        lease: vec![7, 2, 3, 11, 5],
        lease_ms: 30_000,
        peer: String::new(),
        model: "tiny".into(),
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    for pair in args.chunks(2) {
        let [k, v] = pair else {
            return Err("flags take one value each".into());
        };
        match k.as_str() {
            "--blocks" => a.blocks = v.parse()?,
            "--block-size" => a.block_size = v.parse()?,
            "--layers" => a.layers = v.parse()?,
            "--kv-heads" => a.kv_heads = v.parse()?,
            "--head-dim" => a.head_dim = v.parse()?,
            "--lease" => a.lease = v.split(',').map(str::parse).collect::<Result<_, _>>()?,
            "--lease-ms" => a.lease_ms = v.parse()?,
            "--peer" => a.peer = v.clone(),
            "--model" => a.model = v.clone(),
            other => return Err(format!("unknown flag {other}").into()),
        }
    }
    Ok(a)
}

/// Value of element `i` of block `b`.
fn pattern(b: usize, i: usize) -> f32 {
    ((b * 7919 + i * 31) % 65_521) as f32
}

fn main() -> BoxResult<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let args = parse()?;
    let layout = KvLayout {
        num_blocks: args.blocks,
        block_size: args.block_size,
        num_layers: args.layers,
        num_kv_heads: args.kv_heads,
        head_dim: args.head_dim,
        dtype: KvDtype::F32,
        order: pd_kv_pool::KvOrder::Hnd,
    };
    let ctx = Context::new()?;
    let region = Arc::new(MemoryRegion::allocate(&ctx, layout.pool_bytes())?);
    // SAFETY: the region is UCX-allocated, page aligned and `pool_bytes` long; the pool keeps an
    // Arc to it, so it outlives the pool; only this pool writes it.
    let mut pool = unsafe {
        KvPool::from_raw(
            layout,
            region.as_ptr(),
            region.len(),
            Box::new(region.clone()),
        )?
    };
    for b in 0..layout.num_blocks {
        for (i, x) in pool.block_mut(BlockId(b as u32)).iter_mut().enumerate() {
            *x = pattern(b, i);
        }
    }
    let rkey = region.rkey_pack()?;

    // The worker lives on its own thread (not thread-safe); it progresses for AM-emulated paths.
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let progress_ctx = ctx.clone();
    std::thread::spawn(move || {
        let worker = match Worker::new(&progress_ctx) {
            Ok(w) => w,
            Err(e) => {
                let _ = addr_tx.send(Err(e));
                return;
            }
        };
        let _ = addr_tx.send(worker.address());
        loop {
            if worker.progress() == 0 {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    });
    let worker_address = addr_rx.recv()??;

    let blocks = Arc::new(LocalBlocks::new(
        layout.num_blocks,
        Duration::from_millis(args.lease_ms),
        rand::random(),
    ));
    let lease_blocks: Vec<BlockId> = args.lease.iter().map(|&b| BlockId(b)).collect();
    let lease = blocks.with(|alloc, leases| -> BoxResult<_> {
        // A "sequence" takes every block, the lease takes its own references, the sequence ends.
        let all = alloc.allocate_n(layout.num_blocks)?;
        for &b in &lease_blocks {
            alloc.share(b);
        }
        let lease = leases.grant(
            lease_blocks.clone(),
            pd_kv_pool::LeaseContents::default(),
            &args.peer,
            std::time::Instant::now(),
        );
        for b in all {
            alloc.free(b);
        }
        Ok(lease)
    })?;

    let identity = OwnerIdentity {
        engine_id: format!("owner-{}", std::process::id()),
        epoch: rand::random(),
        compat: CompatInfo::new(args.model.clone(), &layout),
        layout,
        worker_address,
        region_base: region.base(),
        region_len: region.len() as u64,
        rkey,
        transports: Vec::new(),
        board_offset: 0,
        board_slots: 0,
        owner_clock: None,
        kv_path: "in-place".into(),
        data_port: 0,
        data_host: String::new(),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let expiry = blocks.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(10));
            loop {
                tick.tick().await;
                expiry.expire();
            }
        });
        let service = KvPeerService::new(identity, blocks).into_server();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        std::thread::spawn(move || {
            let stdin = std::io::stdin();
            for _ in stdin.lock().lines() {}
            let _ = stop_tx.send(());
        });
        let ids: Vec<String> = lease_blocks.iter().map(|b| b.0.to_string()).collect();
        println!(
            "OWNER http://{addr} {} {} {}",
            lease.id,
            lease.generation,
            ids.join(",")
        );
        std::io::stdout().flush()?;
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming_shutdown(tokio_stream_incoming(listener), async {
                let _ = stop_rx.await;
            })
            .await?;
        drop(pool);
        BoxResult::Ok(())
    })
}

fn tokio_stream_incoming(
    listener: tokio::net::TcpListener,
) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
}
