//! `kv_transfer_params` read as a decode node reads a request's (`pd_wire::kv::read`, then the
//! node's checks of `node/server/src/kv_params.rs`), then planned as the consumer plans a pull
//! (`pd_kv_transfer::consumer::plan`: `check_prompt`, `decide`, `plan_pull`).
//!
//! Input: JSON text, a `0xFF` byte, then the bytes the prompt and the pools are read from.
//!
//! Properties: nothing panics; reading what was read and written back gives the same params;
//! a prompt the params pass `check_prompt` for holds the tokens they name; a plan reads only
//! blocks the params named into only blocks the engine reserved, one for one unless converting,
//! and converts only tokens of the prompt.

use std::sync::OnceLock;

use pd_kv_pool::{BindingKey, BlockId, KvDtype, KvLayout, KvOrder, LeaseId, prompt_binding};
use pd_kv_transfer::consumer::plan::{
    Remote, Reserved, Step, check_prompt, decide, held_tokens, plan_pull,
};
use pd_wire::KvTransferParams;
use serde_json::Value;

use crate::input::Input;

/// `remote_block_size`'s bound on a node (`MAX_BLOCK_SIZE` of `node/server/src/kv_params.rs`).
const MAX_BLOCK_SIZE: u32 = 4096;

/// The consumer side of `node/server/src/kv_params.rs::directive`: the params of a pull, or
/// `None` where the node answers 400 or pulls nothing (a field missing or out of range).
pub fn remote_of(o: &KvTransferParams) -> Option<Remote> {
    if o.tp_size.is_some_and(|t| t != 1) || !o.do_remote_prefill || o.do_remote_decode {
        return None;
    }
    let block_size = match o.remote_block_size {
        Some(0) => return None,
        Some(n) if n > MAX_BLOCK_SIZE => return None,
        n => n.map(|n| n as usize),
    };
    let expiry = match o.remote_blocks_expiry_time {
        None => None,
        Some(s) if s.is_finite() && s >= 0.0 => std::time::Duration::try_from_secs_f64(s)
            .ok()
            .and_then(|d| std::time::UNIX_EPOCH.checked_add(d)),
        Some(_) => return None,
    };
    Some(Remote {
        block_ids: o
            .remote_block_ids
            .clone()?
            .into_iter()
            .map(BlockId)
            .collect(),
        engine_id: o.remote_engine_id.clone()?,
        request_id: o.remote_request_id.clone()?,
        host: o.remote_host.clone()?,
        port: o.remote_port?,
        lease: o.remote_lease_id.as_deref()?.parse::<LeaseId>().ok()?,
        generation: o.remote_lease_generation?,
        num_tokens: o.remote_num_tokens.map(|n| n as usize),
        prompt_hash: o.remote_prompt_hash.map(|h| h.0),
        expiry,
        epoch: o.remote_engine_epoch.map(|e| e.0),
        board_slot: o.remote_lease_slot,
        block_size,
    })
}

/// The target.
pub fn run(data: &[u8]) {
    crate::caught_panics_are_not_crashes();
    let mut input = Input::new(data);
    let json = input.until(&[0xFF]);
    let Ok(v) = serde_json::from_slice::<Value>(json) else {
        return;
    };
    // A request body carries the field; a bare object or list is the field itself.
    let field = v.get(pd_wire::kv::FIELD).unwrap_or(&v);
    let Ok(list) = pd_wire::kv::read(Some(field)) else {
        return;
    };
    for p in &list {
        let written = p.to_value();
        let again = KvTransferParams::from_value(&written)
            .unwrap_or_else(|e| panic!("params written as {written} do not read back: {e}"));
        assert_eq!(
            &again, p,
            "params change when written and read back as {written}"
        );
        let _ = p.side_channel();
        let _ = (p.to_pull(), p.to_produce());
    }
    for p in &list {
        if let Some(mut remote) = remote_of(p) {
            let _ = remote.side_channel();
            plan(&mut remote, &mut input);
        }
    }
}

/// The binding key of a cluster (what `remote_prompt_hash` is keyed with).
fn key() -> &'static BindingKey {
    static KEY: OnceLock<BindingKey> = OnceLock::new();
    KEY.get_or_init(|| BindingKey::from_cluster_token("fuzz-cluster-token"))
}

fn plan(remote: &mut Remote, input: &mut Input<'_>) {
    let bs = input.pick(&[1usize, 2, 3, 4, 16, 32, 64, 128]);
    let len = input.below(1024);
    let prompt: Vec<u32> = (0..len).map(|_| u32::from(input.byte())).collect();
    // A hash the producer computed for this prompt (the fuzzer cannot guess 128 bits).
    if input.bool() {
        let said = remote.block_size.unwrap_or(bs);
        let held = held_tokens(remote, prompt.len(), said);
        remote.prompt_hash = Some(prompt_binding(key(), &prompt[..held]));
    }
    if check_prompt(remote, &prompt, bs, key()).is_err() {
        return;
    }
    let said_bs = remote.block_size.unwrap_or(bs);
    let held = held_tokens(remote, prompt.len(), said_bs);
    assert!(held <= prompt.len(), "held {held} of a {len}-token prompt");
    assert!(
        remote.block_ids.len() <= prompt.len().div_ceil(said_bs),
        "more blocks than the prompt has passed check_prompt"
    );
    let ours = KvLayout {
        num_blocks: 1 << 16,
        block_size: bs,
        num_layers: 1 + input.below(4),
        num_kv_heads: 1 + input.below(4),
        head_dim: input.pick(&[1usize, 2, 8, 64]),
        dtype: input.pick(&[KvDtype::F32, KvDtype::F16, KvDtype::BF16]),
        order: input.pick(&[KvOrder::Hnd, KvOrder::Nhd]),
    };
    // The engine reserves our blocks from the first without KV in our own prefix cache.
    let prompt_blocks = prompt.len().div_ceil(bs);
    let first_block = input.below(prompt_blocks + 1);
    let reserved = Reserved {
        blocks: (first_block..prompt_blocks)
            .map(|b| BlockId(100_000 + b as u32))
            .collect(),
        first_block,
        cached: (first_block * bs).min(prompt.len()),
    };
    let threshold = input.below(64);
    let Step::Pull(w) = decide(remote, prompt.len(), &ours, &reserved, threshold) else {
        return;
    };
    assert!(w.held <= prompt.len());
    let theirs = KvLayout {
        block_size: if input.bool() {
            w.said_block_size
        } else {
            1 + input.below(MAX_BLOCK_SIZE as usize)
        },
        order: input.pick(&[KvOrder::Hnd, KvOrder::Nhd]),
        ..ours
    };
    let Ok(plan) = plan_pull(
        &ours,
        &theirs,
        w.said_block_size,
        &remote.block_ids,
        &reserved.blocks,
        reserved.first_block,
        w.held,
    ) else {
        return;
    };
    assert!(
        plan.remote.iter().all(|b| remote.block_ids.contains(b)),
        "a plan reads blocks the params did not name"
    );
    assert!(
        plan.local.iter().all(|b| reserved.blocks.contains(b)),
        "a plan writes blocks the engine did not reserve"
    );
    match &plan.rechunk {
        None => assert_eq!(plan.remote.len(), plan.local.len()),
        Some(r) => {
            assert!(
                r.tokens.end <= prompt.len(),
                "converts tokens {:?} of a {}-token prompt",
                r.tokens,
                prompt.len()
            );
            assert!(
                plan.local.len() * ours.block_size >= r.tokens.len(),
                "our blocks do not hold the tokens converted"
            );
        }
    }
}
