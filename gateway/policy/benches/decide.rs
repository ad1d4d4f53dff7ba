//! Decision latency on a 64-node view: WASM guests against their native copies, and the
//! whole host path (build the view from registry state, decide, validate). Calls run with a
//! relaxed deadline so a descheduled call does not abort the run; limits cost the same.
//!
//! The guests are on `pd:policy@1.0.0` (the view as columns, roles as index lists).
//!
//! Run: `scripts/build-policies.sh && cargo bench -p pd-policy --bench decide`
//! (`PD_BENCH_CALLS=N` changes the number of timed calls, default 20000; `PD_BENCH_PACED=N`
//! the number of paced calls per variant, default 3000;
//! `PD_BENCH_ONLY=text` runs only the cases whose name contains `text`;
//! `PD_BENCH_ALT=FILE.wasm` adds another build of least-loaded to the "a spare ready" row,
//! called in turn with the shipped one, for an A/B on the same machine).

#[path = "../tests/common/mod.rs"]
mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use common::{names, request, spec, wasm};
use pd_policy::native;
use pd_policy::{Decision, Measured, Node, PolicyEngine, Rates, Request, Role, View, validate};

/// What a gateway registry holds per node, before it becomes a `View`.
struct Registered {
    role: Role,
    free_blocks: u32,
    waiting: u32,
    running: u32,
    draining: bool,
    prefill_tokens_per_s: u32,
    pull_mb_per_s: u32,
}

fn registry() -> Vec<Registered> {
    (0..64u32)
        .map(|i| Registered {
            role: [Role::Prefill, Role::Decode, Role::Decode, Role::Standalone][i as usize % 4],
            free_blocks: 1000 - (i * 37) % 500,
            waiting: (i * 7) % 5,
            running: (i * 3) % 4,
            draining: i % 17 == 5,
            prefill_tokens_per_s: [0, 2_400, 3_100][i as usize % 3],
            pull_mb_per_s: [0, 900][i as usize % 2],
        })
        .collect()
}

fn to_view(reg: &[Registered]) -> View {
    View {
        nodes: reg
            .iter()
            .map(|r| Node {
                role: r.role,
                free_blocks: r.free_blocks,
                total_blocks: 1024,
                leased_blocks: 0,
                waiting: r.waiting,
                running: r.running,
                waiting_remote_kv: 0,
                draining: r.draining,
                conversation_tokens: 0,
                conversation_expiry_ms: 0,
            })
            .collect(),
    }
}

fn to_measured(reg: &[Registered]) -> Measured {
    Measured {
        rates: reg
            .iter()
            .map(|r| Rates {
                prefill_tokens_per_s: r.prefill_tokens_per_s,
                pull_mb_per_s: r.pull_mb_per_s,
            })
            .collect(),
        kv_bytes_per_token: 23_040,
    }
}

fn req(seq: u64) -> Request {
    let mut r = request(seq, 2, (0..64).map(|i| (i * 5) % 9).collect());
    r.block_hashes = (0..32).collect();
    r
}

struct Row {
    name: String,
    p50: Duration,
    p99: Duration,
    mean: Duration,
}

/// A row of percentiles and the mean over `samples` (sorted here).
fn row(name: String, samples: &mut [Duration]) -> Row {
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
    Row {
        p50: at(0.5),
        p99: at(0.99),
        mean: samples.iter().sum::<Duration>() / samples.len() as u32,
        name,
    }
}

fn time(name: &str, calls: usize, mut f: impl FnMut(u64)) -> Option<Row> {
    if std::env::var("PD_BENCH_ONLY").is_ok_and(|only| !name.contains(&only)) {
        return None;
    }
    for i in 0..(calls / 10).max(100) {
        f(i as u64);
    }
    let mut samples = Vec::with_capacity(calls);
    let all = Instant::now();
    for i in 0..calls {
        let t = Instant::now();
        f(i as u64);
        samples.push(t.elapsed());
    }
    let mean = all.elapsed() / calls as u32;
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
    Some(Row {
        name: name.to_string(),
        p50: at(0.50),
        p99: at(0.99),
        mean,
    })
}

fn main() {
    let calls: usize = std::env::var("PD_BENCH_CALLS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_000);
    let engine = PolicyEngine::new().expect("engine");
    let reg = registry();
    let view = to_view(&reg);
    let measured = to_measured(&reg);
    let node_names = names(&view);
    let mut rows = Vec::new();

    type Native = fn(&Request, &View, &Measured) -> Decision;
    let natives: [(&str, Native); 3] = [
        ("least-loaded", |r, v, _| native::least_loaded(r, v)),
        ("round-robin", |r, v, _| native::round_robin(r, v)),
        ("prefix-aware", |r, v, measured| {
            native::NativePolicy::PrefixAware.decide_measured(r, v, measured)
        }),
    ];
    for (name, native) in natives {
        let policy = engine.load(&wasm(name), spec(name)).expect("load");
        let name = &format!("{name} ({})", policy.contract());
        let r = req(0);
        assert_eq!(
            policy
                .decide_measured(&r, &view, &measured, &node_names)
                .expect("decide"),
            native(&r, &view, &measured)
        );
        if name.starts_with("least-loaded") {
            // Fixed cost of a call: store, instantiation, a tiny view.
            let empty = View { nodes: vec![] };
            let r = request(0, 1, vec![]);
            let no_names: std::sync::Arc<[std::sync::Arc<str>]> = std::sync::Arc::from([]);
            let (_, stats) = policy.decide_with_stats(&r, &empty, &Measured::default(), &no_names);
            rows.extend(time(
                &format!("wasm   {name}, empty view (fuel {})", stats.fuel_used),
                calls,
                |_| {
                    black_box(
                        policy
                            .decide(black_box(&r), &empty, &no_names)
                            .expect("decide"),
                    );
                },
            ));
        }
        rows.extend(time(&format!("native {name}"), calls, |i| {
            let mut r = req(0);
            r.seq = i;
            black_box(native(black_box(&r), black_box(&view), &measured));
        }));
        rows.extend(time(
            &format!("wasm   {name} (decide+validate)"),
            calls,
            |i| {
                let mut r = req(0);
                r.seq = i;
                black_box(
                    policy
                        .decide_measured(black_box(&r), black_box(&view), &measured, &node_names)
                        .expect("decide"),
                );
            },
        ));
        if name.starts_with("least-loaded") {
            // The gateway calls a policy once per request, between which the nodes' work
            // evicts the caches: the same call, with 8 MiB of other memory written between calls.
            let label = format!("wasm   {name}, caches cold between calls");
            if std::env::var("PD_BENCH_ONLY").is_ok_and(|only| !label.contains(&only)) {
            } else {
                let mut other = vec![0u8; 8 << 20];
                let mut samples = Vec::new();
                for i in 0..2000u64 {
                    for b in other.iter_mut().step_by(64) {
                        *b = b.wrapping_add(1);
                    }
                    black_box(&other);
                    let t = Instant::now();
                    black_box(
                        policy
                            .decide_measured(&req(i), &view, &measured, &node_names)
                            .expect("decide"),
                    );
                    samples.push(t.elapsed());
                }
                rows.push(row(label, &mut samples));
            }
        }
        if !name.starts_with("round-robin") {
            rows.extend(time(&format!("host path, wasm   {name}"), calls, |i| {
                let view = to_view(black_box(&reg));
                let measured = to_measured(black_box(&reg));
                let r = req(i);
                black_box(
                    policy
                        .decide_measured(&r, &view, &measured, &node_names)
                        .expect("decide"),
                );
            }));
            rows.extend(time(&format!("host path, native {name}"), calls, |i| {
                let view = to_view(black_box(&reg));
                let measured = to_measured(black_box(&reg));
                let r = req(i);
                let d = native(&r, &view, &measured);
                validate(&d, &r, &view).expect("valid");
                black_box(d);
            }));
        }
    }
    // The request path alone, as the gateway runs it when a spare is ready: wait (untimed)
    // until the spare thread has made one, then time the host path. Caches stay warm, so this
    // is the call's own cost; the paced row below adds what idle gaps cost.
    let label = "host path, least-loaded, a spare ready";
    if std::env::var("PD_BENCH_ONLY").is_ok_and(|only| !label.contains(&only)) {
    } else {
        // The shipped build; `PD_BENCH_ALT=FILE.wasm` adds another build of the same rules,
        // called in turn (one call each) so that both see the same machine.
        let mut builds = vec![("least-loaded".to_owned(), wasm("least-loaded"))];
        if let Ok(alt) = std::env::var("PD_BENCH_ALT") {
            builds.push((alt.clone(), std::fs::read(&alt).expect("PD_BENCH_ALT")));
        }
        let policies: Vec<_> = builds
            .iter()
            .map(|(_, bytes)| engine.load(bytes, spec("least-loaded")).expect("load"))
            .collect();
        let mut samples = vec![Vec::with_capacity(calls); policies.len()];
        for i in 0..(calls + calls / 10) as u64 {
            for (policy, samples) in policies.iter().zip(&mut samples) {
                while policy.spares_ready() == 0 {
                    std::hint::spin_loop();
                }
                let t = Instant::now();
                let view = to_view(black_box(&reg));
                let measured = to_measured(black_box(&reg));
                let r = req(i);
                let (d, stats) = policy.decide_with_stats(&r, &view, &measured, &node_names);
                black_box(d.expect("decide"));
                let took = t.elapsed();
                assert!(stats.spare, "the call took a spare");
                if i as usize >= calls / 10 {
                    samples.push(took);
                }
            }
        }
        for (((name, _), policy), mut samples) in builds.iter().zip(&policies).zip(samples) {
            let contract = policy.contract();
            rows.push(row(format!("{label} ({contract}, {name})"), &mut samples));
        }
    }
    // Paced as the gateway calls: a request every ~1 ms (idle gaps the spare thread uses), a
    // policy with spares (the default: instances made ahead, used stores dropped off the path)
    // against the same policy with `spares: 0` (instantiate and drop on the path), one call
    // each in turn. Host path as above.
    let label = "host path, least-loaded, paced 1 ms";
    if std::env::var("PD_BENCH_ONLY").is_ok_and(|only| !label.contains(&only)) {
    } else {
        let paced: usize = std::env::var("PD_BENCH_PACED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(3000);
        let ahead = engine
            .load(&wasm("least-loaded"), spec("least-loaded"))
            .expect("load");
        let inline = engine
            .load(
                &wasm("least-loaded"),
                pd_policy::PolicySpec {
                    spares: 0,
                    ..spec("least-loaded")
                },
            )
            .expect("load");
        let mut samples = [Vec::with_capacity(paced), Vec::with_capacity(paced)];
        let mut from_spare = 0;
        for i in 0..paced as u64 {
            for (k, p) in [&ahead, &inline].into_iter().enumerate() {
                std::thread::sleep(Duration::from_millis(1));
                let t = Instant::now();
                let view = to_view(black_box(&reg));
                let measured = to_measured(black_box(&reg));
                let r = req(i);
                let (d, stats) = p.decide_with_stats(&r, &view, &measured, &node_names);
                black_box(d.expect("decide"));
                samples[k].push(t.elapsed());
                from_spare += usize::from(k == 0 && stats.spare);
            }
        }
        for (k, what) in [
            format!("spares 2, {from_spare}/{paced} from a spare"),
            "spares 0".to_string(),
        ]
        .into_iter()
        .enumerate()
        {
            rows.push(row(format!("{label} ({what})"), &mut samples[k]));
        }
    }
    // Fuel per call (about one unit per wasm instruction, instantiation included): what the
    // guest's own code costs, apart from the host path.
    let mut fuel = Vec::new();
    for name in ["round-robin", "least-loaded", "prefix-aware"] {
        let (_, stats) = engine
            .load(&wasm(name), spec(name))
            .expect("load")
            .decide_with_stats(&req(0), &view, &measured, &node_names);
        fuel.push((name.to_owned(), stats.fuel_used));
    }
    if let Ok(alt) = std::env::var("PD_BENCH_ALT") {
        let bytes = std::fs::read(&alt).expect("PD_BENCH_ALT");
        let (_, stats) = engine
            .load(&bytes, spec("least-loaded"))
            .expect("load")
            .decide_with_stats(&req(0), &view, &measured, &node_names);
        fuel.push((alt, stats.fuel_used));
    }
    println!("\n64-node view, {calls} timed calls each (one thread)\n");
    println!("{:<64} {:>10} {:>10} {:>10}", "case", "p50", "p99", "mean");
    for r in &rows {
        println!(
            "{:<64} {:>8.2}µs {:>8.2}µs {:>8.2}µs",
            r.name,
            r.p50.as_secs_f64() * 1e6,
            r.p99.as_secs_f64() * 1e6,
            r.mean.as_secs_f64() * 1e6
        );
    }
    println!("\nguest fuel per 64-node call (instantiation included):");
    for (name, used) in &fuel {
        println!("  {name:<60} {used:>8}");
    }
}
