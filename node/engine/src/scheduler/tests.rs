//! The scheduler's unit tests: budgets and chunks, prompt rows, parking for remote KV,
//! preemption, copy-on-write.

use super::*;
use rand::SeedableRng;

fn seq(request: u64, len: usize, tok: &pd_tokenize::Tokenizer) -> Sequence {
    Sequence {
        request: RequestId(request),
        child: 0,
        tokens: (0..len as u32)
            .map(|i| (i + request as u32 * 7) % 256)
            .collect(),
        prompt_len: len,
        num_computed: 0,
        blocks: Vec::new(),
        hashes: Vec::new(),
        root: None,
        cacheable: true,
        rng: rand_chacha::ChaCha8Rng::seed_from_u64(0),
        decoder: tok.decoder(true),
        text: String::new(),
        sent: 0,
        stop_floor: 0,
        last_token_at: None,
        grammar: None,
        prompt_rows: None,
    }
}

/// One tokenizer for all tests of this module (they run in parallel threads: writing the
/// files once avoids one test reading them while another rewrites them).
fn tokenizer() -> &'static pd_tokenize::Tokenizer {
    static TOK: std::sync::OnceLock<pd_tokenize::Tokenizer> = std::sync::OnceLock::new();
    TOK.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("pd-sched-tok-{}", std::process::id()));
        pd_tokenize::write_byte_level_tokenizer(&dir, 300).unwrap();
        pd_tokenize::Tokenizer::from_dir(&dir).unwrap()
    })
}

fn cfg(budget: usize) -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        max_num_batched_tokens: budget,
        max_num_seqs: 8,
        enable_prefix_caching: true,
    }
}

/// Runs `plan` as if the forward pass happened, appending a token to finished prefills.
fn complete(s: &mut Scheduler, plan: &StepPlan) {
    for sc in &plan.scheduled {
        s.commit(*sc);
        let q = &mut s.running[sc.index];
        if q.num_computed == q.tokens.len() {
            q.tokens.push(1);
        }
    }
}

#[test]
fn chunked_prefill_respects_the_budget() {
    let tok = tokenizer();
    let mut s = Scheduler::new(cfg(8), 32);
    s.waiting.push_back(seq(1, 20, tok));
    let mut steps = Vec::new();
    for _ in 0..3 {
        let plan = s.schedule();
        steps.push(plan.scheduled.iter().map(|x| x.num_tokens).sum::<usize>());
        complete(&mut s, &plan);
    }
    assert_eq!(steps, vec![8, 8, 4]);
}

#[test]
fn a_sequence_wanting_prompt_rows_computes_its_whole_prompt_in_bounded_chunks() {
    let tok = tokenizer();
    let len = PROMPT_ROWS_CHUNK + 100;
    let mut s = Scheduler::new(cfg(2048), 1024);
    // Its prompt in the prefix cache first.
    s.waiting.push_back(seq(1, len, tok));
    while s.running.first().is_none_or(|q| q.num_computed < len) {
        let plan = s.schedule();
        complete(&mut s, &plan);
    }
    let mut q = seq(1, len, tok);
    q.prompt_rows = Some(1);
    s.waiting.push_back(q);
    let plan = s.schedule();
    let mine = plan.scheduled.last().unwrap();
    assert_eq!(
        plan.admitted.last(),
        Some(&(RequestId(1), 0)),
        "no cache hit"
    );
    assert_eq!(mine.num_tokens, PROMPT_ROWS_CHUNK);
    complete(&mut s, &plan);
    let plan = s.schedule();
    assert_eq!(plan.scheduled.last().unwrap().num_tokens, 100);
}

#[test]
fn the_sequences_wanting_prompt_rows_share_one_bound_per_step() {
    let tok = tokenizer();
    let mut s = Scheduler::new(cfg(4096), 2048);
    for r in 1..=3 {
        let mut q = seq(r, 400, tok);
        q.prompt_rows = Some(1);
        s.waiting.push_back(q);
    }
    s.waiting.push_back(seq(4, 300, tok)); // wants no rows
    let mut computed = [0usize; 4];
    for step in 0..4 {
        let plan = s.schedule();
        let mut rows = 0;
        for x in &plan.scheduled {
            let q = &s.running[x.index];
            if q.wants_rows() {
                rows += x.num_tokens;
            }
            computed[q.request.0 as usize - 1] += x.num_tokens;
        }
        assert!(rows <= PROMPT_ROWS_CHUNK, "step {step}: {rows} rows");
        complete(&mut s, &plan);
    }
    assert!(
        computed[..3].iter().all(|&c| c > 400) && computed[3] > 300,
        "every prompt computed: {computed:?}"
    );
}

#[test]
fn sequence_waiting_for_remote_kv_does_not_block_others() {
    let tok = tokenizer();
    let mut s = Scheduler::new(cfg(64), 32);
    s.remote_pending.push_back(seq(1, 10, tok));
    let got = s.park_pending(&mut || None);
    assert_eq!(got.len(), 1);
    assert_eq!((got[0].2, got[0].3), (0, 0), "nothing cached locally");
    let parked = s.blocks_of(RequestId(1));
    assert_eq!(parked.len(), 3);
    assert_eq!(got[0].1, parked);
    s.waiting.push_back(seq(2, 6, tok));
    for _ in 0..5 {
        let plan = s.schedule();
        assert!(
            plan.scheduled
                .iter()
                .all(|x| s.running[x.index].request == RequestId(2))
        );
        assert!(!plan.scheduled.is_empty());
        complete(&mut s, &plan);
        // The parked sequence's blocks are never handed to anyone else.
        for r in &s.running {
            assert!(r.blocks.iter().all(|b| !parked.contains(b)));
        }
    }
    // KV for all 10 prompt tokens arrived: it computes just the last one for its logits.
    assert_eq!(
        s.remote_kv_ready(RequestId(1), 10, true, false),
        Some((10, 9, 9))
    );
    let plan = s.schedule();
    let mine: Vec<_> = plan
        .scheduled
        .iter()
        .filter(|x| s.running[x.index].request == RequestId(1))
        .collect();
    assert_eq!(mine.len(), 1);
    assert_eq!(mine[0].num_tokens, 1);
    assert_eq!(s.running[mine[0].index].blocks, parked);
}

#[test]
fn unattested_remote_kv_never_enters_the_prefix_cache() {
    let tok = tokenizer();
    for (attested, want_cached) in [(true, true), (false, false)] {
        let mut s = Scheduler::new(cfg(64), 32);
        s.remote_pending.push_back(seq(1, 10, tok));
        assert_eq!(s.park_pending(&mut || None).len(), 1);
        assert_eq!(
            s.remote_kv_ready(RequestId(1), 10, attested, false),
            Some((10, 9, 9))
        );
        // Compute the last prompt token and a few more: blocks 0..=2 fill up.
        for _ in 0..4 {
            let plan = s.schedule();
            complete(&mut s, &plan);
            let r = &mut s.running[0];
            r.tokens.push(1);
        }
        assert_eq!(
            !s.allocator.cached_hashes().is_empty(),
            want_cached,
            "attested: {attested}"
        );
    }
}

#[test]
fn exhausted_pool_preempts_the_newest_and_frees_its_blocks() {
    let tok = tokenizer();
    // 6 blocks; two prompts of 8 tokens take 2 blocks each, decoding needs one more each.
    let mut s = Scheduler::new(cfg(64), 5);
    s.waiting.push_back(seq(1, 8, tok));
    s.waiting.push_back(seq(2, 8, tok));
    let plan = s.schedule();
    assert_eq!(plan.scheduled.len(), 2);
    complete(&mut s, &plan);
    let plan = s.schedule(); // seq 1 takes the 5th block; seq 2 finds none and is preempted
    assert_eq!(plan.preempted, 1);
    assert_eq!(s.waiting.front().map(|q| q.request), Some(RequestId(2)));
    assert!(s.waiting[0].blocks.is_empty() && s.waiting[0].num_computed == 0);
    assert_eq!(s.allocator.num_free(), 5 - 3);
}

#[test]
fn the_last_sharer_of_a_partial_block_writes_it_in_place() {
    let tok = tokenizer();
    let mut s = Scheduler::new(cfg(64), 16);
    // Three children of one prompt: 6 tokens, 5 computed, sharing b0 and the partial p.
    let b0 = s.allocator.allocate().unwrap();
    let p = s.allocator.allocate().unwrap();
    let mut children = Vec::new();
    for c in 0..3 {
        if c > 0 {
            s.allocator.share(b0);
            s.allocator.share(p);
        }
        let mut q = seq(1, 6, tok);
        q.child = c;
        q.num_computed = 5;
        q.blocks = vec![b0, p];
        children.push(q);
    }
    s.running = children;
    let plan = s.schedule();
    assert_eq!(plan.scheduled.len(), 3);
    // Two copies for three sharers: the last one keeps p.
    assert_eq!(plan.copies.len(), 2, "{:?}", plan.copies);
    assert!(plan.copies.iter().all(|&(src, _)| src == p));
    s.finish_copies(&plan.copies);
    assert_eq!(s.allocator.ref_count(p), 1);
    let holders = s.running.iter().filter(|q| q.blocks[1] == p).count();
    assert_eq!(holders, 1, "exactly one child still writes p");
}

#[test]
fn copy_on_write_source_stays_valid_until_copied_even_if_its_sharer_is_preempted() {
    let tok = tokenizer();
    let mut s = Scheduler::new(cfg(64), 5);
    // c0 and c1: 6 tokens, 5 computed, sharing full block b0 and partial block p.
    let b0 = s.allocator.allocate().unwrap();
    let p = s.allocator.allocate().unwrap();
    let mut c0 = seq(1, 6, tok);
    c0.num_computed = 5;
    c0.blocks = vec![b0, p];
    s.allocator.share(b0);
    s.allocator.share(p);
    let mut c1 = seq(1, 6, tok);
    c1.child = 1;
    c1.num_computed = 5;
    c1.blocks = vec![b0, p];
    // x: 9 tokens, 8 computed in two blocks, needs a third.
    let mut x = seq(2, 9, tok);
    x.num_computed = 8;
    x.blocks = s.allocator.allocate_n(2).unwrap();
    s.running = vec![c0, x, c1];
    let _ = s.allocator.take_poison_list();
    // c0 copies p into the last free block; x then preempts c1 (the newest).
    let plan = s.schedule();
    assert_eq!(plan.copies.len(), 1);
    assert_eq!(plan.copies[0].0, p);
    assert!(plan.preempted >= 1);
    assert!(
        !s.allocator.take_poison_list().contains(&p),
        "p is about to be copied: it must not be invalidated before the copy"
    );
    s.finish_copies(&plan.copies);
    assert_eq!(s.allocator.ref_count(p), 0);
}
