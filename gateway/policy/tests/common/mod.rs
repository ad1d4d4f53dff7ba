//! Shared by the integration tests: where the guest components are, view builders, a seeded
//! RNG.

#![allow(dead_code, unreachable_pub)]

use std::path::PathBuf;
use std::time::Duration;

use pd_policy::{
    Api, Measured, Node, PolicyEngine, PolicySpec, Rates, Request, Role, View, WasmPolicy,
};

/// The directory holding the built guest components: `$PD_POLICIES_DIR`, else
/// `$CARGO_TARGET_DIR/policies`, else `<workspace>/target/policies`.
pub fn policies_dir() -> PathBuf {
    let workspace = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    if let Some(dir) = std::env::var_os("PD_POLICIES_DIR") {
        return PathBuf::from(dir);
    }
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(t) => workspace.join(t).join("policies"),
        None => workspace.join("target/policies"),
    }
}

/// The on-disk cache of compiled policies the gateway uses by default (the system temp dir
/// when no cache root is set).
pub fn compile_cache() -> PathBuf {
    pd_policy::default_cache_dir().unwrap_or_else(|| std::env::temp_dir().join("policy-cache"))
}

/// The bytes of guest `name` (`least-loaded`, `looping`, …). Panics when it is not built.
pub fn wasm(name: &str) -> Vec<u8> {
    let path = policies_dir().join(format!("{name}.wasm"));
    match std::fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) => panic!(
            "guest policy {} is missing ({e}): run scripts/build-policies.sh first \
             (or point PD_POLICIES_DIR at its output)",
            path.display()
        ),
    }
}

/// A deadline no test call reaches on a loaded machine: the 1 ms default is wall-clock time,
/// and tests run beside each other (and beside builds) on few cores. Tests of the deadline
/// itself set their own.
pub const RELAXED_DEADLINE: Duration = Duration::from_secs(10);

/// A default spec named `name`, with [`RELAXED_DEADLINE`].
pub fn spec(name: &str) -> PolicySpec {
    PolicySpec {
        name: name.to_string(),
        deadline: RELAXED_DEADLINE,
        ..PolicySpec::default()
    }
}

/// Loads guest `name` with [`spec`]`(name)`.
pub fn load(engine: &PolicyEngine, name: &str) -> WasmPolicy {
    let spec = spec(name);
    match engine.load(&wasm(name), spec) {
        Ok(p) => p,
        Err(e) => panic!("loading {name}: {e:?}"),
    }
}

/// Waits (up to 20 s: the machine may be busy) until `policy` has a spare instance ready.
pub fn wait_for_spare(policy: &WasmPolicy) {
    let started = std::time::Instant::now();
    while policy.spares_ready() == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{}: no spare instance was made in 20 s",
            policy.spec().name
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Checks that `ahead` (spares on) decides `request` on `view` from a spare instance exactly as
/// `inline` (the same component with `spares: 0`) does from one made on the call: the same
/// decision (for a guest that reads WASI, the same random bytes and clock readings) and the
/// same fuel, instantiation included.
pub fn spare_matches_inline(
    ahead: &WasmPolicy,
    inline: &WasmPolicy,
    request: &pd_policy::Request,
    view: &View,
) {
    wait_for_spare(ahead);
    let names = names(view);
    let (a, sa) = ahead.decide_with_stats(request, view, &Measured::default(), &names);
    let (b, sb) = inline.decide_with_stats(request, view, &Measured::default(), &names);
    let who = &ahead.spec().name;
    assert!(sa.spare, "{who}: the call did not use the ready spare");
    assert!(!sb.spare, "{who}: spares: 0 used a spare");
    assert_eq!(
        a.expect("decide (spare)"),
        b.expect("decide (inline)"),
        "{who}"
    );
    assert_eq!(sa.fuel_used, sb.fuel_used, "{who}: fuel differs");
    assert_eq!(inline.spares_ready(), 0, "{who}: spares: 0 made spares");
}

/// Names `node-0`, `node-1`, … for a view.
pub fn names(view: &View) -> std::sync::Arc<[std::sync::Arc<str>]> {
    (0..view.nodes.len())
        .map(|i| std::sync::Arc::from(format!("node-{i}")))
        .collect()
}

/// A node with the given role and load figures; the rest neutral.
pub fn node(role: Role, waiting: u32, running: u32, free_blocks: u32) -> Node {
    Node {
        role,
        free_blocks,
        total_blocks: 1024,
        leased_blocks: 0,
        waiting,
        running,
        waiting_remote_kv: 0,
        draining: false,
        conversation_tokens: 0,
        conversation_expiry_ms: 0,
    }
}

/// A request with sequence `seq`, `n` completions and the given per-node prefix blocks.
pub fn request(seq: u64, n: u32, prefix_blocks: Vec<u32>) -> Request {
    Request {
        seq,
        api: Api::Completions,
        prompt_tokens: 64,
        block_size: 16,
        block_hashes: vec![1, 2, 3, 4],
        prefix_blocks,
        n,
        max_tokens: Some(32),
        stream: true,
        conversation_key: Some("conv".to_string()),
    }
}

/// xorshift64*: a tiny seeded RNG, so failures replay.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// True with probability `percent`/100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    /// One of `items`.
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }
}

/// A random request and view for case `case` of a seeded sweep: sizes 0..=8 and 64 nodes,
/// few distinct load figures (ties), draining nodes, views without some roles, n up to 5,
/// prefix lists shorter than the view.
pub fn random_case(rng: &mut Rng, case: u64) -> (Request, View) {
    let len = match case % 10 {
        0 => 64,
        1 => 0,
        _ => rng.below(9) as usize,
    };
    // Some cases leave a role out entirely.
    let roles: &[Role] = match rng.below(6) {
        0 => &[Role::Standalone],
        1 => &[Role::Prefill, Role::Standalone],
        2 => &[Role::Decode],
        3 => &[Role::Prefill, Role::Decode],
        _ => &[Role::Prefill, Role::Decode, Role::Standalone],
    };
    let all_draining = rng.chance(10);
    let nodes = (0..len)
        .map(|_| Node {
            role: rng.pick(roles),
            free_blocks: rng.pick(&[0, 10, 10, 500, 1024]),
            total_blocks: 1024,
            leased_blocks: rng.below(8) as u32,
            waiting: rng.pick(&[0, 0, 1, 2, 7]),
            running: rng.pick(&[0, 1, 1, 3]),
            waiting_remote_kv: rng.pick(&[0, 0, 0, 1, 4]),
            draining: all_draining || rng.chance(20),
            conversation_tokens: 0,
            conversation_expiry_ms: 0,
        })
        .collect::<Vec<_>>();
    // Earlier-turn KV of the conversation: usually on no node, sometimes on one or two (ties
    // included), few or many tokens against the 100-token prompt.
    let mut nodes = nodes;
    if len > 0 && rng.chance(40) {
        for _ in 0..rng.pick(&[1, 1, 2]) {
            let i = rng.below(len as u64) as usize;
            nodes[i].conversation_tokens = rng.pick(&[2, 4, 64, 96, 96, 1000]);
            nodes[i].conversation_expiry_ms = 30_000;
        }
    }
    let prefix_len = if rng.chance(20) {
        rng.below(len as u64 + 1) as usize
    } else {
        len
    };
    let prefix_blocks = (0..prefix_len)
        .map(|_| rng.pick(&[0, 0, 1, 3, 8, 40]))
        .collect();
    let seq = if rng.chance(10) {
        u64::MAX - rng.below(3)
    } else {
        rng.below(1000)
    };
    let n = rng.pick(&[1, 1, 2, 3, 5]);
    (request(seq, n, prefix_blocks), View { nodes })
}

/// Views of a conversation's holder in each state `prefix-aware`'s rule 1 tells apart: idle;
/// only requests parked for KV (within the slack, and beyond it); queued; running; running
/// with a parked one. A decode holder beside a prefill and a decode node, and a standalone one
/// beside a standalone node. The random sweep reaches these only now and then.
pub fn holder_cases() -> Vec<(Request, View)> {
    let node = |role| Node {
        role,
        free_blocks: 500,
        total_blocks: 1024,
        leased_blocks: 0,
        waiting: 0,
        running: 0,
        waiting_remote_kv: 0,
        draining: false,
        conversation_tokens: 0,
        conversation_expiry_ms: 0,
    };
    let mut cases = Vec::new();
    for role in [Role::Decode, Role::Standalone] {
        for (waiting, running, parked) in [
            (0, 0, 0),
            (0, 0, 1),
            (0, 0, 3),
            (1, 0, 0),
            (0, 1, 0),
            (0, 1, 1),
        ] {
            let mut holder = node(role);
            (holder.waiting, holder.running, holder.waiting_remote_kv) = (waiting, running, parked);
            (holder.conversation_tokens, holder.conversation_expiry_ms) = (60, 30_000);
            let nodes = match role {
                Role::Decode => vec![node(Role::Prefill), node(role), holder],
                _ => vec![node(role), holder],
            };
            cases.push((request(7, 1, Vec::new()), View { nodes }));
        }
    }
    cases
}

/// Random measurements for `len` nodes: rates often not measured (0), else from slow to fast,
/// and KV bytes per token unknown or of models small to large, so the prefix-aware pull
/// threshold lands below, within and above the held token counts of [`random_case`].
pub fn random_measured(rng: &mut Rng, len: usize) -> Measured {
    let rates = if rng.chance(20) {
        Vec::new()
    } else {
        (0..len)
            .map(|_| Rates {
                prefill_tokens_per_s: rng.pick(&[0, 0, 500, 2_000, 40_000, 100_000]),
                pull_mb_per_s: rng.pick(&[0, 0, 10, 1_000, 10_000, 50_000]),
            })
            .collect()
    };
    Measured {
        rates,
        kv_bytes_per_token: rng.pick(&[0, 0, 1_024, 23_040, 131_072]),
    }
}
