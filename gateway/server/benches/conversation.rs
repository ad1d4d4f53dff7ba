//! The gateway's conversation state at a million turns, in process: the `/v1/responses` store
//! (memory per turn, lookup and history rebuild times, eviction at its byte bound) and the
//! conversation index of retained KV (memory, longest-prefix lookup, eviction at its cap).
//!
//! ```sh
//! BENCH_TURNS=1000000 cargo bench -p pd-gateway --bench conversation
//! ```
//!
//! A turn is what a short chat turn stores: one input message and one output message of
//! ~200 bytes each, and a ~0.6 KB response object; every third turn continues the one before
//! (`previous_response_id`), so histories are three turns deep. Memory is the process's
//! resident memory before and after (`/proc/self/status`), against what the store counts.

#[path = "common/mod.rs"]
mod common;

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use common::pct;
use pd_gateway::conversation::{Holding, Holdings, NewTurn, Owner, ResponseStore};
use pd_wire::kv::KvTransferParams;
use serde_json::json;

fn rss_self() -> f64 {
    common::rss_mib(std::process::id())
}

fn text(i: usize, len: usize) -> String {
    let mut s = format!("turn {i}: ");
    while s.len() < len {
        s.push_str("the quick brown fox jumps over the lazy dog ");
    }
    s.truncate(len);
    s
}

fn turn(i: usize, parent: Option<&str>) -> NewTurn<'_> {
    let id = format!("resp_{i:016x}");
    NewTurn {
        owner: Owner::of(None),
        parent,
        input: vec![json!({"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": text(i, 200)}]})],
        output: vec![
            json!({"type": "message", "id": format!("msg_{i:016x}"), "status": "completed",
            "role": "assistant", "content": [{"type": "output_text", "text": text(i + 1, 200),
            "annotations": []}]}),
        ],
        response: json!({"id": id, "object": "response", "created_at": 1_764_000_000 + i,
            "status": "completed", "model": "sim", "output": [], "usage": {"input_tokens": 60,
            "output_tokens": 50, "total_tokens": 110}, "temperature": 1.0, "top_p": 1.0,
            "tool_choice": "auto", "tools": [], "parallel_tool_calls": true, "store": true,
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "metadata": {},
            "previous_response_id": parent}),
        held: None,
    }
}

fn id(i: usize) -> String {
    format!("resp_{i:016x}")
}

fn parent_of(i: usize) -> Option<String> {
    (!i.is_multiple_of(3)).then(|| id(i - 1))
}

fn times<F: FnMut(usize)>(n: usize, mut f: F) -> Vec<f64> {
    let mut out = Vec::with_capacity(n);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let t = Instant::now();
        f(x as usize);
        out.push(t.elapsed().as_secs_f64() * 1e6);
    }
    out.sort_by(f64::total_cmp);
    out
}

fn holding(i: usize) -> Holding {
    let mut params = KvTransferParams::produce(1);
    params.remote_engine_id = Some(format!("sim-d-{}", i % 64));
    params.remote_block_ids = Some((0..8).collect());
    params.remote_num_tokens = Some(128);
    Holding {
        engine_id: Arc::from(format!("sim-d-{}", i % 64).as_str()),
        epoch: 1,
        tokens: 128,
        last_hash: hash(i, 7),
        expires: SystemTime::now() + Duration::from_secs(3600),
        params,
        prompt_key: Some((hash(i, 4), 80)),
    }
}

/// Block `b` of conversation `i`'s chain (distinct per conversation).
fn hash(i: usize, b: usize) -> u64 {
    xxhash(((i as u64) << 8) | b as u64)
}

fn xxhash(v: u64) -> u64 {
    let mut x = v.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Each structure is measured in a process of its own (this bench run again with
/// `BENCH_PART`): memory one structure freed would otherwise hide the next one's growth.
fn main() {
    let n: usize = std::env::var("BENCH_TURNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1_000_000);
    match std::env::var("BENCH_PART").as_deref() {
        Ok("index") => index(n),
        Ok("store") => store(n),
        Ok("bounded") => bounded(n),
        _ => {
            println!(
                "| structure | turns | build | memory (RSS) | counted | per turn | lookup p50 / p99 | note |"
            );
            println!("|---|---:|---:|---:|---:|---:|---:|---|");
            for part in ["index", "store", "bounded"] {
                let exe = std::env::current_exe().expect("this bench's path");
                let status = std::process::Command::new(exe)
                    .env("BENCH_PART", part)
                    .status()
                    .expect("the bench runs again");
                assert!(status.success(), "part {part} failed");
            }
        }
    }
}

fn index(n: usize) {
    // 1. The conversation index (first: memory freed by a dropped structure would hide the
    // next one's growth) (retained KV), a million holdings.
    let rss0 = rss_self();
    let index = Holdings::new(n);
    let t = Instant::now();
    for i in 0..n {
        index.insert(holding(i));
    }
    let build = t.elapsed();
    let rss = rss_self() - rss0;
    let now = SystemTime::now();
    let found = times(20_000, |x| {
        let i = x % n;
        // A next-turn prompt: the held chain, then new blocks.
        let hashes: Vec<u64> = (0..12).map(|b| hash(i, b)).collect();
        let (f, _) = index.longest(&hashes, now);
        assert!(f.is_some());
    });
    let miss = times(20_000, |x| {
        let hashes: Vec<u64> = (0..12).map(|b| hash(n + x % n, b)).collect();
        std::hint::black_box(index.longest(&hashes, now));
    });
    let t = Instant::now();
    let over = n / 10;
    let mut displaced = 0;
    for i in n..n + over {
        displaced += index.insert(holding(i)).len();
    }
    println!(
        "| conversation index | {n} | {:.1} s | {:.0} MiB | {} holdings | {:.2} KiB | hit {:.1} / {:.1} µs, miss {:.1} / {:.1} µs | {over} more at the cap: {displaced} evicted, {:.1} µs each |",
        build.as_secs_f64(),
        rss,
        index.len(),
        rss * 1024.0 / n as f64,
        pct(&found, 0.5),
        pct(&found, 0.99),
        pct(&miss, 0.5),
        pct(&miss, 0.99),
        t.elapsed().as_secs_f64() * 1e6 / over as f64,
    );
}

fn store(n: usize) {
    // 2. The responses store, unbounded enough to hold every turn.
    let rss0 = rss_self();
    let store = ResponseStore::new(usize::MAX / 2, Duration::from_secs(86_400));
    let t = Instant::now();
    for i in 0..n {
        let parent = parent_of(i);
        store
            .put(&id(i), turn(i, parent.as_deref()))
            .expect("stored");
    }
    let build = t.elapsed();
    let rss = rss_self() - rss0;
    let get = times(20_000, |x| {
        std::hint::black_box(store.response(&id(x % n), Owner::of(None)));
    });
    let hist = times(20_000, |x| {
        let i = (x % n) / 3 * 3 + 2;
        let h = store
            .history(&id(i.min(n - 1)), Owner::of(None))
            .expect("a history");
        std::hint::black_box(h);
    });
    println!(
        "| responses store | {n} | {:.1} s ({:.1} µs/turn) | {:.0} MiB | {:.0} MiB | {:.2} KiB RSS, {:.2} KiB counted | {:.1} / {:.1} µs | history of 3 turns: {:.1} / {:.1} µs |",
        build.as_secs_f64(),
        build.as_secs_f64() * 1e6 / n as f64,
        rss,
        store.bytes() as f64 / (1 << 20) as f64,
        rss * 1024.0 / n as f64,
        store.bytes() as f64 / 1024.0 / n as f64,
        pct(&get, 0.5),
        pct(&get, 0.99),
        pct(&hist, 0.5),
        pct(&hist, 0.99),
    );
}

fn bounded(n: usize) {
    // 3. The same turns into a store bounded at 256 MiB: eviction on the write path.
    let bound = 256usize << 20;
    let store = ResponseStore::new(bound, Duration::from_secs(86_400));
    let mut evicted = 0usize;
    let t = Instant::now();
    let mut put_us = Vec::with_capacity(n);
    for i in 0..n {
        let parent = parent_of(i);
        let t1 = Instant::now();
        evicted += store
            .put_evicting(&id(i), turn(i, parent.as_deref()))
            .expect("stored")
            .len();
        put_us.push(t1.elapsed().as_secs_f64() * 1e6);
    }
    let build = t.elapsed();
    let tail = put_us.split_off(n / 2);
    let mut tail = tail;
    tail.sort_by(f64::total_cmp);
    println!(
        "| responses store, bounded 256 MiB | {n} | {:.1} s | – | {:.0} MiB | – | put at the bound {:.1} / {:.1} µs | {evicted} evicted, oldest first |",
        build.as_secs_f64(),
        store.bytes() as f64 / (1 << 20) as f64,
        pct(&tail, 0.5),
        pct(&tail, 0.99),
    );
    drop(store);
}
