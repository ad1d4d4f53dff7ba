//! Transfers between two real processes: `pd-kv-owner` (a UCX-allocated pool, one lease, the
//! `KvPeer` side channel) and this test as the puller (its own UCX worker and pool). Checks
//! byte-exact pulls of non-contiguous blocks, lease expiry and renewal, compatibility refusal,
//! stale leases, and a peer killed before the pull under both failure policies.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pd_kv_pool::{BlockId, KvDtype, KvLayout, LeaseId};
use pd_kv_transfer::{
    CompatInfo, FailurePolicy, Fallback, LeaseKeeper, LeasedBlocks, PeerClient, Puller,
    TransferError, TransferMetrics, pull_under_lease,
};
use pd_ucx::{Context, MemoryRegion};

const PEER: &str = "puller";

fn layout() -> KvLayout {
    KvLayout {
        num_blocks: 32,
        block_size: 16,
        num_layers: 2,
        num_kv_heads: 2,
        head_dim: 32,
        dtype: KvDtype::F32,
        order: pd_kv_pool::KvOrder::Hnd,
    }
}

/// Same formula as `pd-kv-owner`.
fn pattern(b: usize, i: usize) -> f32 {
    ((b * 7919 + i * 31) % 65_521) as f32
}

/// The owner process, killed when dropped.
struct Owner {
    child: Child,
    addr: String,
    lease: LeaseId,
    generation: u64,
    blocks: Vec<BlockId>,
}

impl Owner {
    fn start(lease_ms: u64) -> Owner {
        let mut child = Command::new(env!("CARGO_BIN_EXE_pd-kv-owner"))
            .args(["--blocks", "32", "--lease", "7,2,3,11,5,20", "--peer", PEER])
            .args(["--lease-ms", &lease_ms.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn pd-kv-owner");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let parts: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(
            parts.first(),
            Some(&"OWNER"),
            "unexpected owner output {line:?}"
        );
        Owner {
            addr: parts[1].to_string(),
            lease: parts[2].parse().unwrap(),
            generation: parts[3].parse().unwrap(),
            blocks: parts[4]
                .split(',')
                .map(|b| BlockId(b.parse().unwrap()))
                .collect(),
            child,
        }
    }
}

impl Owner {
    /// The owner's leased blocks, to be pulled into local blocks `local`.
    fn leased(&self, local: Vec<BlockId>) -> LeasedBlocks {
        LeasedBlocks {
            lease: self.lease,
            generation: self.generation,
            remote: self.blocks.clone(),
            local,
            rechunk: None,
            // pd-kv-owner does not attest its leases (nor has a lease board): nothing to check.
            expect: pd_kv_pool::LeaseContents::default(),
            board_slot: None,
            board_freshness: None,
            landing: None,
        }
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The puller side: a UCX context, a local pool of the same layout, and the puller thread.
struct Local {
    region: Arc<MemoryRegion>,
    puller: Puller,
}

fn local() -> Local {
    let ctx = Context::new().unwrap();
    let region = Arc::new(MemoryRegion::allocate(&ctx, layout().pool_bytes()).unwrap());
    // Poison the local pool so an incomplete pull cannot look right.
    unsafe { std::ptr::write_bytes(region.as_ptr(), 0xff, region.len()) };
    let puller = Puller::spawn(ctx, region.clone(), layout().block_bytes()).unwrap();
    Local { region, puller }
}

fn local_block(l: &Local, b: BlockId) -> &[f32] {
    let n = layout().block_elems();
    // SAFETY: the region holds the whole pool; the pull completed before this read.
    let all = unsafe {
        std::slice::from_raw_parts(l.region.as_ptr().cast::<f32>(), layout().num_blocks * n)
    };
    &all[b.index() * n..(b.index() + 1) * n]
}

fn compat() -> CompatInfo {
    CompatInfo::new("tiny", &layout())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_contiguous_blocks_arrive_byte_exact_and_release_frees_them() {
    let owner = Owner::start(30_000);
    let l = local();
    let metrics = TransferMetrics::new();
    let mut client = PeerClient::connect(&owner.addr, PEER, None).await.unwrap();
    let peer = client.handshake(&compat(), 1, false).await.unwrap();
    assert_eq!(peer.layout, layout());
    // Remote 7,2,3,11,5,20 into local 30,0,1,9,10,4: runs (2,3)->(0,1) coalesce, others don't.
    let local_ids: Vec<BlockId> = [30, 0, 1, 9, 10, 4].iter().map(|&b| BlockId(b)).collect();
    let pulled = pull_under_lease(
        &l.puller,
        &mut client,
        &peer,
        owner.leased(local_ids.clone()),
        deadline(),
        &metrics,
    )
    .await
    .unwrap();
    // pd-kv-owner does not attest its leases: the reader must keep this KV out of any cache.
    assert!(!pulled.attested);
    let stats = pulled.stats;
    assert_eq!(stats.bytes, 6 * layout().block_bytes());
    assert_eq!(stats.descriptors, 5);
    assert_eq!(metrics.bytes.get(), stats.bytes as u64);
    for (r, lb) in owner.blocks.iter().zip(&local_ids) {
        let got = local_block(&l, *lb);
        let want: Vec<f32> = (0..got.len()).map(|i| pattern(r.index(), i)).collect();
        assert!(got == want.as_slice(), "block {r:?} -> {lb:?} differs");
    }
    let before = client.stats().await.unwrap();
    assert_eq!(before.live_leases, 1);
    assert_eq!(before.free_blocks, 32 - 6, "leased blocks are held");
    client.release(owner.lease, owner.generation).await.unwrap();
    let after = client.stats().await.unwrap();
    assert_eq!(
        (after.free_blocks, after.leases_released, after.live_leases),
        (32, 1, 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unrenewed_lease_expires_frees_blocks_and_is_counted() {
    let owner = Owner::start(300);
    let mut client = PeerClient::connect(&owner.addr, PEER, None).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = client.stats().await.unwrap();
        if s.leases_expired == 1 {
            assert_eq!((s.free_blocks, s.live_leases), (32, 0));
            break;
        }
        assert!(Instant::now() < deadline, "lease never expired: {s:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let err = client
        .confirm(owner.lease, owner.generation)
        .await
        .unwrap_err();
    assert!(matches!(err, TransferError::LeaseLost { .. }), "{err}");
    assert_eq!(err.reason(), "lease_expired");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_keeps_a_lease_alive_past_its_first_deadline() {
    let owner = Owner::start(1200);
    let mut client = PeerClient::connect(&owner.addr, PEER, None).await.unwrap();
    // The keeper renews every duration/6 = 200 ms; wait 2.5 lease durations.
    let metrics = std::sync::Arc::new(TransferMetrics::new());
    let keeper = LeaseKeeper::start(
        client.clone(),
        owner.lease,
        owner.generation,
        Duration::from_millis(200),
        metrics.clone(),
    );
    tokio::time::sleep(Duration::from_millis(3000)).await;
    client.confirm(owner.lease, owner.generation).await.unwrap();
    let s = client.stats().await.unwrap();
    assert_eq!(s.leases_expired, 0);
    assert!(s.leases_renewed >= 5, "{s:?}");
    assert_eq!(metrics.notification_failures.get(), 0);
    drop(keeper);
    client.release(owner.lease, owner.generation).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compatibility_mismatch_is_refused_naming_the_field() {
    let owner = Owner::start(30_000);
    let mut client = PeerClient::connect(&owner.addr, PEER, None).await.unwrap();
    let mut other = compat();
    other.head_dim = 64;
    let err = client.handshake(&other, 1, false).await.unwrap_err();
    assert!(matches!(err, TransferError::HandshakeRefused(_)), "{err}");
    assert!(err.to_string().contains("head_dim"), "{err}");
    let mut other = compat();
    other.model = "another-model".into();
    assert!(
        client
            .handshake(&other, 1, false)
            .await
            .unwrap_err()
            .to_string()
            .contains("model")
    );
    // The operator's escape hatch skips the check on both sides.
    let mut other = compat();
    other.head_dim = 64;
    client.handshake(&other, 1, true).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_or_released_lease_is_detected_and_its_data_discarded() {
    let owner = Owner::start(30_000);
    let l = local();
    let metrics = TransferMetrics::new();
    let mut client = PeerClient::connect(&owner.addr, PEER, None).await.unwrap();
    let peer = client.handshake(&compat(), 1, false).await.unwrap();
    let stale = client
        .confirm(owner.lease, owner.generation + 1)
        .await
        .unwrap_err();
    assert!(
        matches!(&stale, TransferError::LeaseLost { reason, .. } if reason == "stale"),
        "{stale}"
    );
    // Another peer cannot use the lease.
    let mut intruder = PeerClient::connect(&owner.addr, "intruder", None)
        .await
        .unwrap();
    let wrong = intruder
        .confirm(owner.lease, owner.generation)
        .await
        .unwrap_err();
    assert!(
        matches!(&wrong, TransferError::LeaseLost { reason, .. } if reason == "wrong_peer"),
        "{wrong}"
    );
    // After release the blocks may be reused by the owner: a pull under that lease must fail.
    client.release(owner.lease, owner.generation).await.unwrap();
    let local_ids: Vec<BlockId> = (0..6).map(BlockId).collect();
    let err = pull_under_lease(
        &l.puller,
        &mut client,
        &peer,
        owner.leased(local_ids),
        deadline(),
        &metrics,
    )
    .await
    .unwrap_err();
    assert!(
        matches!(&err, TransferError::LeaseLost { reason, .. } if reason == "unknown"),
        "{err}"
    );
    assert_eq!(
        metrics.failures.with_label_values(&["lease_expired"]).get(),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_killed_before_the_pull_triggers_the_failure_policy() {
    let mut owner = Owner::start(30_000);
    let l = local();
    let metrics = TransferMetrics::new();
    let mut client = PeerClient::connect(&owner.addr, PEER, None).await.unwrap();
    let peer = client.handshake(&compat(), 1, false).await.unwrap();
    owner.child.kill().unwrap();
    owner.child.wait().unwrap();
    // Both policies, each on a real failed pull.
    for policy in [FailurePolicy::Fail, FailurePolicy::Recompute] {
        let local_ids: Vec<BlockId> = (0..6).map(BlockId).collect();
        let pull = pull_under_lease(
            &l.puller,
            &mut client,
            &peer,
            owner.leased(local_ids),
            deadline(),
            &metrics,
        );
        let result = tokio::time::timeout(Duration::from_secs(30), pull)
            .await
            .expect("a dead peer must not hang the pull");
        // Whatever the reads did (shared memory may even still be mapped), the owner cannot
        // confirm the lease, so the data is never used.
        let err = result.unwrap_err();
        assert!(
            matches!(
                err,
                TransferError::PeerUnreachable { .. }
                    | TransferError::Transfer(_)
                    | TransferError::Rpc(_)
            ),
            "{err}"
        );
        match policy {
            FailurePolicy::Fail => assert!(policy.apply(err).is_err()),
            FailurePolicy::Recompute => assert_eq!(policy.apply(err).unwrap(), Fallback::Recompute),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_killed_while_pulls_run_back_to_back_triggers_the_failure_policy() {
    let mut owner = Owner::start(30_000);
    let l = local();
    let metrics = TransferMetrics::new();
    let mut client = PeerClient::connect(&owner.addr, PEER, None).await.unwrap();
    let peer = client.handshake(&compat(), 1, false).await.unwrap();
    let dead = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Pull the leased blocks again and again (reads, then confirmation) until one fails.
    let puller = l.puller.clone();
    let blocks = owner.leased((0..6).map(BlockId).collect());
    let flag = dead.clone();
    let pulls = tokio::spawn(async move {
        let mut ok = 0usize;
        loop {
            let started_after_death = flag.load(std::sync::atomic::Ordering::SeqCst);
            let r = pull_under_lease(
                &puller,
                &mut client,
                &peer,
                blocks.clone(),
                deadline(),
                &metrics,
            )
            .await;
            match r {
                Ok(_) => {
                    assert!(!started_after_death, "a pull from a dead peer was used");
                    ok += 1;
                }
                Err(e) => return (ok, e, metrics),
            }
        }
    });
    // Let some pulls complete, then kill the owner in the middle of the stream of pulls.
    tokio::time::sleep(Duration::from_millis(200)).await;
    owner.child.kill().unwrap();
    owner.child.wait().unwrap();
    dead.store(true, std::sync::atomic::Ordering::SeqCst);
    let (ok, err, metrics) = tokio::time::timeout(Duration::from_secs(30), pulls)
        .await
        .expect("a peer dying mid-stream must not hang the puller")
        .unwrap();
    assert!(ok > 0, "pulls ran before the kill");
    // The pull in flight when the owner died failed (its reads or its confirmation), so its data
    // is never used; the failure is counted and goes through the policy.
    assert_eq!(metrics.failures.with_label_values(&[err.reason()]).get(), 1);
    assert!(
        FailurePolicy::Fail
            .apply(TransferError::Rpc(err.to_string()))
            .is_err()
    );
    assert_eq!(
        FailurePolicy::Recompute.apply(err).unwrap(),
        Fallback::Recompute
    );
}

/// A pull deadline far enough away that only a hung test reaches it.
fn deadline() -> std::time::Instant {
    std::time::Instant::now() + std::time::Duration::from_secs(30)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_concurrent_pulls_than_the_per_peer_bound_queue_and_all_arrive_byte_exact() {
    let owner = Owner::start(30_000);
    let l = local();
    let mut client = PeerClient::connect(&owner.addr, PEER, None).await.unwrap();
    let peer = client.handshake(&compat(), 1, false).await.unwrap();
    // 5 pulls at once (the bound is 4 in flight per peer), each into its own 6 local blocks.
    let pulls = pd_kv_transfer::MAX_PULLS_PER_PEER + 1;
    let locals: Vec<Vec<BlockId>> = (0..pulls)
        .map(|j| (0..6).map(|i| BlockId((j * 6 + i) as u32)).collect())
        .collect();
    let mut all = tokio::task::JoinSet::new();
    for local in &locals {
        let (puller, peer) = (l.puller.clone(), peer.clone());
        let (remote, local) = (owner.blocks.clone(), local.clone());
        all.spawn(async move { puller.pull(&peer, remote, local, None, deadline()).await });
    }
    while let Some(r) = all.join_next().await {
        r.unwrap().unwrap();
    }
    let n = layout().block_elems();
    for local in &locals {
        for (r, b) in owner.blocks.iter().zip(local) {
            let want: Vec<f32> = (0..n).map(|i| pattern(r.index(), i)).collect();
            assert_eq!(
                local_block(&l, *b),
                &want[..],
                "remote {r:?} -> local {b:?}"
            );
        }
    }
    // A pull whose deadline has passed is refused without reading; the puller goes on.
    let err = l
        .puller
        .pull(
            &peer,
            owner.blocks.clone(),
            locals[0].clone(),
            None,
            Instant::now(),
        )
        .await
        .unwrap_err();
    assert_eq!(err.reason(), "deadline", "{err}");
    l.puller
        .pull(
            &peer,
            owner.blocks.clone(),
            locals[0].clone(),
            None,
            deadline(),
        )
        .await
        .unwrap();
}

/// Once the puller thread has connected to a peer whose pool UCX maps here (shared memory on
/// one host), later pulls are copied on the caller's thread, byte-exact; after `forget` the
/// mapping is gone and the next pull goes through the thread again (reconnecting), byte-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mapped_pulls_after_the_first_copy_on_the_callers_thread_until_forgotten() {
    let owner = Owner::start(30_000);
    let l = local();
    let mut client = PeerClient::connect(&owner.addr, PEER, None).await.unwrap();
    let peer = client.handshake(&compat(), 1, false).await.unwrap();
    let n = owner.blocks.len() as u32;
    let mut on_caller = Vec::new();
    for round in 0..4u32 {
        if round == 2 {
            l.puller.forget(&peer.engine_id);
        }
        // Distinct local blocks each round, poisoned first, so every round must write its own.
        let local_ids: Vec<BlockId> = (0..n).map(|i| BlockId(round * n + i)).collect();
        let pulled = l
            .puller
            .pull(
                &peer,
                owner.blocks.clone(),
                local_ids.clone(),
                None,
                deadline(),
            )
            .await
            .unwrap();
        assert!(pulled.stats.copied, "loopback maps the peer's pool here");
        on_caller.push(pulled.on_caller);
        for (r, lb) in owner.blocks.iter().zip(&local_ids) {
            let got = local_block(&l, *lb);
            let want: Vec<f32> = (0..got.len()).map(|i| pattern(r.index(), i)).collect();
            assert!(
                got == want.as_slice(),
                "round {round}: block {r:?} -> {lb:?} differs"
            );
        }
    }
    assert_eq!(on_caller, [false, true, false, true]);
    client.release(owner.lease, owner.generation).await.unwrap();
}

/// What a pull handed on as its blocks landed ([`pd_kv_transfer::Landing`]).
#[derive(Debug, Default)]
struct Landed {
    begun: std::sync::atomic::AtomicUsize,
    settled: std::sync::atomic::AtomicUsize,
    blocks: std::sync::Mutex<Vec<(BlockId, Vec<f32>)>>,
}

impl pd_kv_transfer::Landing for Landed {
    fn begin(&self) -> Result<(), pd_kv_transfer::LandingError> {
        self.begun.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }

    unsafe fn landed(
        &self,
        first: BlockId,
        bytes: &[u8],
    ) -> Result<(), pd_kv_transfer::LandingError> {
        for (i, block) in bytes.chunks(layout().block_bytes()).enumerate() {
            let floats = block
                .chunks_exact(4)
                .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
                .collect();
            let b = BlockId(first.0 + i as u32);
            self.blocks.lock().unwrap().push((b, floats));
        }
        Ok(())
    }

    fn settle(&self) -> Result<(), pd_kv_transfer::LandingError> {
        self.settled
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }
}

/// A pull with a landing (a staged node uploading as blocks land) hands every local block on
/// exactly once, in order, holding the peer's bytes, between one begin and one settle —
/// whichever way the pull went: through the puller thread's copy, copied on the caller's
/// thread, or read with UCX gets (in parts, each with its own flush). In parts of two blocks,
/// the first two parts (four of the six blocks) are handed on before the last is in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_hands_each_block_on_as_it_lands_whichever_way_it_reads() {
    let owner = Owner::start(30_000);
    let mapped = local();
    let gets = {
        let ctx = Context::new().unwrap();
        let region = Arc::new(MemoryRegion::allocate(&ctx, layout().pool_bytes()).unwrap());
        let puller = Puller::spawn_via(
            ctx,
            region.clone(),
            layout().block_bytes(),
            pd_kv_transfer::PullVia::Get,
        )
        .unwrap()
        .with_landing_part_bytes(2 * layout().block_bytes());
        Local { region, puller }
    };
    let mapped = Local {
        puller: mapped
            .puller
            .with_landing_part_bytes(2 * layout().block_bytes()),
        ..mapped
    };
    let mut client = PeerClient::connect(&owner.addr, PEER, None).await.unwrap();
    let peer = client.handshake(&compat(), 1, false).await.unwrap();
    let n = owner.blocks.len() as u32;
    let mut ways = Vec::new();
    for (round, l) in [&mapped, &mapped, &gets].into_iter().enumerate() {
        let local_ids: Vec<BlockId> = (0..n).map(|i| BlockId(round as u32 * n + i)).collect();
        let landed = Arc::new(Landed::default());
        let pulled = l
            .puller
            .pull_converting(
                &peer,
                owner.blocks.clone(),
                local_ids.clone(),
                None,
                None,
                Some(landed.clone()),
                deadline(),
            )
            .await
            .unwrap();
        ways.push((pulled.stats.copied, pulled.on_caller));
        assert_eq!(pulled.stats.landed_blocks, n as usize, "round {round}");
        assert_eq!(
            pulled.stats.landed_early, 4,
            "round {round}: handed on part by part"
        );
        assert_eq!(landed.begun.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(landed.settled.load(std::sync::atomic::Ordering::SeqCst), 1);
        let blocks = landed.blocks.lock().unwrap();
        let order: Vec<BlockId> = blocks.iter().map(|(b, _)| *b).collect();
        assert_eq!(order, local_ids, "round {round}: each block once, in order");
        for ((b, got), r) in blocks.iter().zip(&owner.blocks) {
            let want: Vec<f32> = (0..got.len()).map(|i| pattern(r.index(), i)).collect();
            assert!(
                *got == want,
                "round {round}: {r:?} -> {b:?} handed on wrong"
            );
            assert_eq!(
                local_block(l, *b),
                &want[..],
                "round {round}: and in the pool"
            );
        }
    }
    assert_eq!(
        ways,
        [(true, false), (true, true), (false, false)],
        "thread copy, caller copy, gets"
    );
    client.release(owner.lease, owner.generation).await.unwrap();
}
