//! Warm instances: a component that declares itself stateless (`pd_policy::declare_stateless`)
//! is called in an instance reused across calls, and still decides as a fresh store would
//! (the same answers, the same host inputs), never runs two calls in one store, and never
//! reuses an instance whose call failed.

use std::sync::Arc;
use std::time::Duration;

use crate::common::{Rng, names, random_case, request, spec, wasm};
use pd_policy::{
    CallStats, Measured, PolicyEngine, PolicyError, PolicySpec, Role, Route, View, WasmPolicy,
    declare_stateless,
};

/// Guest `name` declared stateless, loaded under `spec`.
fn warm(engine: &PolicyEngine, name: &str, spec: PolicySpec) -> WasmPolicy {
    engine
        .load(&declare_stateless(&wasm(name)), spec)
        .expect("load")
}

/// A three-node view every test guest answers.
fn small_view() -> View {
    View {
        nodes: (0..3)
            .map(|i| crate::common::node(Role::Standalone, i, 0, 100))
            .collect(),
    }
}

fn call(policy: &WasmPolicy, n: u32) -> (Result<pd_policy::Decision, PolicyError>, CallStats) {
    let v = small_view();
    policy.decide_with_stats(&request(1, n, vec![]), &v, &Measured::default(), &names(&v))
}

/// Round-robin picks by `request.seq`: a reused instance answers every request as a fresh
/// store does, and least-loaded does on random views; only the declared build reuses.
#[test]
fn a_reused_instance_decides_as_a_fresh_store() {
    let engine = PolicyEngine::new().expect("engine");
    for guest in ["round-robin", "least-loaded", "prefix-aware"] {
        let fresh = engine.load(&wasm(guest), spec(guest)).expect("load");
        let reused = warm(&engine, guest, spec(guest));
        assert!(!fresh.reuses_instances() && reused.reuses_instances());
        let mut rng = Rng::new(11);
        for case in 0..60 {
            let (r, v) = random_case(&mut rng, case);
            let nm = names(&v);
            let (a, sa) = fresh.decide_with_stats(&r, &v, &Measured::default(), &nm);
            let (b, sb) = reused.decide_with_stats(&r, &v, &Measured::default(), &nm);
            assert_eq!(a.expect("fresh"), b.expect("reused"), "{guest} case {case}");
            assert!(!sa.warm, "{guest}: a fresh store is never warm");
            // The smoke test left the reused policy a warm instance.
            assert!(sb.warm, "{guest} case {case}: {sb:?}");
            assert!(
                sb.fuel_used < sa.fuel_used,
                "{guest}: a warm call pays no instantiation: {sb:?} vs {sa:?}"
            );
        }
    }
}

/// `echo` reports every host input it read (names, config, the clock running forward, every
/// field and list): asked again and again in one warm instance, it reports what a fresh
/// store reports, so a record's replay reads what the live call read.
#[test]
fn a_reused_instance_reads_the_host_inputs_of_a_fresh_store() {
    let engine = PolicyEngine::new().expect("engine");
    let fresh = engine.load(&wasm("echo"), spec("echo")).expect("load");
    let reused = warm(&engine, "echo", spec("echo"));
    let v = small_view();
    for seq in 0..20 {
        let r = request(seq, 1 + (seq % 3) as u32, vec![1, 0, 2]);
        let time_ms = 1_763_880_000_000 + seq;
        let a = fresh.decide_at(&r, &v, &Measured::default(), &names(&v), time_ms);
        let b = reused.decide_at(&r, &v, &Measured::default(), &names(&v), time_ms);
        assert_eq!(a.expect("fresh"), b.expect("reused"), "seq {seq}");
    }
}

/// A call that traps, runs out of fuel or hits its memory limit drops its instance: the next
/// call runs in a new one (not warm), and the policy goes on answering.
#[test]
fn an_instance_whose_call_failed_is_not_reused() {
    let engine = PolicyEngine::new().expect("engine");
    // Fuel stops `looping`; the others stop on their own (a trap, the memory limit).
    let limited = |name: &str| PolicySpec {
        spares: 0,
        fuel: if name == "looping" {
            2_000_000
        } else {
            1_000_000_000
        },
        memory_limit: 16 << 20,
        deadline: Duration::from_secs(60),
        ..spec(name)
    };
    for guest in ["trapping", "looping", "hungry"] {
        let policy = warm(&engine, guest, limited(guest));
        let (ok, stats) = call(&policy, 1);
        assert_eq!(ok.expect("valid").route, Route::Whole(vec![0, 1, 2]));
        assert!(stats.warm, "{guest}: the smoke test's instance is reused");
        assert_eq!(policy.spares_ready(), 1, "{guest}: kept warm");

        let (failed, _) = call(&policy, 7);
        match (guest, &failed) {
            ("trapping", Err(PolicyError::Trap { .. }))
            | ("looping", Err(PolicyError::OutOfFuel { .. }))
            | ("hungry", Err(PolicyError::MemoryLimit { .. })) => {}
            _ => panic!("{guest}: {failed:?}"),
        }
        assert_eq!(
            policy.spares_ready(),
            0,
            "{guest}: the failed instance is gone"
        );

        let (ok, stats) = call(&policy, 1);
        assert_eq!(ok.expect("recovers").route, Route::Whole(vec![0, 1, 2]));
        assert!(
            !stats.warm && !stats.spare,
            "{guest}: a new instance, made inline (spares 0): {stats:?}"
        );
        let (_, stats) = call(&policy, 1);
        assert!(stats.warm, "{guest}: and that one is kept warm");
    }
}

/// Concurrent calls never share a store: each takes a warm instance or makes one, and at most
/// `max(spares, 1)` stay warm.
#[test]
fn concurrent_calls_each_get_their_own_instance() {
    let engine = PolicyEngine::new().expect("engine");
    let policy = Arc::new(warm(
        &engine,
        "round-robin",
        PolicySpec {
            spares: 2,
            ..spec("round-robin")
        },
    ));
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let policy = policy.clone();
            std::thread::spawn(move || {
                let mut rng = Rng::new(100 + t);
                for case in 0..50 {
                    let (r, v) = random_case(&mut rng, case);
                    let got = policy.decide(&r, &v, &names(&v)).expect("decide");
                    assert_eq!(got, pd_policy::native::round_robin(&r, &v), "thread {t}");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("thread");
    }
    assert!(policy.spares_ready() <= 2, "{}", policy.spares_ready());
}

/// Fuel is per call for a warm instance too: the budget applies to each call whole, and a
/// call that exceeds it fails (and is dropped) while the next succeeds.
#[test]
fn each_warm_call_gets_the_whole_fuel_budget() {
    let engine = PolicyEngine::new().expect("engine");
    let policy = warm(&engine, "least-loaded", spec("least-loaded"));
    let v = small_view();
    let used: Vec<u64> = (0..5)
        .map(|seq| {
            let (d, s) = policy.decide_with_stats(
                &request(seq, 1, vec![]),
                &v,
                &Measured::default(),
                &names(&v),
            );
            d.expect("decide");
            assert!(s.warm);
            s.fuel_used
        })
        .collect();
    // The same work every call: nothing accumulates across calls.
    assert!(used.windows(2).all(|w| w[0] == w[1]), "{used:?}");
}

/// The Rust guests' allocator never frees (`policies/guest-rt`: a bump allocator), so a warm
/// instance of one grows every call. It is retired once past half its room, before any call
/// fails at the limit: every call answers, and some run in a new instance.
#[test]
fn a_leaking_guest_is_retired_before_it_hits_its_memory_limit() {
    let engine = PolicyEngine::new().expect("engine");
    let policy = warm(
        &engine,
        "least-loaded",
        PolicySpec {
            memory_limit: 4 << 20,
            spares: 1,
            ..spec("least-loaded")
        },
    );
    let mut rng = Rng::new(5);
    let (r, v) = random_case(&mut rng, 0);
    assert_eq!(v.nodes.len(), 64);
    let mut cold = 0;
    for seq in 0..3000 {
        let r = pd_policy::Request { seq, ..r.clone() };
        let (d, stats) = policy.decide_with_stats(&r, &v, &Measured::default(), &names(&v));
        d.unwrap_or_else(|e| panic!("call {seq}: {e:?}"));
        cold += usize::from(!stats.warm);
    }
    assert!(cold > 0, "the instance was never retired");
    assert!(cold < 300, "retired far too often: {cold} of 3000");
}
