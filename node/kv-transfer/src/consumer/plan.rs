//! A consumer's pull planned without IO: what the params say the producer holds
//! ([`Remote`], [`held_tokens`]), whether they describe the prompt ([`check_prompt`]), what to
//! pull once the engine reserved blocks ([`decide`]: nothing, below the threshold, or these
//! tokens), which of the producer's blocks land in which of ours ([`plan_pull`], converting
//! where block size or order differ), what arrived ([`arrived`]) and which failure policy
//! applies ([`policy_for`]). Block counts are ours unless named the producer's.

use pd_kv_pool::{BindingKey, BlockId, KvLayout, LeaseId};

use crate::compat::needs_rechunk;
use crate::peer::{FailurePolicy, TransferError};
use crate::pull::Rechunk;
use crate::puller::LeasePull;

/// Where a prompt's KV is and how to claim it: a node's parsed `kv_transfer_params` (the
/// node maps the wire's fields onto it; see `pd_wire::KvTransferParams`).
#[derive(Debug, Clone, PartialEq)]
pub struct Remote {
    /// The producer's blocks holding the KV (`remote_block_ids`), in order.
    pub block_ids: Vec<BlockId>,
    /// The producer's engine id (`remote_engine_id`): its handshake must say the same.
    pub engine_id: String,
    /// The producer's request id (`remote_request_id`).
    pub request_id: String,
    /// The producer's side channel (`remote_host`, `remote_port`).
    pub host: String,
    /// See `host`.
    pub port: u16,
    /// The lease holding the blocks (`remote_lease_id`).
    pub lease: LeaseId,
    /// Its generation (`remote_lease_generation`).
    pub generation: u64,
    /// Prompt tokens the blocks hold (`remote_num_tokens`), when the producer said.
    pub num_tokens: Option<usize>,
    /// The binding of the producer's prompt token ids (`remote_prompt_hash`,
    /// [`pd_kv_pool::prompt_binding`]), when it said.
    pub prompt_hash: Option<u128>,
    /// When the lease ends unless renewed (`remote_blocks_expiry_time`), when the producer said.
    pub expiry: Option<std::time::SystemTime>,
    /// The producer's incarnation (`remote_engine_epoch`), when it said: a cached handshake
    /// with another epoch is redone before any read.
    pub epoch: Option<u64>,
    /// The lease's record on the producer's lease board (`remote_lease_slot`), when it said:
    /// the lease is confirmed by reading it right after the blocks, without a round trip.
    pub board_slot: Option<u32>,
    /// Tokens per block of the producer's pool (`remote_block_size`), when it said; absent: the
    /// same as ours. The handshake's word decides: a pull from a producer whose blocks are of
    /// another size than this says fails as a mismatch.
    pub block_size: Option<usize>,
}

impl Remote {
    /// The producer's side channel, as a tonic endpoint URI.
    pub fn side_channel(&self) -> String {
        pd_wire::kv::side_channel_uri(&self.host, self.port)
    }
}

/// Prompt tokens whose KV `remote` holds: `remote_num_tokens`, else whole blocks (of
/// `block_size`), at most the prompt. The prompt's whole KV for a prefill's handoff; a prefix
/// of it for a retained turn.
pub fn held_tokens(remote: &Remote, prompt_len: usize, block_size: usize) -> usize {
    remote
        .num_tokens
        .unwrap_or(remote.block_ids.len() * block_size)
        .min(prompt_len)
}

/// The params do not describe the request's prompt: the field and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ParamsMismatch {
    /// The `kv_transfer_params` field that does not fit.
    pub field: &'static str,
    /// Why, for the client.
    pub message: String,
}

/// Whether `remote` describes this prompt's KV, or a prefix of it (a retained turn): no more
/// blocks than the prompt has, `remote_num_tokens` within the prompt and filling exactly the
/// blocks named, `remote_prompt_hash` equal to that prefix's binding under `key` (compared in
/// constant time). Runs before the request is queued, so a mismatch is the client's error. The
/// producer's own word on what its blocks hold is checked again at confirm
/// ([`super::confirm::attest`]).
///
/// # Errors
/// [`ParamsMismatch`] naming the field that does not fit.
pub fn check_prompt(
    remote: &Remote,
    prompt: &[u32],
    block_size: usize,
    key: &BindingKey,
) -> Result<(), ParamsMismatch> {
    // The producer's blocks: of the size it said (`remote_block_size`), else of ours.
    let block_size = remote.block_size.unwrap_or(block_size);
    if remote.block_ids.len() > prompt.len().div_ceil(block_size) {
        return Err(ParamsMismatch {
            field: "remote_block_ids",
            message: format!(
                "{} remote blocks for a prompt of {} tokens ({} blocks of {block_size})",
                remote.block_ids.len(),
                prompt.len(),
                prompt.len().div_ceil(block_size)
            ),
        });
    }
    let held = held_tokens(remote, prompt.len(), block_size);
    if let Some(n) = remote.num_tokens
        && (n > prompt.len() || n.div_ceil(block_size) != remote.block_ids.len())
    {
        return Err(ParamsMismatch {
            field: "remote_num_tokens",
            message: format!(
                "remote_num_tokens is {n} in {} blocks of {block_size}, the prompt has {} tokens",
                remote.block_ids.len(),
                prompt.len()
            ),
        });
    }
    if let Some(h) = remote.prompt_hash
        && !key.verify(&prompt[..held], h)
    {
        return Err(ParamsMismatch {
            field: "remote_prompt_hash",
            message: "remote_prompt_hash differs: the producer computed another prompt".into(),
        });
    }
    Ok(())
}

/// What the engine reserved for a consumer request (its `AwaitingKv`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reserved {
    /// Our blocks from the first without KV on: the pull writes these.
    pub blocks: Vec<BlockId>,
    /// The index in the prompt's blocks of `blocks[0]` (the blocks before it are our own
    /// prefix-cache hits).
    pub first_block: usize,
    /// Prompt tokens our own prefix cache had.
    pub cached: usize,
}

/// What to do once blocks are reserved ([`decide`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Nothing to pull (the local prefix cache had it): not a recompute.
    Nothing,
    /// Fewer tokens than the threshold: computed here on purpose (counted).
    BelowThreshold {
        /// The tokens that would have been pulled.
        tokens: usize,
    },
    /// Pull.
    Pull(Wanted),
}

/// A pull to make ([`Step::Pull`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wanted {
    /// Prompt tokens whose KV the producer holds ([`held_tokens`]).
    pub held: usize,
    /// The producer's block size as the params say (ours when they do not): its handshake must
    /// say the same.
    pub said_block_size: usize,
    /// What the reads move: whole blocks of the producer's size (for the pull's deadline).
    pub bytes: usize,
}

/// What to do for `remote`'s KV of a prompt of `prompt_len` tokens once the engine reserved
/// `reserved` in our pool laid out as `ours`: the KV the producer holds (the whole prompt, or a
/// prefix of it) less what we have; below `recompute_threshold` tokens it is computed here.
pub fn decide(
    remote: &Remote,
    prompt_len: usize,
    ours: &KvLayout,
    reserved: &Reserved,
    recompute_threshold: usize,
) -> Step {
    let bs = ours.block_size;
    let said_bs = remote.block_size.unwrap_or(bs);
    let held = held_tokens(remote, prompt_len, said_bs);
    let held_blocks = if said_bs == bs {
        remote.block_ids.len().min(held.div_ceil(bs))
    } else {
        held.div_ceil(bs)
    };
    let first_block = reserved.first_block;
    let wanted = held
        .min(prompt_len.saturating_sub(1))
        .saturating_sub(reserved.cached);
    if wanted == 0 || reserved.blocks.is_empty() || first_block >= held_blocks {
        return Step::Nothing;
    }
    if wanted < recompute_threshold {
        return Step::BelowThreshold { tokens: wanted };
    }
    // Whole blocks of the producer's size (the params' word until the handshake; a size other
    // than that fails the pull).
    let per_token = ours.block_bytes() / bs.max(1);
    let bytes = if said_bs == bs {
        (held_blocks - first_block) * ours.block_bytes()
    } else {
        (held.div_ceil(said_bs) - first_block * bs / said_bs)
            .saturating_mul(said_bs)
            .saturating_mul(per_token)
    };
    Step::Pull(Wanted {
        held,
        said_block_size: said_bs,
        bytes,
    })
}

/// What [`plan_pull`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullPlan {
    /// The producer's blocks to read.
    pub remote: Vec<BlockId>,
    /// Ours they land in (one per remote block, or, with `rechunk`, ours holding its tokens).
    pub local: Vec<BlockId>,
    /// The producer's blocks differ from ours in size or order: convert these tokens.
    pub rechunk: Option<Rechunk>,
}

/// Which of the producer's blocks to read into which of ours: the KV of the tokens from our
/// first block without KV (`first_block`, after our own prefix-cache hits) up to `held`.
/// `local` are our blocks from `first_block` on. The producer's blocks are of the size its
/// handshake says (`theirs`), which must be the size the params were checked with
/// (`said_bs`), and its KV must be shaped as ours (checked at the handshake unless told to
/// skip it). Where the producer's block size or order differ from ours, the tokens are
/// converted after the reads ([`Rechunk`]).
///
/// # Errors
/// [`TransferError::Mismatch`]: another shape or block size, or blocks that do not cover the
/// tokens.
pub fn plan_pull(
    ours: &KvLayout,
    theirs: &KvLayout,
    said_bs: usize,
    remote_ids: &[BlockId],
    local: &[BlockId],
    first_block: usize,
    held: usize,
) -> Result<PullPlan, TransferError> {
    let shape = |l: &KvLayout| (l.num_layers, l.num_kv_heads, l.head_dim, l.dtype);
    if shape(theirs) != shape(ours) {
        // (Only a handshake told to skip the compatibility check gets here.)
        return Err(TransferError::Mismatch(format!(
            "the producer's KV is shaped {:?}, ours {:?}",
            shape(theirs),
            shape(ours)
        )));
    }
    if theirs.block_size != said_bs {
        return Err(TransferError::Mismatch(format!(
            "the params were checked as blocks of {said_bs} tokens, the producer's hold {}",
            theirs.block_size
        )));
    }
    let bs = ours.block_size;
    let short = |what: &str| {
        TransferError::Mismatch(format!(
            "{what} do not cover tokens {}..{held}",
            first_block * bs
        ))
    };
    if !needs_rechunk(ours, theirs) {
        // Block for block.
        let held_blocks = remote_ids.len().min(held.div_ceil(bs));
        let remote = remote_ids
            .get(first_block..held_blocks)
            .ok_or_else(|| short("the producer's blocks"))?;
        let local = local
            .get(..remote.len())
            .ok_or_else(|| short("our reserved blocks"))?;
        return Ok(PullPlan {
            remote: remote.to_vec(),
            local: local.to_vec(),
            rechunk: None,
        });
    }
    let tokens = first_block * bs..held;
    let rbs = theirs.block_size;
    let remote = remote_ids
        .get(tokens.start / rbs..held.div_ceil(rbs))
        .ok_or_else(|| short("the producer's blocks"))?;
    let local = local
        .get(..held.div_ceil(bs).saturating_sub(first_block))
        .ok_or_else(|| short("our reserved blocks"))?;
    Ok(PullPlan {
        remote: remote.to_vec(),
        local: local.to_vec(),
        rechunk: Some(Rechunk {
            from: *theirs,
            to: *ours,
            tokens,
        }),
    })
}

/// What a consumer request gets: the KV that arrived, or that it computes the prompt here.
/// (The engine's `RemoteKv`, which the node maps it to.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrived {
    /// The KV of the prompt's first `n` tokens is in the reserved blocks.
    Pulled(usize),
    /// As [`Arrived::Pulled`], from a producer that did not attest what its blocks hold: for
    /// this request only, never the prefix cache.
    Unattested(usize),
    /// As [`Arrived::Pulled`] for the whole prompt, with the producer's first token and how it
    /// was picked, attested with the blocks: a request here that would pick it the same way
    /// emits it without computing (the engine decides).
    WithFirstToken {
        /// Prompt tokens whose KV is in the reserved blocks.
        tokens: usize,
        /// The producer's token after them.
        first_token: u32,
        /// How it was picked (`LeaseContents::next_token_key`).
        key: u64,
    },
    /// Nothing usable arrived: compute the prompt here.
    Recompute,
}

/// What a confirmed pull of `held` tokens of a prompt of `prompt_len` brought.
pub fn arrived(pull: &LeasePull, held: usize, prompt_len: usize) -> Arrived {
    match pull.next_token {
        // A prefill's first token, vouched for with the blocks.
        Some((first_token, key)) if held == prompt_len => Arrived::WithFirstToken {
            tokens: held,
            first_token,
            key,
        },
        _ if pull.attested => Arrived::Pulled(held),
        // KV nobody vouched for: this request only, never the cache.
        _ => Arrived::Unattested(held),
    }
}

/// The failure policy for a failed pull of `held` tokens of a prompt of `prompt_len`: an
/// earlier turn's KV (a prefix) only saves compute, so without it the prompt is computed here
/// whatever `configured` says, which is for a prefill's handoff.
pub fn policy_for(held: usize, prompt_len: usize, configured: FailurePolicy) -> FailurePolicy {
    if held < prompt_len {
        FailurePolicy::Recompute
    } else {
        configured
    }
}

/// Whether a failure makes the consumer forget the producer (reconnect and handshake afresh
/// next time): every one but params that do not fit, which say nothing about the producer.
pub fn forgets(e: &TransferError) -> bool {
    !matches!(e, TransferError::Mismatch(_))
}

#[cfg(test)]
mod tests {
    use super::*;
    use pd_kv_pool::{KvDtype, KvOrder};

    fn layout(block_size: usize, order: KvOrder) -> KvLayout {
        KvLayout {
            num_blocks: 64,
            block_size,
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 8,
            dtype: KvDtype::F32,
            order,
        }
    }

    /// The test cluster's binding key.
    fn key() -> BindingKey {
        BindingKey::from_cluster_token("test-cluster")
    }

    /// `tokens`' binding under [`key`].
    fn prompt_hash(tokens: &[u32]) -> u128 {
        pd_kv_pool::prompt_binding(&key(), tokens)
    }

    fn ids(v: &[u32]) -> Vec<BlockId> {
        v.iter().copied().map(BlockId).collect()
    }

    fn remote(blocks: &[u32]) -> Remote {
        Remote {
            block_ids: ids(blocks),
            engine_id: "p".into(),
            request_id: "r".into(),
            host: "::1".into(),
            port: 7000,
            lease: LeaseId(1),
            generation: 1,
            num_tokens: None,
            prompt_hash: None,
            expiry: None,
            epoch: None,
            board_slot: None,
            block_size: None,
        }
    }

    /// Why the binding is 128 bits of a keyed MAC: the same attack on a narrow one.
    /// Truncated to 16 bits, the old binding (xxh3 of the token ids) collides within a few
    /// hundred random prompts (a birthday search; at 64 bits, ~2^32 tries, in reach offline):
    /// params made for one prompt of such a pair would pass as the other's, and D would decode
    /// one prompt on the other's KV. The real binding tells the pair apart, and the params are
    /// refused by name.
    #[test]
    fn a_colliding_pair_of_a_narrow_binding_is_told_apart_and_refused() {
        let narrow = |t: &[u32]| pd_kv_pool::block_hash(None, t).0 & 0xffff;
        let mut seen = std::collections::HashMap::new();
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let (a, b) = loop {
            let prompt: Vec<u32> = (0..16)
                .map(|_| {
                    state = state
                        .wrapping_mul(6_364_136_223_846_793_005)
                        .wrapping_add(1);
                    (state >> 40) as u32 % 50_000
                })
                .collect();
            if let Some(other) = seen.insert(narrow(&prompt), prompt.clone())
                && other != prompt
            {
                break (other, prompt);
            }
            assert!(seen.len() < 100_000, "no 16-bit collision found");
        };
        assert_eq!(narrow(&a), narrow(&b), "a collision of the narrow binding");
        assert_ne!(prompt_hash(&a), prompt_hash(&b));
        let mut r = remote(&[0, 1, 2, 3]);
        (r.num_tokens, r.prompt_hash) = (Some(a.len()), Some(prompt_hash(&a)));
        check_prompt(&r, &a, 4, &key()).expect("the params' own prompt");
        let e = check_prompt(&r, &b, 4, &key()).expect_err("the colliding prompt");
        assert_eq!(e.field, "remote_prompt_hash");
        // A binding made without this cluster's key (another token's) does not pass either.
        r.prompt_hash = Some(pd_kv_pool::prompt_binding(
            &BindingKey::from_cluster_token("another-cluster"),
            &a,
        ));
        let e = check_prompt(&r, &a, 4, &key()).expect_err("another cluster's binding");
        assert_eq!(e.field, "remote_prompt_hash");
    }

    #[test]
    fn the_side_channel_brackets_ipv6() {
        assert_eq!(remote(&[]).side_channel(), "http://[::1]:7000");
    }

    #[test]
    fn the_params_must_describe_the_prompt_or_a_prefix_of_it() {
        let prompt: Vec<u32> = (0..40).collect();
        // 40 tokens in blocks of 16: 3 blocks at most.
        let r = remote(&[1, 2, 3]);
        assert_eq!(held_tokens(&r, 40, 16), 40);
        assert_eq!(check_prompt(&r, &prompt, 16, &key()), Ok(()));
        let e = check_prompt(&remote(&[1, 2, 3, 4]), &prompt, 16, &key()).unwrap_err();
        assert_eq!(e.field, "remote_block_ids");
        // Blocks of the producer's size: 4 blocks of 10 fit.
        let theirs = Remote {
            block_size: Some(10),
            ..remote(&[1, 2, 3, 4])
        };
        assert_eq!(check_prompt(&theirs, &prompt, 16, &key()), Ok(()));
        // A retained turn: a prefix of 20 tokens in 2 blocks, with its hash.
        let prefix = Remote {
            num_tokens: Some(20),
            prompt_hash: Some(prompt_hash(&prompt[..20])),
            ..remote(&[5, 6])
        };
        assert_eq!(held_tokens(&prefix, 40, 16), 20);
        assert_eq!(check_prompt(&prefix, &prompt, 16, &key()), Ok(()));
        let wrong_count = Remote {
            num_tokens: Some(33),
            ..prefix.clone()
        };
        let e = check_prompt(&wrong_count, &prompt, 16, &key()).unwrap_err();
        assert_eq!(e.field, "remote_num_tokens");
        let too_many = Remote {
            num_tokens: Some(41),
            ..remote(&[1, 2, 3])
        };
        assert_eq!(
            check_prompt(&too_many, &prompt, 16, &key())
                .unwrap_err()
                .field,
            "remote_num_tokens"
        );
        let other = Remote {
            prompt_hash: Some(prompt_hash(&prompt[..21])),
            ..prefix
        };
        let e = check_prompt(&other, &prompt, 16, &key()).unwrap_err();
        assert_eq!(e.field, "remote_prompt_hash");
        assert!(e.to_string().contains("another prompt"), "{e}");
    }

    #[test]
    fn what_to_pull_once_blocks_are_reserved() {
        let ours = layout(16, KvOrder::Hnd);
        let r = remote(&[1, 2, 3]);
        let reserved = |first_block, cached| Reserved {
            blocks: ids(&[10, 11, 12]),
            first_block,
            cached,
        };
        // 40 tokens: all but the last position's KV is wanted; three blocks move.
        assert_eq!(
            decide(&r, 40, &ours, &reserved(0, 0), 0),
            Step::Pull(Wanted {
                held: 40,
                said_block_size: 16,
                bytes: 3 * ours.block_bytes()
            })
        );
        // Our own cache had the first block.
        let Step::Pull(w) = decide(&r, 40, &ours, &reserved(1, 16), 0) else {
            panic!()
        };
        assert_eq!(w.bytes, 2 * ours.block_bytes());
        // Below the threshold: computed here, counted.
        assert_eq!(
            decide(&r, 40, &ours, &reserved(1, 16), 24),
            Step::BelowThreshold { tokens: 23 }
        );
        // Nothing wanted, nothing reserved, or nothing past our cached blocks.
        assert_eq!(decide(&r, 40, &ours, &reserved(2, 39), 0), Step::Nothing);
        let none = Reserved {
            blocks: Vec::new(),
            first_block: 0,
            cached: 0,
        };
        assert_eq!(decide(&r, 40, &ours, &none, 0), Step::Nothing);
        assert_eq!(decide(&r, 40, &ours, &reserved(3, 0), 0), Step::Nothing);
        // The producer's blocks of 8: five of them, whole, for 40 tokens.
        let small = Remote {
            block_size: Some(8),
            ..remote(&[1, 2, 3, 4, 5])
        };
        let Step::Pull(w) = decide(&small, 40, &ours, &reserved(0, 0), 0) else {
            panic!()
        };
        assert_eq!((w.held, w.said_block_size), (40, 8));
        assert_eq!(w.bytes, 5 * ours.block_bytes() / 2);
    }

    #[test]
    fn block_for_block_from_our_first_block_without_kv() {
        let ours = layout(16, KvOrder::Hnd);
        let plan = plan_pull(&ours, &ours, 16, &ids(&[1, 2, 3]), &ids(&[11, 12]), 1, 40).unwrap();
        assert_eq!(plan.remote, ids(&[2, 3]));
        assert_eq!(plan.local, ids(&[11, 12]));
        assert_eq!(plan.rechunk, None);
        let e = plan_pull(&ours, &ours, 16, &ids(&[1, 2, 3]), &ids(&[11]), 1, 40).unwrap_err();
        assert!(e.to_string().contains("our reserved blocks"), "{e}");
        let e = plan_pull(&ours, &ours, 16, &ids(&[1]), &ids(&[11, 12]), 2, 40).unwrap_err();
        assert!(e.to_string().contains("the producer's blocks"), "{e}");
    }

    #[test]
    fn other_block_sizes_or_orders_are_converted() {
        let ours = layout(16, KvOrder::Hnd);
        let theirs = layout(8, KvOrder::Nhd);
        // Tokens 16..40: the producer's blocks 2..5 (of 8), ours from block 1.
        let remote_ids = ids(&[1, 2, 3, 4, 5]);
        let plan = plan_pull(&ours, &theirs, 8, &remote_ids, &ids(&[11, 12]), 1, 40).unwrap();
        assert_eq!(plan.remote, ids(&[3, 4, 5]));
        assert_eq!(plan.local, ids(&[11, 12]));
        assert_eq!(
            plan.rechunk,
            Some(Rechunk {
                from: theirs,
                to: ours,
                tokens: 16..40
            })
        );
        // Same size, other order: converted too.
        let nhd = layout(16, KvOrder::Nhd);
        let plan = plan_pull(
            &ours,
            &nhd,
            16,
            &ids(&[1, 2, 3]),
            &ids(&[10, 11, 12]),
            0,
            40,
        );
        assert!(plan.unwrap().rechunk.is_some());
    }

    #[test]
    fn another_shape_or_block_size_than_said_is_a_mismatch() {
        let ours = layout(16, KvOrder::Hnd);
        let wide = KvLayout {
            num_kv_heads: 4,
            ..ours
        };
        let e = plan_pull(&ours, &wide, 16, &ids(&[1]), &ids(&[2]), 0, 16).unwrap_err();
        assert_eq!(e.reason(), "params_mismatch");
        assert!(e.to_string().contains("shaped"), "{e}");
        let e = plan_pull(&ours, &ours, 8, &ids(&[1]), &ids(&[2]), 0, 16).unwrap_err();
        assert!(e.to_string().contains("blocks of 8 tokens"), "{e}");
        assert!(
            !forgets(&e),
            "params that do not fit say nothing of the producer"
        );
        assert!(forgets(&TransferError::PullerStopped));
    }

    #[test]
    fn what_arrived_and_which_policy_applies() {
        let stats = crate::pull::PullStats {
            bytes: 0,
            descriptors: 0,
            post_time: std::time::Duration::ZERO,
            total_time: std::time::Duration::ZERO,
            copied: false,
            tcp: false,
            helper_bytes: 0,
            landed_blocks: 0,
            landed_early: 0,
        };
        let pull = |attested, next_token| LeasePull {
            stats,
            attested,
            next_token,
        };
        assert_eq!(
            arrived(&pull(true, Some((7, 3))), 40, 40),
            Arrived::WithFirstToken {
                tokens: 40,
                first_token: 7,
                key: 3
            }
        );
        // A prefix (an earlier turn): its next token is not this prompt's.
        assert_eq!(
            arrived(&pull(true, Some((7, 3))), 32, 40),
            Arrived::Pulled(32)
        );
        assert_eq!(arrived(&pull(true, None), 40, 40), Arrived::Pulled(40));
        assert_eq!(arrived(&pull(false, None), 40, 40), Arrived::Unattested(40));
        assert_eq!(policy_for(40, 40, FailurePolicy::Fail), FailurePolicy::Fail);
        assert_eq!(
            policy_for(32, 40, FailurePolicy::Fail),
            FailurePolicy::Recompute
        );
    }
}
