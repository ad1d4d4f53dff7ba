//! Policies in every language, in one run: component size, compile time, and decision latency
//! (the whole host call: fresh instance, lowering the view, the guest, validation) on a
//! 64-node view, with the native policy as the reference.
//!
//! Run: `scripts/build-policies.sh && cargo bench -p pd-policy --bench languages`
//! (`PD_BENCH_CALLS=N` timed calls per build, default 2000). Compile time is measured without
//! the on-disk cache (a fresh engine compiles each build once).

#[path = "../tests/common/mod.rs"]
mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use common::{Rng, names, policies_dir, request};
use pd_policy::native;
use pd_policy::{Decision, Node, PolicyEngine, PolicySpec, Request, Role, View};

type Native = fn(&Request, &View) -> Decision;
type Decide = Box<dyn Fn(&Request) -> Decision>;

const BUILDS: [(&str, &str, Native); 9] = [
    ("rust", "least-loaded", native::least_loaded),
    ("c", "least-loaded", native::least_loaded),
    ("go", "least-loaded", native::least_loaded),
    ("js", "least-loaded", native::least_loaded),
    ("python", "least-loaded", native::least_loaded),
    ("rust", "prefix-aware", native::prefix_aware),
    ("js", "prefix-aware", native::prefix_aware),
    ("python", "prefix-aware", native::prefix_aware),
    ("native", "least-loaded", native::least_loaded),
];

/// A 64-node view of mixed roles and loads, some draining.
fn view() -> View {
    let mut rng = Rng::new(64);
    View {
        nodes: (0..64u32)
            .map(|i| Node {
                role: [Role::Prefill, Role::Decode, Role::Decode, Role::Standalone][i as usize % 4],
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

fn main() {
    let calls: usize = std::env::var("PD_BENCH_CALLS")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(2000);
    let v = view();
    let names = names(&v);
    let mut rng = Rng::new(7);
    let prefix: Vec<u32> = (0..64).map(|_| rng.below(12) as u32).collect();
    let spec = PolicySpec {
        deadline: Duration::from_secs(1),
        memory_limit: 64 << 20,
        fuel: 10_000_000_000,
        ..PolicySpec::default()
    };
    println!(
        "{:<22} {:>12} {:>12} {:>12} {:>12} {:>12}",
        "build (64 nodes)", "size", "compile", "fuel", "p50", "p99"
    );
    for (lang, policy, reference) in BUILDS {
        let engine = PolicyEngine::new().expect("engine");
        let (size, compile, fuel, decide): (String, String, String, Decide) = if lang == "native" {
            let v = v.clone();
            let decide = Box::new(move |r: &Request| reference(r, &v));
            ("-".into(), "-".into(), "-".into(), decide)
        } else {
            let path = match lang {
                "rust" => policies_dir().join(format!("{policy}.wasm")),
                _ => policies_dir().join(lang).join(format!("{policy}.wasm")),
            };
            let bytes = std::fs::read(&path).unwrap_or_else(|e| {
                panic!("{}: {e}: run scripts/build-policies.sh", path.display())
            });
            let started = Instant::now();
            let p = engine
                .load(
                    &bytes,
                    PolicySpec {
                        name: format!("{lang}/{policy}"),
                        ..spec.clone()
                    },
                )
                .unwrap_or_else(|e| panic!("{lang}/{policy}: {e:?}"));
            let compile = started.elapsed();
            // Fuel of one call, instantiation included: about one unit per wasm instruction.
            let (_, stats) = p.decide_with_stats(
                &request(0, 1, prefix.clone()),
                &v,
                &Default::default(),
                &names,
            );
            let (v, names) = (v.clone(), names.clone());
            (
                format!("{:.1} KiB", bytes.len() as f64 / 1024.0),
                format!("{:.0} ms", compile.as_secs_f64() * 1e3),
                format!("{}", stats.fuel_used),
                Box::new(move |r| p.decide(r, &v, &names).expect("decide")),
            )
        };
        let r = request(1, 1, prefix.clone());
        // Same answer as the native copy, then warm-up.
        assert_eq!(decide(&r), reference(&r, &view()), "{lang}/{policy}");
        for _ in 0..calls / 10 {
            black_box(decide(&r));
        }
        let mut times = Vec::with_capacity(calls);
        for i in 0..calls {
            let r = request(i as u64, 1, prefix.clone());
            let t = Instant::now();
            black_box(decide(&r));
            times.push(t.elapsed());
        }
        times.sort_unstable();
        println!(
            "{:<22} {:>12} {:>12} {:>12} {:>9.1} µs {:>9.1} µs",
            format!("{lang}/{policy}"),
            size,
            compile,
            fuel,
            pct(&times, 0.5),
            pct(&times, 0.99)
        );
    }
}
