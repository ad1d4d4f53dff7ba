//! `PolicySlot`: install, rollback, and readers that never see a half-swapped policy.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::common::{load, names, node, request};
use pd_policy::{Installed, Measured, PolicyEngine, PolicyError, PolicySlot, Role, Route, View};

fn native(name: &str) -> Installed {
    Installed::Native {
        name: name.to_string(),
    }
}

#[test]
fn install_and_rollback() {
    let slot = PolicySlot::new(native("least-loaded"));
    assert_eq!(slot.current().name(), "least-loaded");
    assert_eq!(slot.current().version(), "native");
    assert_eq!(slot.current().sha256(), None);
    assert!(matches!(
        slot.rollback(),
        Err(PolicyError::NothingToRollBack)
    ));

    let engine = PolicyEngine::new().expect("engine");
    let wasm = load(&engine, "round-robin");
    let sha = wasm.sha256().to_string();
    slot.install(Installed::Wasm(wasm));
    let current = slot.current_arc();
    assert_eq!(current.name(), "round-robin");
    assert_eq!(current.version(), sha[..12]);
    assert_eq!(current.sha256(), Some(sha.as_str()));
    assert!(current.loaded_at() >= std::time::UNIX_EPOCH);
    assert_eq!(
        slot.previous().map(|p| p.name().to_string()).as_deref(),
        Some("least-loaded")
    );

    slot.rollback().expect("rollback");
    assert_eq!(slot.current().name(), "least-loaded");
    // A second rollback undoes the first.
    slot.rollback().expect("roll forward");
    assert_eq!(slot.current().name(), "round-robin");
    // The Arc taken before the swaps still holds the whole policy.
    assert_eq!(current.name(), "round-robin");

    // An unknown native name fails at decide time, typed.
    slot.install(native("first-node"));
    let v = View {
        nodes: vec![node(Role::Standalone, 0, 0, 1)],
    };
    let e = slot
        .current()
        .decide(&request(0, 1, vec![]), &v, &Measured::default(), &names(&v))
        .expect_err("unknown");
    assert!(matches!(e, PolicyError::UnknownNative { .. }), "{e:?}");
}

#[test]
fn readers_see_whole_policies_while_swapping() {
    let engine = PolicyEngine::new().expect("engine");
    // Two policies that answer differently on this view: least-loaded puts idle node 1
    // first, round-robin (seq 0) keeps index order.
    let v = View {
        nodes: vec![
            node(Role::Standalone, 5, 0, 1),
            node(Role::Standalone, 0, 0, 1),
        ],
    };
    let want = |name: &str| match name {
        "least-loaded" => Route::Whole(vec![1, 0]),
        "round-robin" => Route::Whole(vec![0, 1]),
        other => panic!("unexpected policy {other}"),
    };
    let slot = PolicySlot::new(Installed::Wasm(load(&engine, "least-loaded")));
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        for _ in 0..3 {
            s.spawn(|| {
                let mut calls = 0u32;
                while !done.load(Ordering::Relaxed) || calls < 50 {
                    let policy = slot.current();
                    let d = policy
                        .decide(&request(0, 1, vec![]), &v, &Measured::default(), &names(&v))
                        .expect("decide");
                    // Name, sha and behaviour all come from the same policy.
                    assert_eq!(d.route, want(policy.name()));
                    assert_eq!(
                        policy.sha256().is_some(),
                        matches!(**policy, Installed::Wasm(_))
                    );
                    calls += 1;
                }
            });
        }
        for i in 0..100 {
            if i % 2 == 0 {
                slot.install(Installed::Wasm(load(&engine, "round-robin")));
            } else if i % 4 == 1 {
                slot.rollback().expect("rollback");
            } else {
                slot.install(native("least-loaded"));
            }
        }
        done.store(true, Ordering::Relaxed);
    });
}
