//! Policies in every language, in one run: component size, compile time, and decision latency
//! (the whole host call: an instance, lowering the view, the guest, validation) at several view
//! sizes, with the native policy as the reference.
//!
//! Each WASM build runs two ways: `fresh` (a fresh store per call, a spare made ahead when one
//! is ready: how every policy ran before 2026-12-02 and how an undeclared one runs) and `warm`
//! (the same bytes declared stateless, `pd_policy::declare_stateless`: a warm instance reused
//! across calls). The `host-side` rows time the host's own part without any guest: the
//! request and the view converted into the contract's columns, and the decision validated.
//!
//! Run: `scripts/build-policies.sh && cargo bench -p pd-policy --bench languages`.
//! - `PD_BENCH_CALLS=N`: timed calls per row (default 2000);
//! - `PD_BENCH_NODES=16,64,256,1024,4096`: view sizes (default 64);
//! - `PD_BENCH_BUILDS=python/least-loaded,js`: only builds whose `lang/policy` starts with one
//!   of these (`native`, `host-side` included);
//! - `PD_BENCH_MODES=fresh,warm`: which ways to run the WASM builds (default both);
//! - `PD_BENCH_CACHED=1`: compile the fresh builds through the on-disk cache too (for
//!   profiles of the calls alone: `perf record` then sees no compiler).
//!
//! Compile time is measured without the on-disk cache (a fresh engine compiles each build
//! once); the warm build (other bytes, so another sha256) is compiled through the gateway's
//! on-disk cache so that reruns do not compile it again. `faults` is the minor page faults of
//! the calling thread per call (copy-on-write first touches of a fresh instance's memory).

#[path = "../tests/common/mod.rs"]
mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use common::{Rng, compile_cache, names, policies_dir, request};
use pd_policy::native;
use pd_policy::{
    Decision, Measured, Node, PolicyEngine, PolicySpec, Request, Role, View, WasmPolicy,
};

type Native = fn(&Request, &View) -> Decision;

const BUILDS: [(&str, &str, Native); 10] = [
    ("native", "least-loaded", native::least_loaded),
    ("host-side", "least-loaded", native::least_loaded),
    ("rust", "least-loaded", native::least_loaded),
    ("c", "least-loaded", native::least_loaded),
    ("go", "least-loaded", native::least_loaded),
    ("js", "least-loaded", native::least_loaded),
    ("python", "least-loaded", native::least_loaded),
    ("rust", "prefix-aware", native::prefix_aware),
    ("js", "prefix-aware", native::prefix_aware),
    ("python", "prefix-aware", native::prefix_aware),
];

/// An `n`-node view of mixed roles and loads, some draining.
fn view(n: usize) -> View {
    let mut rng = Rng::new(64);
    View {
        nodes: (0..n)
            .map(|i| Node {
                role: [Role::Prefill, Role::Decode, Role::Decode, Role::Standalone][i % 4],
                free_blocks: rng.below(1024) as u32,
                total_blocks: 1024,
                leased_blocks: rng.below(16) as u32,
                waiting: rng.below(5) as u32,
                running: rng.below(4) as u32,
                waiting_remote_kv: rng.below(2) as u32,
                draining: i % 17 == 5,
                conversation_tokens: 0,
                conversation_expiry_ms: 0,
            })
            .collect(),
    }
}

fn pct(sorted: &[Duration], q: f64) -> f64 {
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

/// Minor page faults of the calling thread so far.
fn minor_faults() -> i64 {
    // SAFETY: `getrusage` writes only the `rusage` it is given.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) };
    usage.ru_minflt
}

fn env_list(key: &str) -> Option<Vec<String>> {
    std::env::var(key)
        .ok()
        .map(|v| v.split(',').map(|s| s.trim().to_string()).collect())
}

/// One row's numbers: `decide` timed over `calls` calls (after `calls / 10` to warm up).
struct Timed {
    p50: f64,
    p99: f64,
    faults: f64,
}

fn time<T>(calls: usize, prefix: &[u32], mut decide: impl FnMut(&Request) -> T) -> Timed {
    for i in 0..calls / 10 {
        black_box(decide(&request(i as u64, 1, prefix.to_vec())));
    }
    let requests: Vec<Request> = (0..calls)
        .map(|i| request(i as u64, 1, prefix.to_vec()))
        .collect();
    let mut times = Vec::with_capacity(calls);
    let faults = minor_faults();
    for r in &requests {
        let t = Instant::now();
        black_box(decide(r));
        times.push(t.elapsed());
    }
    let faults = (minor_faults() - faults) as f64 / calls as f64;
    times.sort_unstable();
    Timed {
        p50: pct(&times, 0.5),
        p99: pct(&times, 0.99),
        faults,
    }
}

fn row(build: &str, nodes: usize, cols: [&str; 3], t: &Timed) {
    let [size, compile, fuel] = cols;
    println!(
        "{build:<26} {nodes:>6} {size:>12} {compile:>10} {fuel:>12} {:>8.1} {:>10.1} µs {:>10.1} µs",
        t.faults, t.p50, t.p99
    );
}

fn main() {
    let calls: usize = std::env::var("PD_BENCH_CALLS")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(2000);
    let sizes: Vec<usize> = env_list("PD_BENCH_NODES")
        .map(|l| {
            l.iter()
                .map(|n| n.parse().expect("PD_BENCH_NODES"))
                .collect()
        })
        .unwrap_or_else(|| vec![64]);
    let only = env_list("PD_BENCH_BUILDS");
    let modes = env_list("PD_BENCH_MODES").unwrap_or_else(|| vec!["fresh".into(), "warm".into()]);
    let spec = PolicySpec {
        deadline: Duration::from_secs(1),
        memory_limit: 64 << 20,
        fuel: 10_000_000_000,
        ..PolicySpec::default()
    };
    let cached = PolicyEngine::with_disk_cache(&compile_cache()).expect("engine");
    println!(
        "{:<26} {:>6} {:>12} {:>10} {:>12} {:>8} {:>13} {:>13}",
        "build", "nodes", "size", "compile", "fuel", "faults", "p50", "p99"
    );
    for (lang, policy, reference) in BUILDS {
        let name = format!("{lang}/{policy}");
        if only
            .as_ref()
            .is_some_and(|o| !o.iter().any(|p| name.starts_with(p.as_str())))
        {
            continue;
        }
        if lang == "native" || lang == "host-side" {
            for &n in &sizes {
                let v = view(n);
                let prefix: Vec<u32> = (0..n as u64).map(|i| (i * 7 % 12) as u32).collect();
                let measured = Measured::default();
                let t = if lang == "native" {
                    time(calls, &prefix, |r| reference(r, &v))
                } else {
                    let d = reference(&request(0, 1, prefix.clone()), &v);
                    time(calls, &prefix, |r| {
                        pd_policy::bench_support::host_side(r, &v, &measured, &d)
                    })
                };
                row(&name, n, ["-", "-", "-"], &t);
            }
            continue;
        }
        let path = match lang {
            "rust" => policies_dir().join(format!("{policy}.wasm")),
            _ => policies_dir().join(lang).join(format!("{policy}.wasm")),
        };
        let bytes = std::fs::read(&path)
            .unwrap_or_else(|e| panic!("{}: {e}: run scripts/build-policies.sh", path.display()));
        let size = format!("{:.1} KiB", bytes.len() as f64 / 1024.0);
        for mode in &modes {
            // Go's runtime may call WASI (the clock) from its post-return once an instance has
            // served calls, which the component model forbids (`cannot leave component
            // instance`): a Go build must not be declared stateless.
            if lang == "go" && mode == "warm" {
                continue;
            }
            let named = PolicySpec {
                name: format!("{name} ({mode})"),
                ..spec.clone()
            };
            let started = Instant::now();
            let p: WasmPolicy = match mode.as_str() {
                "fresh" if std::env::var_os("PD_BENCH_CACHED").is_some() => {
                    cached.load(&bytes, named)
                }
                "fresh" => PolicyEngine::new().expect("engine").load(&bytes, named),
                "warm" => cached.load(&pd_policy::declare_stateless(&bytes), named),
                other => panic!("PD_BENCH_MODES: unknown mode {other}"),
            }
            .unwrap_or_else(|e| panic!("{name}: {e:?}"));
            let compile = match mode.as_str() {
                "fresh" => format!("{:.0} ms", started.elapsed().as_secs_f64() * 1e3),
                _ => "(cached)".to_string(),
            };
            assert_eq!(p.reuses_instances(), mode == "warm");
            for &n in &sizes {
                let v = view(n);
                let nm = names(&v);
                let prefix: Vec<u32> = (0..n as u64).map(|i| (i * 7 % 12) as u32).collect();
                // Fuel of one call: instantiation included when fresh, the call alone when warm.
                let r = request(1, 1, prefix.clone());
                let (d, stats) = p.decide_with_stats(&r, &v, &Measured::default(), &nm);
                assert_eq!(d.expect("decide"), reference(&r, &v), "{name} at {n} nodes");
                let t = time(calls, &prefix, |r| p.decide(r, &v, &nm).expect("decide"));
                let fuel = stats.fuel_used.to_string();
                row(&format!("{name} {mode}"), n, [&size, &compile, &fuel], &t);
            }
        }
    }
}
