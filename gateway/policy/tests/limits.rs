//! Every limit, hit end to end by a real misbehaving guest, with the exact typed error.
//!
//! The test guests (`policies/testing/`) answer validly unless `request.n == 7`, or on every
//! call when their config has `mode=always`. So `load` (whose smoke test uses n=1 and n=3)
//! must refuse each of them with `mode=always`, and accept them otherwise; then a call with
//! `n == 7` must fail with the typed error, and the next call must work again.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::common::{load, names, node, request, spec, wasm};
use pd_policy::{
    Api, DEFAULT_FUEL, InvalidDecision, MAX_MEMORY_LIMIT, Measured, Node, PolicyEngine,
    PolicyError, PolicySpec, Rates, Request, Role, Route, Slot, View, WasmPolicy,
};
use wasmtime::Trap;

fn view() -> View {
    View {
        nodes: vec![
            node(Role::Prefill, 0, 0, 10),
            node(Role::Decode, 0, 0, 10),
            node(Role::Standalone, 1, 0, 10),
        ],
    }
}

fn always(mut spec: PolicySpec) -> PolicySpec {
    spec.config.insert("mode".to_string(), "always".to_string());
    spec
}

/// `load` must refuse the guest with `spec` in smoke-test step `step`; returns the inner error.
fn refused_at(engine: &PolicyEngine, guest: &str, spec: PolicySpec, step: &str) -> PolicyError {
    match engine.load(&wasm(guest), spec) {
        Ok(_) => panic!("{guest}: load accepted a guest whose smoke test must fail"),
        Err(PolicyError::SmokeTest { source, case, .. }) => {
            assert_eq!(case, step, "{guest}: failed at the wrong step: {source:?}");
            *source
        }
        Err(e) => panic!("{guest}: expected a smoke-test failure, got {e:?}"),
    }
}

/// `load` must refuse the guest with `spec` at its first smoke call.
fn refused(engine: &PolicyEngine, guest: &str, spec: PolicySpec) -> PolicyError {
    refused_at(engine, guest, spec, "n=1")
}

fn call(policy: &WasmPolicy, request: &Request) -> Result<pd_policy::Decision, PolicyError> {
    let v = view();
    policy.decide(request, &v, &names(&v))
}

/// After a failed call, the same policy serves the next one (a fresh store per call). A
/// policy with a 1 ms wall-clock deadline may time out on a machine busy with other tests (as
/// the load-time smoke test allows): up to two timeouts are retried, any other error fails.
fn recovers(policy: &WasmPolicy) {
    let mut timeouts = 0;
    let d = loop {
        match call(policy, &request(1, 1, vec![])) {
            Err(PolicyError::Timeout { .. }) if timeouts < 2 => timeouts += 1,
            other => break other.expect("the call after a failure works"),
        }
    };
    assert_eq!(d.route, Route::Whole(vec![0, 1, 2]));
}

#[test]
fn deadline_stops_a_loop() {
    let engine = PolicyEngine::new().expect("engine");
    // Fuel out of the way: only the epoch deadline can stop it.
    let deadline = Duration::from_millis(20);
    let timed = |s: PolicySpec| PolicySpec {
        fuel: u64::MAX,
        deadline,
        ..s
    };
    let started = Instant::now();
    let e = refused(&engine, "looping", always(timed(spec("looping"))));
    assert!(
        matches!(e, PolicyError::Timeout { deadline: d } if d == deadline),
        "{e:?}"
    );
    // Three tries (a timeout is retried twice at load).
    assert!(
        started.elapsed() >= 3 * deadline,
        "took {:?}",
        started.elapsed()
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
    assert_eq!(e.reason(), "timeout");

    let policy = engine
        .load(&wasm("looping"), timed(spec("looping")))
        .expect("load");
    let started = Instant::now();
    let e = call(&policy, &request(0, 7, vec![])).expect_err("n=7 loops");
    let took = started.elapsed();
    assert!(matches!(e, PolicyError::Timeout { .. }), "{e:?}");
    // The deadline plus at most one epoch tick, plus scheduling slack on a busy machine.
    assert!(
        took >= deadline && took < Duration::from_secs(2),
        "took {took:?}"
    );
    recovers(&policy);

    // The default deadline (1 ms) stops it too.
    let policy = engine
        .load(
            &wasm("looping"),
            PolicySpec {
                fuel: u64::MAX,
                ..PolicySpec::default()
            },
        )
        .expect("load");
    let e = call(&policy, &request(0, 7, vec![])).expect_err("n=7 loops");
    assert!(
        matches!(e, PolicyError::Timeout { deadline } if deadline == Duration::from_millis(1)),
        "{e:?}"
    );

    // After an idle spell the epoch ticker parks (it lingers 50 ms after the last call); the
    // next call wakes it, and its deadline still stops a loop.
    std::thread::sleep(Duration::from_millis(200));
    let e = call(&policy, &request(0, 7, vec![])).expect_err("n=7 loops");
    assert!(matches!(e, PolicyError::Timeout { .. }), "{e:?}");
    recovers(&policy);
}

/// Set before a call: the next SIGUSR1 on the calling thread sleeps [`WAIT`] in its handler.
static WAIT_ARMED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// How long the armed handler keeps the thread off its core.
const WAIT: Duration = Duration::from_millis(30);

extern "C" fn wait_for_a_core(_: libc::c_int) {
    if WAIT_ARMED.swap(false, std::sync::atomic::Ordering::SeqCst) {
        let ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: WAIT.as_nanos() as libc::c_long,
        };
        // SAFETY: nanosleep is async-signal-safe; `ts` outlives the call.
        unsafe { libc::nanosleep(&ts, std::ptr::null_mut()) };
    }
}

/// Runs `f` on this thread while another thread signals it every 200 µs; the first signal
/// after `f` starts keeps the thread off its core for [`WAIT`] (its handler sleeps), as a
/// loaded host's scheduler would. Returns `f`'s result and its wall time.
fn descheduled<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    static INSTALL: std::sync::Once = std::sync::Once::new();
    INSTALL.call_once(|| {
        // SAFETY: a plain handler for SIGUSR1, which nothing else in this process uses.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = wait_for_a_core as *const () as usize;
            libc::sigemptyset(&mut sa.sa_mask);
            assert_eq!(libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut()), 0);
        }
    });
    // SAFETY: reads the calling thread's id.
    let me = unsafe { libc::pthread_self() };
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let d = done.clone();
    let sender = std::thread::spawn(move || {
        while !d.load(std::sync::atomic::Ordering::SeqCst) {
            // SAFETY: `me` is the test thread, alive until it joins this one.
            unsafe { libc::pthread_kill(me, libc::SIGUSR1) };
            std::thread::sleep(Duration::from_micros(200));
        }
    });
    WAIT_ARMED.store(true, std::sync::atomic::Ordering::SeqCst);
    let started = Instant::now();
    let out = f();
    let took = started.elapsed();
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    sender.join().expect("the signalling thread");
    WAIT_ARMED.store(false, std::sync::atomic::Ordering::SeqCst);
    (out, took)
}

/// A call whose thread waits for a core past its wall-clock deadline is not a runaway: it answers
/// (within 10 deadlines), where it used to fail as a timeout, and the gateway's fallback then
/// decided without the policy (a multi-turn conversation lost its holder: 19.5 s TTFT in
/// docs/bench-log/multi-turn.md, run 21). A loop kept off its core the same way is still stopped.
#[test]
fn a_call_that_waits_for_a_core_is_not_a_runaway() {
    let engine = PolicyEngine::new().expect("engine");
    let deadline = Duration::from_millis(10);
    let policy = engine
        .load(
            &wasm("looping"),
            PolicySpec {
                fuel: u64::MAX,
                deadline,
                ..spec("looping")
            },
        )
        .expect("load");
    let spin = |rounds: u64| request(rounds, 8, vec![]);
    // Size the call to ~4 ms of computing here (under half the deadline), so the signal lands
    // while it runs even when the signalling thread waits for a core itself: rounds per ms from
    // the fastest of three undisturbed calls.
    let probe = 200_000;
    let fastest = (0..3)
        .map(|_| {
            let started = Instant::now();
            call(&policy, &spin(probe)).expect("an undisturbed call answers");
            started.elapsed()
        })
        .min()
        .expect("three probes");
    let per_ms = probe as f64 / fastest.as_secs_f64().max(1e-6) / 1e3;
    let rounds = (4.0 * per_ms) as u64;
    // Every call answers. A call the signal missed (the signalling thread itself late on a busy
    // machine) proves nothing, so it is tried again; one must have waited past the deadline.
    let mut waited = Vec::new();
    for _ in 0..10 {
        let (answer, took) = descheduled(|| call(&policy, &spin(rounds)));
        let d = answer.expect("a call that waited for a core answers");
        assert_eq!(d.route, Route::Whole(vec![0, 1, 2]));
        waited.push(took);
        if took > deadline {
            break;
        }
    }
    assert!(
        waited.iter().any(|&t| t > deadline),
        "no call waited past the {deadline:?} deadline ({waited:?}), so this proves nothing"
    );
    // A runaway kept off its core just as long still stops, at the latest at the cap.
    let (answer, took) = descheduled(|| call(&policy, &request(0, 7, vec![])));
    assert!(
        matches!(answer, Err(PolicyError::Timeout { .. })),
        "{answer:?}"
    );
    // (Its cap is 10 deadlines; the bound leaves room for a busy machine, as
    // `deadline_stops_a_loop` does.)
    assert!(took < Duration::from_secs(2), "took {took:?}");
}

#[test]
fn fuel_stops_a_loop() {
    let engine = PolicyEngine::new().expect("engine");
    // Deadline out of the way: only fuel can stop it.
    let slow = |s: PolicySpec| PolicySpec {
        deadline: Duration::from_secs(60),
        fuel: 200_000,
        ..s
    };
    let e = refused(&engine, "looping", always(slow(spec("looping"))));
    assert!(
        matches!(e, PolicyError::OutOfFuel { fuel: 200_000 }),
        "{e:?}"
    );
    assert_eq!(e.reason(), "out_of_fuel");

    let policy = engine
        .load(&wasm("looping"), slow(spec("looping")))
        .expect("load");
    let (result, stats) = policy.decide_with_stats(
        &request(0, 7, vec![]),
        &view(),
        &Measured::default(),
        &names(&view()),
    );
    assert!(
        matches!(result, Err(PolicyError::OutOfFuel { .. })),
        "{result:?}"
    );
    assert_eq!(stats.fuel_used, 200_000);
    recovers(&policy);
}

#[test]
fn memory_limit_stops_a_hoarder() {
    let engine = PolicyEngine::new().expect("engine");
    let limit = 4 << 20;
    // Fuel out of the way: only the memory limit can stop it.
    let small = |s: PolicySpec| PolicySpec {
        memory_limit: limit,
        fuel: u64::MAX,
        ..s
    };
    let e = refused(&engine, "hungry", always(small(spec("hungry"))));
    assert!(
        matches!(e, PolicyError::MemoryLimit { limit: l, desired } if l == limit && desired > limit),
        "{e:?}"
    );
    assert_eq!(e.reason(), "memory");

    let policy = engine
        .load(&wasm("hungry"), small(spec("hungry")))
        .expect("load");
    let e = call(&policy, &request(0, 7, vec![])).expect_err("n=7 hoards");
    assert!(matches!(e, PolicyError::MemoryLimit { .. }), "{e:?}");
    recovers(&policy);

    // A limit below the guest's initial memory: it cannot even instantiate.
    let e = refused_at(
        &engine,
        "least-loaded",
        PolicySpec {
            memory_limit: 64 << 10,
            ..spec("tiny")
        },
        "instantiate",
    );
    assert!(matches!(e, PolicyError::MemoryLimit { .. }), "{e:?}");

    // More than the host's pool holds: refused before compiling.
    let e = engine
        .load(
            &wasm("least-loaded"),
            PolicySpec {
                memory_limit: MAX_MEMORY_LIMIT + 1,
                ..spec("big")
            },
        )
        .expect_err("too large");
    assert!(
        matches!(e, PolicyError::MemoryLimitTooLarge { .. }),
        "{e:?}"
    );
}

#[test]
fn traps_are_contained() {
    let engine = PolicyEngine::new().expect("engine");
    let e = refused(&engine, "trapping", always(spec("trapping")));
    assert!(
        matches!(
            e,
            PolicyError::Trap {
                trap: Trap::UnreachableCodeReached,
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(e.reason(), "trap");

    let policy = load(&engine, "trapping");
    for _ in 0..3 {
        let e = call(&policy, &request(0, 7, vec![])).expect_err("n=7 traps");
        assert!(
            matches!(
                e,
                PolicyError::Trap {
                    trap: Trap::UnreachableCodeReached,
                    ..
                }
            ),
            "{e:?}"
        );
        recovers(&policy);
    }
}

#[test]
fn invalid_decisions_are_caught() {
    let engine = PolicyEngine::new().expect("engine");
    let e = refused(&engine, "lying", always(spec("lying")));
    // The smoke view has 5 nodes.
    assert!(
        matches!(
            e,
            PolicyError::Invalid(InvalidDecision::UnknownNode {
                slot: Slot::Whole,
                index: 999,
                nodes: 5
            })
        ),
        "{e:?}"
    );
    assert_eq!(e.reason(), "invalid_decision");

    let policy = load(&engine, "lying");
    let e = call(&policy, &request(0, 7, vec![])).expect_err("n=7 lies");
    assert!(
        matches!(
            e,
            PolicyError::Invalid(InvalidDecision::UnknownNode {
                index: 999,
                nodes: 3,
                ..
            })
        ),
        "{e:?}"
    );
    recovers(&policy);
}

#[test]
fn bad_bytes_do_not_compile() {
    let engine = PolicyEngine::new().expect("engine");
    let e = engine
        .load(b"not wasm at all", spec("junk"))
        .expect_err("junk");
    assert!(matches!(e, PolicyError::Compile { .. }), "{e:?}");
    assert_eq!(e.reason(), "compile");
    // A core module, not a component.
    let core = b"\0asm\x01\0\0\0";
    let e = engine.load(core, spec("core")).expect_err("core module");
    assert!(matches!(e, PolicyError::Compile { .. }), "{e:?}");
    // A valid component that exports no `decide`: it is not the contract's world, and the
    // refusal says so.
    let empty_component = b"\0asm\x0d\0\x01\0";
    let e = engine
        .load(empty_component, spec("empty"))
        .expect_err("no world");
    assert!(matches!(e, PolicyError::Instantiate { .. }), "{e:?}");
    let text = chain(&e);
    assert!(text.contains("pd:policy@1.0.0"), "{text}");
}

/// An error and its sources, one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// A node whose fields all differ (from `base`), so a field lowered at the wrong offset shows.
fn field_node(role: Role, base: u32, draining: bool, conversation_tokens: u32) -> Node {
    Node {
        role,
        free_blocks: base + 1,
        total_blocks: base + 2,
        leased_blocks: base + 3,
        waiting: base + 4,
        running: base + 5,
        waiting_remote_kv: base + 6,
        draining,
        conversation_tokens,
        conversation_expiry_ms: u32::MAX - base,
    }
}

#[test]
fn host_imports_and_every_field_reach_the_guest() {
    let engine = PolicyEngine::new().expect("engine");
    let mut config = BTreeMap::new();
    config.insert("greeting".to_string(), "hello".to_string());
    let policy = engine
        .load(
            &wasm("echo"),
            PolicySpec {
                config,
                ..spec("echo")
            },
        )
        .expect("echo answers 4xx rejections, which are valid");
    // Every field distinct, so a field lowered at the wrong offset shows.
    let field_node = |role, base: u32, draining| field_node(role, base, draining, base + 7);
    let v = View {
        nodes: vec![
            field_node(Role::Standalone, 10, true),
            field_node(Role::Prefill, 20, false),
            field_node(Role::Decode, 30, true),
        ],
    };
    let r = Request {
        seq: 12_345_678_901,
        api: Api::Responses,
        prompt_tokens: 321,
        block_size: 16,
        block_hashes: vec![1, u64::MAX],
        prefix_blocks: vec![3, 0, 2],
        n: 21,
        max_tokens: Some(99),
        stream: true,
        conversation_key: Some("conv-α".to_string()),
    };
    let d = policy.decide(&r, &v, &names(&v)).expect("decide");
    let Route::Reject(rejection) = d.route else {
        panic!("echo rejects: {d:?}")
    };
    assert_eq!(rejection.status, 421);
    let want = "name0=node-0;name_out=-;greeting=hello;clock=ok\
        ;request=12345678901,responses,321,16,[1, 18446744073709551615],[3, 0, 2],21,99,true,conv-α\
        ;prefill=[1];decode=[2];standalone=[0];free=[11, 21, 31];total=[12, 22, 32]\
        ;leased=[13, 23, 33];waiting=[14, 24, 34];running=[15, 25, 35];remote=[16, 26, 36]\
        ;draining=[0, 2];prefill_tps=[0, 0, 0];pull_mbps=[0, 0, 0]\
        ;conversation=2,37,4294967265;kv_bytes_per_token=0";
    assert_eq!(rejection.message, want);

    // Without config and without names; options unset.
    let policy = engine.load(&wasm("echo"), spec("echo")).expect("load");
    let empty = View { nodes: vec![] };
    let mut r = request(5, 1, vec![]);
    (r.max_tokens, r.conversation_key, r.api) = (None, None, Api::ChatCompletions);
    let d = policy
        .decide(&r, &empty, &std::sync::Arc::from([]))
        .expect("decide");
    let Route::Reject(rejection) = d.route else {
        panic!("echo rejects: {d:?}")
    };
    assert_eq!(
        rejection.message,
        "name0=-;name_out=-;greeting=-;clock=ok;request=5,chat,64,16,[1, 2, 3, 4],[],1,-,true,-\
         ;prefill=[];decode=[];standalone=[];free=[];total=[];leased=[];waiting=[];running=[]\
         ;remote=[];draining=[];prefill_tps=[];pull_mbps=[];conversation=-;kv_bytes_per_token=0"
    );
}

/// Rates of the first three nodes only (a node past them has not reported), and the model's
/// KV bytes per token: what the echo guests' tests hand the host.
fn first_three_measured() -> Measured {
    let rates = |prefill_tokens_per_s, pull_mb_per_s| Rates {
        prefill_tokens_per_s,
        pull_mb_per_s,
    };
    Measured {
        rates: vec![rates(1_111, 0), rates(2_222, 3_333), rates(0, u32::MAX)],
        kv_bytes_per_token: 23_040,
    }
}

/// Collects what a tracing subscriber writes.
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("lock").extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn guest_logs_reach_tracing_and_are_capped() {
    let engine = PolicyEngine::new().expect("engine");
    let v = view();
    let logs = |log_lines: u32| -> Vec<String> {
        let mut config = BTreeMap::new();
        config.insert("log_lines".to_string(), log_lines.to_string());
        let policy = engine
            .load(
                &wasm("echo"),
                PolicySpec {
                    config,
                    ..spec("echo")
                },
            )
            .expect("load");
        let out = Captured::default();
        let writer = out.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            policy
                .decide(&request(9, 1, vec![]), &v, &names(&v))
                .expect("decide");
        });
        let text = String::from_utf8(out.0.lock().expect("lock").clone()).expect("utf-8");
        text.lines()
            .filter(|l| l.contains("pd_policy::guest"))
            .map(str::to_string)
            .collect()
    };
    let lines = logs(4);
    assert_eq!(lines.len(), 4, "{lines:#?}");
    for (line, level) in lines.iter().zip(["DEBUG", "INFO", "WARN", "ERROR"]) {
        assert!(line.contains(level), "{line}");
        assert!(
            line.contains("echo: line") && line.contains("seq 9 nodes 3"),
            "{line}"
        );
        assert!(
            line.contains("policy=echo") && line.contains("version="),
            "{line}"
        );
    }
    // A chatty guest: 32 lines per call, the last one saying the rest were dropped.
    let lines = logs(100);
    assert_eq!(lines.len(), 32, "{lines:#?}");
    assert!(lines[31].contains("log limit reached"), "{}", lines[31]);
}

#[test]
fn fuel_budget_headroom() {
    // A 64-node prefix-aware decision must use under 10% of the default fuel.
    let engine = PolicyEngine::new().expect("engine");
    let nodes = (0..64u32)
        .map(|i| {
            let role = [Role::Prefill, Role::Decode, Role::Standalone][i as usize % 3];
            node(role, i % 5, i % 3, 1000 - i)
        })
        .collect();
    let v = View { nodes };
    let prefix: Vec<u32> = (0..64).map(|i| i % 7).collect();
    for name in ["prefix-aware", "least-loaded", "round-robin"] {
        let policy = load(&engine, name);
        let (result, stats) = policy.decide_with_stats(
            &request(3, 2, prefix.clone()),
            &v,
            &Measured::default(),
            &names(&v),
        );
        result.expect("decide");
        eprintln!(
            "{name}: 64-node decision used {} fuel of {DEFAULT_FUEL}",
            stats.fuel_used
        );
        assert!(
            stats.fuel_used > 0 && stats.fuel_used < DEFAULT_FUEL / 10,
            "{name}: {stats:?}"
        );
    }
}

#[test]
fn concurrent_calls_share_one_policy() {
    let engine = PolicyEngine::new().expect("engine");
    let policy = load(&engine, "trapping");
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let policy = &policy;
            s.spawn(move || {
                for i in 0..200 {
                    // Every third call traps; the others must be unaffected.
                    let n = if (i + t) % 3 == 0 { 7 } else { 1 };
                    let r = call(policy, &request(i, n, vec![]));
                    if n == 7 {
                        assert!(matches!(r, Err(PolicyError::Trap { .. })), "{r:?}");
                    } else {
                        assert_eq!(r.expect("decide").route, Route::Whole(vec![0, 1, 2]));
                    }
                }
            });
        }
    });
}

#[test]
fn same_bytes_share_a_compiled_component() {
    let engine = PolicyEngine::new().expect("engine");
    let bytes = wasm("least-loaded");
    let started = Instant::now();
    let a = engine.load(&bytes, spec("a")).expect("load");
    let first = started.elapsed();
    let started = Instant::now();
    let b = engine.load(&bytes, spec("b")).expect("load");
    let second = started.elapsed();
    assert_eq!(a.sha256(), b.sha256());
    assert_eq!(a.sha256().len(), 64);
    // The second load skips compilation.
    assert!(second < first, "first {first:?}, cached {second:?}");
}

#[test]
fn every_list_and_rate_reaches_the_guest_at_its_node_index() {
    let engine = PolicyEngine::new().expect("engine");
    let policy = engine.load(&wasm("echo"), spec("echo")).expect("load");
    assert_eq!(policy.contract(), "1.0.0");
    let v = View {
        nodes: vec![
            field_node(Role::Standalone, 10, true, 0),
            field_node(Role::Prefill, 20, false, 0),
            field_node(Role::Decode, 30, true, 480),
            field_node(Role::Decode, 40, false, 0),
            field_node(Role::Prefill, 50, false, 0),
        ],
    };
    // Nodes 3 and 4 have not reported (a shorter rates list than the view).
    let d = policy
        .decide_measured(
            &request(77, 3, vec![5, 0, 9]),
            &v,
            &first_three_measured(),
            &names(&v),
        )
        .expect("decide");
    let Route::Reject(rejection) = d.route else {
        panic!("echo rejects: {d:?}")
    };
    assert_eq!(rejection.status, 403);
    let (_, lists) = rejection
        .message
        .split_once(";prefill=")
        .expect("the view's lists");
    let want = "[1, 4];decode=[2, 3];standalone=[0]\
        ;free=[11, 21, 31, 41, 51];total=[12, 22, 32, 42, 52];leased=[13, 23, 33, 43, 53]\
        ;waiting=[14, 24, 34, 44, 54];running=[15, 25, 35, 45, 55];remote=[16, 26, 36, 46, 56]\
        ;draining=[0, 2];prefill_tps=[1111, 2222, 0, 0, 0];pull_mbps=[0, 3333, 4294967295, 0, 0]\
        ;conversation=2,480,4294967265;kv_bytes_per_token=23040";
    assert_eq!(lists, want);
}

#[test]
fn a_split_with_children_and_decode_of_different_lengths_is_invalid() {
    let engine = PolicyEngine::new().expect("engine");
    let mut mismatched = spec("echo");
    mismatched
        .config
        .insert("answer".into(), "mismatched-split".into());
    // The smoke test's first split already answers two decode entries with one child count.
    match engine.load(&wasm("echo"), mismatched) {
        Err(PolicyError::SmokeTest { source, .. }) => assert!(
            matches!(
                *source,
                PolicyError::Invalid(InvalidDecision::ChildrenLength {
                    decode: 2,
                    children: 1
                })
            ),
            "{source:?}"
        ),
        other => panic!("a mismatched split must be refused at load: {other:?}"),
    }
}
