//! What a policy gets beyond the contract: a locked-down, reproducible WASI (for guests that
//! import it, as Go guests do), a `now-ns` that replays, and the on-disk cache of compiled
//! components.

use std::os::unix::fs::PermissionsExt;

use crate::common::{load, names, node, request, spec, wasm};
use pd_policy::{
    CompiledFrom, Installed, Measured, PolicyEngine, PolicyError, Record, Role, Route, View,
};

fn view() -> View {
    View {
        nodes: vec![node(Role::Standalone, 0, 0, 10)],
    }
}

/// The probe's report for a request with `seq`, as `key=value` pairs.
fn probe(policy: &pd_policy::WasmPolicy, seq: u64) -> Vec<(String, String)> {
    let v = view();
    let d = policy
        .decide(&request(seq, 1, vec![]), &v, &names(&v))
        .expect("decide");
    let Route::Reject(r) = d.route else {
        panic!("the probe always rejects")
    };
    assert_eq!(r.status, 418);
    r.message
        .split(';')
        .map(|kv| {
            let (k, v) = kv.split_once('=').expect("key=value");
            (k.to_string(), v.to_string())
        })
        .collect()
}

fn get<'a>(report: &'a [(String, String)], key: &str) -> &'a str {
    &report.iter().find(|(k, _)| k == key).expect(key).1
}

#[test]
fn wasi_is_locked_down_and_reproducible() {
    let engine = PolicyEngine::new().expect("engine");
    let probe_policy = load(&engine, "wasi-probe");
    let a = probe(&probe_policy, 7);
    // Frozen wall clock, no environment, no arguments, no file system.
    assert_eq!(get(&a, "wall"), "0", "{a:?}");
    assert_eq!(get(&a, "env"), "0", "{a:?}");
    assert_eq!(get(&a, "args"), "0", "{a:?}");
    assert_eq!(get(&a, "fs"), "err", "{a:?}");
    assert_eq!(get(&a, "file"), "err", "{a:?}");
    // The monotonic clock moves (a guest waiting for time ends) but the same calls see the
    // same times.
    assert_ne!(get(&a, "mono"), "0", "{a:?}");
    // Randomness is seeded by the request: the same request gives the same answer, another
    // request another one.
    assert_eq!(probe(&probe_policy, 7), a);
    let b = probe(&probe_policy, 8);
    assert_ne!(get(&b, "rand"), get(&a, "rand"), "{a:?} {b:?}");
    assert_eq!(get(&b, "mono"), get(&a, "mono"));
}

/// The host's `now-ns` is the time passed with the call, a decision record's `time-ms`: a
/// call logged as a record and replayed from it decides the same, and the echo guest, which
/// reads `now-ns` twice per call, sees a clock that does not run backwards. (That the guest
/// reads exactly the recorded time, live and in replay, is checked inside the crate, where the
/// host's answers can be seen: `engine/host.rs`.)
#[test]
fn a_logged_call_replays_at_its_recorded_time() {
    let engine = PolicyEngine::new().expect("engine");
    let v = View {
        nodes: vec![node(Role::Standalone, 0, 0, 10)],
    };
    let time_ms = 1_763_880_000_123;
    let installed = Installed::Wasm(load(&engine, "echo"));
    let live = installed
        .decide_at(
            &request(3, 1, vec![0]),
            &v,
            &Measured::default(),
            &names(&v),
            time_ms,
        )
        .expect("decide");
    let Route::Reject(r) = &live.route else {
        panic!("echo rejects: {live:?}")
    };
    assert!(r.message.contains(";clock=ok;"), "{}", r.message);

    let mut record = Record::new(request(3, 1, vec![0]), v.clone(), live.clone());
    record.time_ms = Some(time_ms);
    let line = serde_json::to_string(&record.to_json()).expect("json");
    let back = Record::from_json(&serde_json::from_str(&line).expect("parse")).expect("record");
    assert_eq!(back.time_ms, Some(time_ms));
    let replayed = installed
        .decide_at(
            &back.request,
            &back.view,
            &back.measured,
            &names(&back.view),
            back.time_ms.unwrap_or(0),
        )
        .expect("replay");
    assert_eq!(replayed, live);
}

/// A policy's instances are made ahead of its calls, off the request path, and a call served
/// by one sees exactly what a call that instantiates sees: the WASI probe's random bytes and
/// clock readings, the same fuel. A used spare is replaced; `spares: 0` makes none.
#[test]
fn spare_instances_decide_as_instances_made_on_the_call() {
    let engine = PolicyEngine::new().expect("engine");
    for guest in ["wasi-probe", "least-loaded", "prefix-aware"] {
        let ahead = load(&engine, guest);
        let inline = engine
            .load(
                &wasm(guest),
                pd_policy::PolicySpec {
                    spares: 0,
                    ..spec(guest)
                },
            )
            .expect("load");
        let v = View {
            nodes: vec![
                node(Role::Prefill, 1, 0, 10),
                node(Role::Decode, 0, 2, 10),
                node(Role::Standalone, 0, 0, 10),
            ],
        };
        for seq in [7, 8, 7, 123_456] {
            crate::common::spare_matches_inline(&ahead, &inline, &request(seq, 1, vec![]), &v);
        }
        // The used spares were replaced, up to the default count.
        let started = std::time::Instant::now();
        while ahead.spares_ready() < pd_policy::DEFAULT_SPARES {
            assert!(
                started.elapsed() < std::time::Duration::from_secs(20),
                "{guest}: spares not replaced"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(ahead.spares_ready(), pd_policy::DEFAULT_SPARES);
    }
    // More spares than the host keeps are refused at load.
    match engine.load(
        &wasm("least-loaded"),
        pd_policy::PolicySpec {
            spares: pd_policy::MAX_SPARES + 1,
            ..spec("least-loaded")
        },
    ) {
        Err(PolicyError::TooManySpares { requested, max }) => {
            assert_eq!(
                (requested, max),
                (pd_policy::MAX_SPARES + 1, pd_policy::MAX_SPARES)
            )
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn compiled_policies_are_cached_on_disk_in_a_private_directory() {
    let root = std::env::temp_dir().join(format!("pd-policy-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let dir = root.join("nested/cache");
    let bytes = wasm("least-loaded");

    // First engine: compiles and stores; the same bytes again come from memory.
    let engine = PolicyEngine::with_disk_cache(&dir).expect("engine");
    let mode = std::fs::metadata(&dir).expect("dir").permissions().mode() & 0o777;
    assert_eq!(mode, 0o700, "the cache directory is created private");
    let first = engine.load(&bytes, spec("a")).expect("load");
    assert_eq!(first.compiled().0, CompiledFrom::Compiled);
    assert_eq!(
        engine.load(&bytes, spec("b")).expect("load").compiled().0,
        CompiledFrom::Memory
    );
    let files: Vec<_> = std::fs::read_dir(&dir)
        .expect("read")
        .map(|e| e.expect("entry").file_name().into_string().expect("utf-8"))
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    assert!(
        files[0].starts_with(first.sha256()) && files[0].ends_with(".cwasm"),
        "{files:?}"
    );
    drop((first, engine));

    // A second engine (a restarted gateway) reads it back and decides the same.
    let engine = PolicyEngine::with_disk_cache(&dir).expect("engine");
    let again = engine.load(&bytes, spec("c")).expect("load");
    assert_eq!(again.compiled().0, CompiledFrom::Disk);
    let v = View {
        nodes: vec![
            node(Role::Standalone, 3, 0, 10),
            node(Role::Standalone, 0, 0, 10),
        ],
    };
    let d = again
        .decide(&request(0, 1, vec![]), &v, &names(&v))
        .expect("decide");
    assert_eq!(d.route, Route::Whole(vec![1, 0]));

    // A corrupt entry is compiled again and replaced, not trusted.
    let entry = dir.join(&files[0]);
    std::fs::write(&entry, b"not a compiled component").expect("corrupt");
    let engine = PolicyEngine::with_disk_cache(&dir).expect("engine");
    let fixed = engine.load(&bytes, spec("d")).expect("load");
    assert_eq!(fixed.compiled().0, CompiledFrom::Compiled);
    assert!(std::fs::metadata(&entry).expect("entry").len() > 1000);

    // A directory others can write to is refused.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    match PolicyEngine::with_disk_cache(&dir) {
        Err(PolicyError::CacheDir(e)) => {
            assert!(e.to_string().contains("not private"), "{e}")
        }
        other => panic!("a world-writable cache was accepted: {other:?}"),
    }
    let _ = std::fs::remove_dir_all(&root);
}
