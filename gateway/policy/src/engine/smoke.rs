//! The smoke test a policy passes before it is loaded: an instance can be made, and `decide`
//! answers valid decisions on synthetic views under the spec's limits; a policy that declares
//! itself stateless answers them again the same in the instance that answered them.

use std::sync::Arc;

use super::call::WasmPolicy;
use super::host::NodeNames;
use crate::{Api, Measured, Node, PolicyError, Rates, Request, Role, View};

/// Extra tries a smoke-test call gets when it times out (and only then).
const SMOKE_TIMEOUT_RETRIES: u32 = 2;

/// What the smoke-test calls pass as the request's time (`now-ns` reads 0).
const SMOKE_TIME_MS: u64 = 0;

/// Runs the smoke test on `policy`: first an instance is made at all (a memory limit below
/// the guest's initial memory, say, fails here), then each of [`smoke_cases`] decides, a
/// call that times out tried up to [`SMOKE_TIMEOUT_RETRIES`] more times.
///
/// # Errors
///
/// [`PolicyError::SmokeTest`] naming the case that failed, with its error inside.
pub(super) fn test(policy: &WasmPolicy) -> Result<(), PolicyError> {
    let failed = |case, e| PolicyError::SmokeTest {
        name: policy.spec().name.clone(),
        case,
        source: Box::new(e),
    };
    if let Err((e, _)) = policy.core.instantiate() {
        return Err(failed("instantiate", e));
    }
    let measured = smoke_measured();
    let decide = |request: &Request, view: &View, names: &NodeNames| {
        // A timeout can be the machine's fault (the thread was descheduled, the pool slot
        // was cold): refuse only a policy that times out every time.
        let mut timeouts = 0;
        loop {
            match policy.decide_at(request, view, &measured, names, SMOKE_TIME_MS) {
                Err(PolicyError::Timeout { .. }) if timeouts < SMOKE_TIMEOUT_RETRIES => {
                    timeouts += 1;
                }
                answer => return answer,
            }
        }
    };
    let mut first = Vec::new();
    for (case, request, view, names) in smoke_cases() {
        first.push(decide(&request, &view, &names).map_err(|e| failed(case, e))?);
    }
    if policy.reuses_instances() {
        // The cases again, now in the instance that answered them (the ready list was empty
        // before the smoke test, so every call above and here ran in the one instance the
        // first made): a policy that declares itself stateless must answer as it did. This
        // catches a counter or a cache that changes answers, not every kind of state.
        for ((case, request, view, names), before) in smoke_cases().into_iter().zip(first) {
            let again = decide(&request, &view, &names).map_err(|e| failed(case, e))?;
            if again != before {
                return Err(failed(
                    case,
                    PolicyError::NotStateless {
                        first: Box::new(before),
                        again: Box::new(again),
                    },
                ));
            }
        }
    }
    Ok(())
}

/// Rates on some nodes, not all: a policy must cope with both.
fn smoke_measured() -> Measured {
    Measured {
        rates: vec![
            Rates {
                prefill_tokens_per_s: 2_500,
                pull_mb_per_s: 0,
            },
            Rates::default(),
            Rates {
                prefill_tokens_per_s: 0,
                pull_mb_per_s: 1_800,
            },
        ],
        kv_bytes_per_token: 23_040,
    }
}

/// The synthetic calls of the load-time smoke test: 2 prefill + 2 decode + 1 standalone nodes,
/// with `n = 1` and `n = 3`.
fn smoke_cases() -> Vec<(&'static str, Request, View, NodeNames)> {
    let node = |role: Role, waiting: u32| Node {
        role,
        free_blocks: 900,
        total_blocks: 1024,
        leased_blocks: 4,
        waiting,
        running: 2,
        waiting_remote_kv: 1,
        draining: false,
        conversation_tokens: 0,
        conversation_expiry_ms: 0,
    };
    let view = View {
        nodes: vec![
            node(Role::Prefill, 1),
            node(Role::Prefill, 0),
            node(Role::Decode, 3),
            node(Role::Decode, 2),
            node(Role::Standalone, 0),
        ],
    };
    let names: NodeNames = (0..view.nodes.len())
        .map(|i| Arc::from(format!("smoke-{i}")))
        .collect();
    let request = |seq: u64, n: u32| Request {
        seq,
        api: Api::ChatCompletions,
        prompt_tokens: 40,
        block_size: 16,
        block_hashes: vec![0x9e37_79b9_7f4a_7c15, 0xc2b2_ae3d_27d4_eb4f],
        prefix_blocks: vec![2, 0, 0, 1, 0],
        n,
        max_tokens: Some(16),
        stream: false,
        conversation_key: None,
    };
    vec![
        ("n=1", request(0, 1), view.clone(), names.clone()),
        ("n=3", request(1, 3), view, names),
    ]
}
