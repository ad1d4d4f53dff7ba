//! The reporter against a real tonic `NodeRegistry` server on loopback (the test registry): what
//! it sends, in which order, and how it survives a gateway restart.

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pd_report::test_registry::{
    ConnectionEnd, ConnectionRecord, TestRegistry, TestRegistryError, TestRegistryOptions,
};
use pd_report::{
    BlockEvent, BlockSubscription, LeaseCounters, NodeStateSnapshot, Registration, ReportError,
    Reporter, ReporterHandle, ReporterOptions, Role, StateSource, StoredBlocks,
};
use pd_rpc::registry as pb;
use tokio::sync::broadcast;

/// Deadline for every wait: generous, since the machine may be loaded; never a speed assert.
const WAIT: Duration = Duration::from_secs(20);

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn tracing_guard() -> tracing::subscriber::DefaultGuard {
    tracing::subscriber::set_default(
        tracing_subscriber::fmt()
            .with_test_writer()
            .with_env_filter("pd_report=debug")
            .finish(),
    )
}

fn any_port() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// A node as the reporter sees it: counters the test sets, and a [`StoredBlocks`].
struct FakeNode {
    state: Mutex<NodeStateSnapshot>,
    blocks: StoredBlocks,
    /// A feed to hand out instead of `blocks`'s on the next subscribe (for the lag test).
    next_subscription: Mutex<Option<BlockSubscription>>,
    subscribes: AtomicUsize,
}

impl FakeNode {
    fn new(state: NodeStateSnapshot) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(state),
            blocks: StoredBlocks::new(),
            next_subscription: Mutex::new(None),
            subscribes: AtomicUsize::new(0),
        })
    }

    fn set_state(&self, f: impl FnOnce(&mut NodeStateSnapshot)) {
        f(&mut self.state.lock().expect("state lock"));
    }

    fn stored(&self) -> HashSet<u64> {
        self.blocks.subscribe().stored.into_iter().collect()
    }
}

impl StateSource for FakeNode {
    fn state(&self) -> NodeStateSnapshot {
        *self.state.lock().expect("state lock")
    }

    fn subscribe_blocks(&self) -> BlockSubscription {
        self.subscribes.fetch_add(1, Ordering::SeqCst);
        if let Some(sub) = self.next_subscription.lock().expect("lock").take() {
            return sub;
        }
        self.blocks.subscribe()
    }
}

fn registration() -> Registration {
    Registration {
        engine_id: "node-a".to_string(),
        epoch: 42,
        role: Role::Producer,
        model: "tiny-llama".to_string(),
        block_size: 16,
        compat_hash: 0xfeed_beef,
        http_addr: "127.0.0.1:8000".to_string(),
        kv_side_channel_addr: Some("127.0.0.1:9000".to_string()),
        grpc_addr: None,
        num_blocks: 1024,
        max_model_len: 2048,
        cluster_token: "s3cret".to_string(),
        tokenizer_files: BTreeMap::from([
            ("tokenizer.json".to_string(), "{\"model\": {}}".to_string()),
            ("tokenizer_config.json".to_string(), "{}".to_string()),
        ]),
        tokenizer_fingerprint: 0x1234_5678,
        kv_hash_key: 0x00c0_ffee,
        kv_bytes_per_token: 1_536,
        takes_prompt_token_ids: true,
    }
}

fn initial_state() -> NodeStateSnapshot {
    NodeStateSnapshot {
        total_blocks: 1024,
        free_blocks: 1000,
        waiting: 2,
        running: 3,
        waiting_remote_kv: 1,
        leases: LeaseCounters {
            granted: 5,
            renewed: 4,
            released: 3,
            expired: 1,
            live: 1,
        },
        leased_blocks: 7,
        prefill_tokens_per_s: 0,
        pull_mb_per_s: 0,
        draining: false,
    }
}

/// Fast backoff so that the restart test reconnects quickly; production timing otherwise.
fn options() -> ReporterOptions {
    ReporterOptions {
        backoff_initial: Duration::from_millis(20),
        backoff_max: Duration::from_millis(300),
        ..ReporterOptions::default()
    }
}

fn spawn(
    registry: &TestRegistry,
    node: &Arc<FakeNode>,
    options: ReporterOptions,
) -> ReporterHandle {
    spawn_as(registry, node, options, registration())
}

fn spawn_as(
    registry: &TestRegistry,
    node: &Arc<FakeNode>,
    options: ReporterOptions,
    registration: Registration,
) -> ReporterHandle {
    let source: Arc<dyn StateSource> = node.clone();
    Reporter::spawn(registry.addr().to_string(), registration, source, options)
        .expect("valid address")
}

fn msg_kind(m: &pb::NodeMessage) -> &'static str {
    match m.msg {
        Some(pb::node_message::Msg::Register(_)) => "register",
        Some(pb::node_message::Msg::State(_)) => "state",
        Some(pb::node_message::Msg::Blocks(_)) => "blocks",
        Some(pb::node_message::Msg::Turns(_)) => "turns",
        None => "empty",
    }
}

/// A connection's messages up to the end of its first resync: Register, NodeState, BlockEvents.
fn assert_opening(conn: &ConnectionRecord) {
    let kinds: Vec<_> = conn.messages.iter().take(3).map(msg_kind).collect();
    assert_eq!(kinds, ["register", "state", "blocks"], "{conn:#?}");
    let first_blocks = conn.block_events().next().expect("a BlockEvents");
    assert!(first_blocks.resync, "the first BlockEvents is a resync");
    assert_eq!(conn.states().next().expect("a state").seq, 1);
}

#[tokio::test]
async fn registers_then_sends_full_state_then_block_resync() -> TestResult {
    let _guard = tracing_guard();
    let registry = TestRegistry::start_with(
        any_port(),
        TestRegistryOptions {
            gateway_id: "gw-1".to_string(),
            ..TestRegistryOptions::default()
        },
    )
    .await?;
    let node = FakeNode::new(initial_state());
    for h in [11, 12, 13] {
        node.blocks.insert(h);
    }
    let reporter = spawn(&registry, &node, options());

    let conns = registry
        .log()
        .wait_for(WAIT, |c| c.first().is_some_and(|c| c.messages.len() >= 3))
        .await?;
    let conn = &conns[0];
    assert_opening(conn);

    let reg = conn.register().expect("register first");
    assert_eq!(
        reg,
        &pb::Register {
            protocol_version: pd_report::REGISTRY_PROTOCOL_VERSION,
            engine_id: "node-a".to_string(),
            epoch: 42,
            role: pb::Role::Producer.into(),
            model: "tiny-llama".to_string(),
            block_size: 16,
            compat_hash: 0xfeed_beef,
            http_addr: "127.0.0.1:8000".to_string(),
            kv_side_channel_addr: "127.0.0.1:9000".to_string(),
            grpc_addr: String::new(),
            num_blocks: 1024,
            max_model_len: 2048,
            cluster_token: "s3cret".to_string(),
            kv_hash_key: 0x00c0_ffee,
            kv_bytes_per_token: 1_536,
            takes_prompt_token_ids: true,
            tokenizer: Some(pb::TokenizerBundle {
                files: vec![
                    pb::TokenizerFile {
                        name: "tokenizer.json".to_string(),
                        content: "{\"model\": {}}".to_string(),
                    },
                    pb::TokenizerFile {
                        name: "tokenizer_config.json".to_string(),
                        content: "{}".to_string(),
                    },
                ],
                fingerprint: 0x1234_5678,
            }),
        }
    );
    assert_eq!(conn.tokenizer_files(), registration().tokenizer_files);

    let state = conn.states().next().expect("a state");
    assert_eq!(
        (
            state.total_blocks,
            state.free_blocks,
            state.waiting,
            state.running,
            state.waiting_remote_kv
        ),
        (1024, 1000, 2, 3, 1)
    );
    assert_eq!(
        state.leases,
        Some(pb::LeaseCounters {
            granted: 5,
            renewed: 4,
            released: 3,
            expired: 1,
            live: 1
        })
    );
    assert_eq!(state.leased_blocks, 7);
    assert!(state.unix_ms > 0);
    assert_eq!(conn.stored_hashes(), HashSet::from([11, 12, 13]));

    let status = reporter.status();
    assert!(status.connected);
    assert_eq!(status.connects, 1);
    assert_eq!(status.gateway_id.as_deref(), Some("gw-1"));
    assert_eq!(status.resyncs, 1);
    Ok(())
}

#[tokio::test]
async fn changed_state_is_sent_and_periodic_state_follows_the_gateway_interval() -> TestResult {
    let _guard = tracing_guard();
    // The gateway asks for a 50 ms period (the node's default is 1 s).
    let registry = TestRegistry::start_with(
        any_port(),
        TestRegistryOptions {
            state_interval_ms: 50,
            ..TestRegistryOptions::default()
        },
    )
    .await?;
    let node = FakeNode::new(initial_state());
    let reporter = spawn(&registry, &node, options());
    registry
        .log()
        .wait_for(WAIT, |c| c.first().is_some_and(|c| c.messages.len() >= 3))
        .await?;
    assert_eq!(reporter.status().state_interval, Duration::from_millis(50));

    // A change shows up without waiting for anything else.
    node.set_state(|s| {
        s.free_blocks = 700;
        s.running = 9;
        s.leases.live = 4;
    });
    let conns = registry
        .log()
        .wait_for(WAIT, |c| {
            c[0].states().any(|s| {
                s.free_blocks == 700 && s.running == 9 && s.leases.is_some_and(|l| l.live == 4)
            })
        })
        .await?;
    let changed_at = conns[0].states().count();

    // Nothing changes now; states keep coming (the periodic report), identical.
    let conns = registry
        .log()
        .wait_for(WAIT, |c| c[0].states().count() >= changed_at + 5)
        .await?;
    let states: Vec<_> = conns[0].states().collect();
    for pair in states.windows(2) {
        assert_eq!(pair[1].seq, pair[0].seq + 1, "seq increases by one");
    }
    for s in &states[changed_at..] {
        assert_eq!((s.free_blocks, s.running), (700, 9));
    }
    Ok(())
}

#[tokio::test]
async fn block_deltas_follow_the_resync_in_order() -> TestResult {
    let _guard = tracing_guard();
    let registry = TestRegistry::start(any_port()).await?;
    let node = FakeNode::new(initial_state());
    node.blocks.insert(1);
    node.blocks.insert(2);
    let _reporter = spawn(&registry, &node, options());
    registry
        .log()
        .wait_for(WAIT, |c| c.first().is_some_and(|c| c.messages.len() >= 3))
        .await?;

    // Per hash, the node's history after the resync; removes and re-stores of one hash included.
    let script = [
        BlockEvent::Stored(3),
        BlockEvent::Removed(1),
        BlockEvent::Stored(1),
        BlockEvent::Stored(4),
        BlockEvent::Removed(3),
        BlockEvent::Removed(1),
        BlockEvent::Stored(3),
    ];
    for e in script {
        match e {
            BlockEvent::Stored(h) => assert!(node.blocks.insert(h)),
            BlockEvent::Removed(h) => assert!(node.blocks.remove(h)),
        }
    }
    let want = node.stored();
    let conns = registry
        .log()
        .wait_for(WAIT, |c| c[0].stored_hashes() == want)
        .await?;
    let conn = &conns[0];
    assert_eq!(conn.resyncs(), 1);

    // Within one message a hash appears once; across messages, each hash's events keep the
    // node's order.
    let mut seen: Vec<BlockEvent> = Vec::new();
    for b in conn.block_events().skip(1) {
        let mut in_msg = HashSet::new();
        for h in b.stored.iter().chain(&b.removed) {
            assert!(in_msg.insert(*h), "hash {h} twice in one message: {b:?}");
        }
        seen.extend(b.stored.iter().map(|&h| BlockEvent::Stored(h)));
        seen.extend(b.removed.iter().map(|&h| BlockEvent::Removed(h)));
    }
    for hash in [1, 3, 4] {
        let per_hash = |events: &[BlockEvent]| -> Vec<BlockEvent> {
            events
                .iter()
                .copied()
                .filter(|e| e.hash() == hash)
                .collect()
        };
        assert_eq!(per_hash(&seen), per_hash(&script), "events of hash {hash}");
    }
    Ok(())
}

#[tokio::test]
async fn a_large_resync_is_split_and_only_the_first_part_resets() -> TestResult {
    let _guard = tracing_guard();
    let registry = TestRegistry::start(any_port()).await?;
    let node = FakeNode::new(initial_state());
    for h in 0..1000 {
        node.blocks.insert(h * 7919);
    }
    let _reporter = spawn(
        &registry,
        &node,
        ReporterOptions {
            max_hashes_per_message: 300,
            ..options()
        },
    );
    let want = node.stored();
    let conns = registry
        .log()
        .wait_for(WAIT, |c| {
            c.first().is_some_and(|c| c.stored_hashes() == want)
        })
        .await?;
    let parts: Vec<_> = conns[0].block_events().collect();
    assert_eq!(parts.len(), 4, "1000 hashes at 300 per message");
    assert!(parts[0].resync);
    assert!(parts[1..].iter().all(|p| !p.resync && p.removed.is_empty()));
    assert!(parts.iter().all(|p| p.stored.len() <= 300));
    Ok(())
}

#[tokio::test]
async fn gateway_restart_means_retry_with_backoff_then_register_and_resync_again() -> TestResult {
    let _guard = tracing_guard();
    let registry = TestRegistry::start_with(
        any_port(),
        TestRegistryOptions {
            gateway_id: "gw-before".to_string(),
            ..TestRegistryOptions::default()
        },
    )
    .await?;
    let addr = registry.addr();
    let node = FakeNode::new(initial_state());
    for h in 100..110 {
        node.blocks.insert(h);
    }
    let reporter = spawn(&registry, &node, options());
    registry
        .log()
        .wait_for(WAIT, |c| c.first().is_some_and(|c| c.messages.len() >= 3))
        .await?;

    // The gateway goes away.
    let log = registry.stop().await?;
    let mut status = reporter.watch_status();
    tokio::time::timeout(WAIT, status.wait_for(|s| !s.connected && s.failures >= 3)).await??;
    let s = reporter.status();
    assert!(
        matches!(s.last_error.as_deref(), Some(ReportError::Connect { .. })),
        "retrying against a closed port: {s:?}"
    );

    // Meanwhile the node keeps working: many more block events than the feed holds, on a plain
    // thread (as the engine would); none of it may wait for the reporter.
    let writer = node.clone();
    let churn = tokio::task::spawn_blocking(move || {
        for h in 0..(2 * StoredBlocks::DEFAULT_CAPACITY as u64) {
            writer.blocks.insert(10_000 + h);
            if h % 3 == 0 {
                writer.blocks.remove(10_000 + h);
            }
        }
        for h in 100..105 {
            writer.blocks.remove(h);
        }
    });
    tokio::time::timeout(WAIT, churn).await??;
    node.set_state(|s| s.free_blocks = 10);
    assert_eq!(reporter.status().connects, 1, "no gateway, no registration");

    // The gateway comes back on the same port.
    let registry = TestRegistry::start_with(
        addr,
        TestRegistryOptions {
            gateway_id: "gw-after".to_string(),
            log: Some(log),
            ..TestRegistryOptions::default()
        },
    )
    .await?;
    let want = node.stored();
    let conns = registry
        .log()
        .wait_for(WAIT, |c| {
            c.len() >= 2 && c[1].resyncs() >= 1 && c[1].stored_hashes() == want
        })
        .await?;
    assert_eq!(conns[0].end, Some(ConnectionEnd::Stopped));
    let second = &conns[1];
    assert_opening(second);
    assert_eq!(second.register(), conns[0].register(), "same registration");
    assert_eq!(
        second.states().next().map(|s| s.free_blocks),
        Some(10),
        "current state"
    );
    // The resync alone (one message: fewer hashes than the per-message cap) already is the
    // current set, including what changed while the gateway was down.
    let resync = second.block_events().next().expect("a resync");
    assert!(resync.resync);
    assert_eq!(resync.stored.iter().copied().collect::<HashSet<_>>(), want);
    assert!(want.contains(&107) && !want.contains(&100));

    let status = reporter.status();
    assert!(status.connected);
    assert_eq!(status.connects, 2);
    assert_eq!(status.gateway_id.as_deref(), Some("gw-after"));
    assert_eq!(status.resyncs, 2);
    reporter.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn a_lagged_block_feed_is_answered_with_a_fresh_resync() -> TestResult {
    let _guard = tracing_guard();
    let registry = TestRegistry::start(any_port()).await?;
    let node = FakeNode::new(initial_state());
    node.blocks.insert(1);
    // The first subscription's feed has lost events before the reporter reads it.
    let (tx, events) = broadcast::channel(2);
    for h in 0..5 {
        tx.send(BlockEvent::Stored(900 + h))?;
    }
    *node.next_subscription.lock().expect("lock") = Some(BlockSubscription {
        stored: vec![1],
        events,
    });
    node.blocks.insert(2);
    let reporter = spawn(&registry, &node, options());

    let want = node.stored();
    let conns = registry
        .log()
        .wait_for(WAIT, |c| {
            c.first()
                .is_some_and(|c| c.resyncs() >= 2 && c.stored_hashes() == want)
        })
        .await?;
    let resyncs: Vec<_> = conns[0].block_events().filter(|b| b.resync).collect();
    assert_eq!(resyncs[0].stored, vec![1]);
    let mut second = resyncs[1].stored.clone();
    second.sort_unstable();
    assert_eq!(second, vec![1, 2]);
    assert_eq!(node.subscribes.load(Ordering::SeqCst), 2);
    assert_eq!(reporter.status().resyncs, 2);
    drop(tx);
    Ok(())
}

#[tokio::test]
async fn shutdown_ends_the_stream_cleanly() -> TestResult {
    let _guard = tracing_guard();
    let registry = TestRegistry::start(any_port()).await?;
    let node = FakeNode::new(initial_state());
    let reporter = spawn(&registry, &node, options());
    registry
        .log()
        .wait_for(WAIT, |c| c.first().is_some_and(|c| c.messages.len() >= 3))
        .await?;
    reporter.shutdown().await;
    let conns = registry
        .log()
        .wait_for(WAIT, |c| c[0].end.is_some())
        .await?;
    assert_eq!(conns[0].end, Some(ConnectionEnd::Finished));
    Ok(())
}

#[tokio::test]
async fn the_test_registry_refuses_a_stream_that_does_not_start_with_register() -> TestResult {
    let _guard = tracing_guard();
    let registry = TestRegistry::start(any_port()).await?;
    let mut client = pb::node_registry_client::NodeRegistryClient::connect(format!(
        "http://{}",
        registry.addr()
    ))
    .await?;
    let state = pb::NodeMessage {
        msg: Some(pb::node_message::Msg::State(pb::NodeState::default())),
    };
    let result = async {
        let mut inbound = client
            .report(tokio_stream::iter(vec![state]))
            .await?
            .into_inner();
        inbound.message().await
    }
    .await;
    let status = result.expect_err("refused");
    assert_eq!(status.code(), tonic::Code::FailedPrecondition);
    let conns = registry
        .log()
        .wait_for(WAIT, |c| c.first().is_some_and(|c| c.end.is_some()))
        .await?;
    assert!(matches!(conns[0].end, Some(ConnectionEnd::Refused(_))));
    Ok(())
}

#[tokio::test]
async fn a_bad_gateway_address_is_refused_at_spawn() {
    let node: Arc<dyn StateSource> = FakeNode::new(initial_state());
    let err = Reporter::spawn("not a uri", registration(), node, options()).expect_err("refused");
    assert!(matches!(err, ReportError::InvalidAddress { .. }), "{err:?}");
}

#[tokio::test]
async fn wait_for_times_out_with_the_log() {
    let registry = TestRegistry::start(any_port()).await.expect("start");
    let err = registry
        .log()
        .wait_for(Duration::from_millis(10), |c| !c.is_empty())
        .await
        .expect_err("nobody connected");
    assert!(matches!(err, TestRegistryError::Timeout { ref log, .. } if log.is_empty()));
}

#[tokio::test]
async fn peer_lists_and_the_gateways_cluster_token_are_published() -> TestResult {
    let _guard = tracing_guard();
    let registry = TestRegistry::start_with(
        any_port(),
        TestRegistryOptions {
            ack_cluster_token: "minted".to_string(),
            peers: Some(vec!["10.0.0.1:9000".to_string()]),
            ..TestRegistryOptions::default()
        },
    )
    .await?;
    let addr = registry.addr();
    let node = FakeNode::new(initial_state());
    let reporter = spawn_as(
        &registry,
        &node,
        options(),
        Registration {
            cluster_token: String::new(),
            ..registration()
        },
    );
    let mut peers = reporter.peers();
    let mut token = reporter.cluster_token();

    // After the acknowledgement: the registry's list and the token it minted.
    let list = tokio::time::timeout(WAIT, peers.wait_for(Option::is_some)).await??;
    assert_eq!(list.as_deref(), Some(&["10.0.0.1:9000".to_string()][..]));
    drop(list);
    let got = tokio::time::timeout(WAIT, token.wait_for(Option::is_some)).await??;
    assert_eq!(got.as_deref(), Some("minted"));
    drop(got);

    // A new list replaces the old one.
    let two = vec!["10.0.0.1:9000".to_string(), "[::1]:7000".to_string()];
    registry.send_peers(two.clone());
    let list = tokio::time::timeout(WAIT, peers.wait_for(|p| p.as_ref() == Some(&two))).await??;
    drop(list);

    // The gateway goes away: the node keeps what it was told.
    let log = registry.stop().await?;
    let mut status = reporter.watch_status();
    tokio::time::timeout(WAIT, status.wait_for(|s| !s.connected)).await??;
    assert_eq!(reporter.peers().borrow().as_ref(), Some(&two));
    assert_eq!(reporter.cluster_token().borrow().as_deref(), Some("minted"));

    // Back, with an empty list: the node re-registers with the token it was configured with
    // (none), and the empty list replaces the old one.
    let registry = TestRegistry::start_with(
        addr,
        TestRegistryOptions {
            log: Some(log),
            peers: Some(Vec::new()),
            ..TestRegistryOptions::default()
        },
    )
    .await?;
    let list = tokio::time::timeout(
        WAIT,
        peers.wait_for(|p| p.as_ref().is_some_and(Vec::is_empty)),
    )
    .await??;
    drop(list);
    let conns = registry.log().connections();
    assert_eq!(conns.len(), 2);
    assert!(
        conns
            .iter()
            .all(|c| c.register().is_some_and(|r| r.cluster_token.is_empty()))
    );
    assert_eq!(
        reporter.cluster_token().borrow().as_deref(),
        Some("minted"),
        "an ack without a token changes nothing"
    );
    reporter.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn without_a_gateway_list_there_are_no_peers_and_the_configured_token_is_in_effect()
-> TestResult {
    let _guard = tracing_guard();
    let registry = TestRegistry::start(any_port()).await?;
    let node = FakeNode::new(initial_state());
    let reporter = spawn(&registry, &node, options());
    let mut status = reporter.watch_status();
    tokio::time::timeout(WAIT, status.wait_for(|s| s.connected)).await??;
    assert_eq!(*reporter.peers().borrow(), None);
    assert_eq!(reporter.cluster_token().borrow().as_deref(), Some("s3cret"));
    reporter.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn a_wrong_cluster_token_is_refused_and_retried_with_backoff() -> TestResult {
    let _guard = tracing_guard();
    let registry = TestRegistry::start_with(
        any_port(),
        TestRegistryOptions {
            cluster_token: Some("the-right-one".to_string()),
            ..TestRegistryOptions::default()
        },
    )
    .await?;
    let node = FakeNode::new(initial_state());
    let reporter = spawn(&registry, &node, options());
    let mut status = reporter.watch_status();
    tokio::time::timeout(WAIT, status.wait_for(|s| s.failures >= 3)).await??;
    let s = reporter.status();
    assert!(!s.connected);
    assert_eq!(s.connects, 0);
    let err = s.last_error.expect("an error");
    assert!(matches!(*err, ReportError::Unauthenticated(_)), "{err:?}");
    assert!(err.to_string().contains("cluster token"), "{err}");
    let conns = registry.log().connections();
    assert!(conns.len() >= 3);
    assert!(
        conns
            .iter()
            .filter(|c| c.end.is_some())
            .all(|c| c.end == Some(ConnectionEnd::Refused("wrong cluster token".to_string()))),
        "{conns:#?}"
    );
    assert_eq!(*reporter.peers().borrow(), None, "never registered");
    reporter.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn a_tokenizer_larger_than_grpcs_default_limit_registers() -> TestResult {
    let _guard = tracing_guard();
    let registry = TestRegistry::start(any_port()).await?;
    let node = FakeNode::new(initial_state());
    let mut big = registration();
    // Real tokenizer.json files reach 7-9 MiB (Qwen2.5, Llama 3); tonic's default is 4 MiB.
    big.tokenizer_files
        .insert("tokenizer.json".to_string(), "x".repeat(6 << 20));
    let reporter = spawn_as(&registry, &node, options(), big.clone());
    let conns = registry
        .log()
        .wait_for(WAIT, |c| c.first().is_some_and(|c| c.messages.len() >= 3))
        .await?;
    assert_eq!(conns[0].tokenizer_files(), big.tokenizer_files);
    reporter.shutdown().await;
    Ok(())
}
