//! The reporter's `RetainedTurns` against the test registry: a resync after the blocks', then
//! deltas as turns are retained and end.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use pd_report::test_registry::{ConnectionRecord, TestRegistry};
use pd_report::{
    BlockSubscription, NodeStateSnapshot, Registration, Reporter, ReporterOptions, RetainedTurn,
    RetainedTurns, Role, StateSource, StoredBlocks, TurnSubscription,
};
use pd_rpc::registry as pb;

const WAIT: Duration = Duration::from_secs(20);

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn registration() -> Registration {
    Registration {
        engine_id: "node-d".to_string(),
        epoch: 7,
        role: Role::Consumer,
        model: "tiny-llama".to_string(),
        block_size: 16,
        compat_hash: 1,
        http_addr: "127.0.0.1:8000".to_string(),
        kv_side_channel_addr: Some("127.0.0.1:9000".to_string()),
        grpc_addr: None,
        num_blocks: 64,
        max_model_len: 2048,
        cluster_token: String::new(),
        tokenizer_files: BTreeMap::from([(
            "tokenizer.json".to_string(),
            "{\"model\": {}}".to_string(),
        )]),
        tokenizer_fingerprint: 1,
        kv_hash_key: 0,
        kv_bytes_per_token: 64,
        takes_prompt_token_ids: true,
    }
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
/// A node that retains conversation turns.
struct TurnNode {
    blocks: StoredBlocks,
    turns: RetainedTurns,
}

impl StateSource for TurnNode {
    fn state(&self) -> NodeStateSnapshot {
        NodeStateSnapshot::default()
    }

    fn subscribe_blocks(&self) -> BlockSubscription {
        self.blocks.subscribe()
    }

    fn subscribe_turns(&self) -> Option<TurnSubscription> {
        Some(self.turns.subscribe())
    }
}

fn turn(lease: &str) -> RetainedTurn {
    RetainedTurn {
        lease_id: lease.to_string(),
        last_block_hash: 7,
        // The reporter never reads the params: here they are the lease id, so the test can
        // follow removals.
        params: lease.to_string(),
        prompt_key: (5, 16),
    }
}

/// The turns (lease ids) a gateway following the contract knows from `conn`'s `RetainedTurns`.
fn reported_turns(conn: &ConnectionRecord) -> (usize, HashSet<String>) {
    let mut resyncs = 0;
    let mut set = HashSet::new();
    for m in &conn.messages {
        let Some(pb::node_message::Msg::Turns(t)) = &m.msg else {
            continue;
        };
        if t.resync {
            resyncs += 1;
            set.clear();
        }
        for e in &t.removed {
            set.remove(&e.lease_id);
        }
        for a in &t.added {
            set.insert(a.kv_transfer_params.clone());
        }
    }
    (resyncs, set)
}

#[tokio::test]
async fn retained_turns_are_resynced_after_the_blocks_then_follow_as_deltas() -> TestResult {
    let registry = TestRegistry::start(std::net::SocketAddr::from(([127, 0, 0, 1], 0))).await?;
    let node = Arc::new(TurnNode {
        blocks: StoredBlocks::new(),
        turns: RetainedTurns::new(),
    });
    assert!(node.turns.add(turn("a")));
    let source: Arc<dyn StateSource> = node.clone();
    let _reporter = Reporter::spawn(
        registry.addr().to_string(),
        registration(),
        source,
        ReporterOptions::default(),
    )?;
    let conns = registry
        .log()
        .wait_for(WAIT, |c| c.first().is_some_and(|c| c.messages.len() >= 4))
        .await?;
    let kinds: Vec<_> = conns[0].messages.iter().take(4).map(msg_kind).collect();
    assert_eq!(kinds, ["register", "state", "blocks", "turns"]);
    assert_eq!(reported_turns(&conns[0]).0, 1);

    assert!(node.turns.add(turn("b")));
    assert!(node.turns.remove("a"));
    let want: HashSet<String> = [turn("b").params].into();
    let conns = registry
        .log()
        .wait_for(WAIT, |c| reported_turns(&c[0]).1 == want)
        .await?;
    let (resyncs, _) = reported_turns(&conns[0]);
    assert_eq!(resyncs, 1);
    let first = conns[0]
        .messages
        .iter()
        .find_map(|m| match &m.msg {
            Some(pb::node_message::Msg::Turns(t)) => Some(t.clone()),
            _ => None,
        })
        .expect("a turns resync");
    assert_eq!(
        (
            first.added[0].prompt_last_block_hash,
            first.added[0].prompt_tokens
        ),
        (5, 16)
    );
    Ok(())
}
