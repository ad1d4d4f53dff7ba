//! The embedded store against a real redb file: what is written is read back after a reopen,
//! the sweep's bounds, and the schema version check.

use std::collections::BTreeMap;

use serde_json::json;

use super::*;
use crate::state::PolicyEntry;

fn turn(parent: Option<&str>, at: u64) -> TurnRecord {
    TurnRecord {
        owner: Some("ab".repeat(32)),
        parent: parent.map(str::to_owned),
        items: vec![
            json!({"role": "user", "content": "hi"}),
            json!({"type": "message"}),
        ],
        inputs: 1,
        response: json!({"id": "resp_1", "object": "response"}),
        held: Some(7),
        stored_unix_ms: at,
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn what_is_written_is_read_back_after_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    rt().block_on(async {
        let s = Embedded::open(dir.path()).unwrap();
        s.put_turn("resp_1", &turn(None, 10)).await.unwrap();
        s.put_turn("resp_2", &turn(Some("resp_1"), 20))
            .await
            .unwrap();
        let record = PolicyRecord {
            generation: 3,
            current: PolicyEntry::Wasm {
                sha256: "00ff".into(),
                name: "p".into(),
                config: BTreeMap::from([("k".into(), "v".into())]),
                deadline_us: 1000,
                memory_limit: 1 << 20,
                fuel: 5,
                spares: 1,
            },
            previous: Some(PolicyEntry::Native {
                name: "least-loaded".into(),
            }),
            saved_unix_ms: 1,
            file_sha256: None,
        };
        // The store assigns generations: 1, then 2.
        let first = s
            .put_policy(&record, &[("00ff".into(), b"wasm".to_vec())])
            .await
            .unwrap();
        let second = s.put_policy(&record, &[]).await.unwrap();
        assert_eq!((first, second), (1, 2));
        // A component no record names is not kept.
        let native = PolicyRecord {
            current: PolicyEntry::Native {
                name: "round-robin".into(),
            },
            previous: None,
            ..record.clone()
        };
        s.put_policy(&native, &[("11ee".into(), b"orphan".to_vec())])
            .await
            .unwrap();
        assert_eq!(s.component("11ee").await.unwrap(), None);
        assert_eq!(s.component("00ff").await.unwrap(), None, "no longer named");
        let again = s
            .put_policy(&record, &[("00ff".into(), b"wasm".to_vec())])
            .await
            .unwrap();
        assert_eq!(again, 4);
        let record = PolicyRecord {
            generation: 4,
            ..record
        };
        s.set_drain("node-a", true).await.unwrap();
        s.set_drain("node-b", true).await.unwrap();
        s.set_drain("node-b", false).await.unwrap();
        assert_eq!(s.cluster_token("first").await.unwrap(), "first");
        drop(s);

        let s = Embedded::open(dir.path()).unwrap();
        assert_eq!(
            s.turn("resp_2").await.unwrap(),
            Some(turn(Some("resp_1"), 20))
        );
        assert_eq!(s.policy().await.unwrap(), Some(record));
        assert_eq!(
            s.component("00ff").await.unwrap().as_deref(),
            Some(&b"wasm"[..])
        );
        assert_eq!(s.drains().await.unwrap(), vec!["node-a".to_string()]);
        // The minted token stays the first one.
        assert_eq!(s.cluster_token("second").await.unwrap(), "first");
        s.delete_turns(&["resp_1".into(), "nope".into()])
            .await
            .unwrap();
        assert_eq!(s.turn("resp_1").await.unwrap(), None);
    });
    let mode = std::fs::metadata(dir.path().join(FILE_NAME)).unwrap();
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(mode.permissions().mode() & 0o777, 0o600);
}

#[test]
fn the_sweep_drops_expired_turns_then_the_oldest_past_the_bytes() {
    let dir = tempfile::tempdir().unwrap();
    rt().block_on(async {
        let s = Embedded::open(dir.path()).unwrap();
        for (i, at) in [5u64, 10, 20, 30].iter().enumerate() {
            s.put_turn(&format!("r{i}"), &turn(None, *at))
                .await
                .unwrap();
        }
        // Replacing a turn does not leave its old time behind.
        s.put_turn("r0", &turn(None, 40)).await.unwrap();
        assert_eq!(s.sweep_turns(11, u64::MAX).await.unwrap(), 1, "r1 expired");
        assert!(s.turn("r1").await.unwrap().is_none());
        assert!(s.turn("r0").await.unwrap().is_some());
        let one = encode(&turn(None, 0)).len() as u64;
        // Three left; room for two: the oldest (r2, at 20) goes.
        assert_eq!(s.sweep_turns(0, 2 * one + 2).await.unwrap(), 1);
        assert!(s.turn("r2").await.unwrap().is_none());
        assert!(s.turn("r3").await.unwrap().is_some());
        assert!(s.turn("r0").await.unwrap().is_some());
        assert_eq!(s.sweep_turns(0, 0).await.unwrap(), 2);
    });
}

#[test]
fn a_store_of_a_newer_schema_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let s = Embedded::open(dir.path()).unwrap();
    let w = s.db.begin_write().unwrap();
    {
        let mut meta = w.open_table(META).unwrap();
        meta.insert(SCHEMA_KEY, encode(&(SCHEMA_VERSION + 1)).as_slice())
            .unwrap();
    }
    w.commit().unwrap();
    drop(s);
    match Embedded::open(dir.path()) {
        Err(StateError::TooNew { found, ours }) => {
            assert_eq!((found, ours), (SCHEMA_VERSION + 1, SCHEMA_VERSION));
        }
        other => panic!("expected TooNew, got {other:?}"),
    }
}

#[test]
fn a_second_gateway_cannot_open_a_store_in_use() {
    let dir = tempfile::tempdir().unwrap();
    let _first = Embedded::open(dir.path()).unwrap();
    let second = Embedded::open(dir.path()).unwrap_err();
    assert!(matches!(second, StateError::Backend(_)), "{second}");
}

/// The state schema version 1 wrote, as committed (`tests/fixtures/state-v1/state.redb`):
/// every later gateway must read it as it was meant. `PD_BLESS=1` writes it again (only when
/// the schema's version 1 itself is what changed, which it must not).
fn fixture_v1() -> (Vec<(String, TurnRecord)>, PolicyRecord, Vec<String>, String) {
    let owner = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(b"fixture-key"));
    let first = TurnRecord {
        owner: Some(owner.clone()),
        parent: None,
        items: vec![
            json!({"role": "user", "content": "Name three rivers of Europe."}),
            json!({"type": "message", "role": "assistant",
                   "content": [{"type": "output_text", "text": "Rhine, Danube, Seine."}]}),
        ],
        inputs: 1,
        response: json!({"id": "resp_fixture_1", "object": "response", "status": "completed"}),
        held: Some(0x1234_5678_9abc_def0),
        stored_unix_ms: 1_796_000_000_000,
    };
    let second = TurnRecord {
        parent: Some("resp_fixture_1".into()),
        held: None,
        response: json!({"id": "resp_fixture_2", "object": "response", "status": "completed"}),
        stored_unix_ms: 1_796_000_001_000,
        ..first.clone()
    };
    let policy = PolicyRecord {
        generation: 1,
        current: PolicyEntry::Native {
            name: "round-robin".into(),
        },
        previous: Some(PolicyEntry::Native {
            name: "least-loaded".into(),
        }),
        saved_unix_ms: 1_796_000_002_000,
        file_sha256: None,
    };
    (
        vec![
            ("resp_fixture_1".into(), first),
            ("resp_fixture_2".into(), second),
        ],
        policy,
        vec!["node-a".into()],
        "fixture-token".into(),
    )
}

const FIXTURE_V1: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/state-v1/state.redb"
);

#[test]
fn the_state_version_1_wrote_is_read_as_it_was_meant() {
    let (turns, policy, drains, token) = fixture_v1();
    let dir = tempfile::tempdir().unwrap();
    if std::env::var_os("PD_BLESS").is_some() {
        rt().block_on(async {
            let s = Embedded::open(dir.path()).unwrap();
            for (id, t) in &turns {
                s.put_turn(id, t).await.unwrap();
            }
            s.put_policy(&policy, &[]).await.unwrap();
            for d in &drains {
                s.set_drain(d, true).await.unwrap();
            }
            s.cluster_token(&token).await.unwrap();
        });
        let to = std::path::Path::new(FIXTURE_V1);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(dir.path().join(FILE_NAME), to).unwrap();
        return;
    }
    std::fs::copy(FIXTURE_V1, dir.path().join(FILE_NAME)).expect("the committed fixture");
    rt().block_on(async {
        let s = Embedded::open(dir.path()).unwrap();
        for (id, t) in &turns {
            assert_eq!(s.turn(id).await.unwrap().as_ref(), Some(t), "{id}");
        }
        assert_eq!(s.policy().await.unwrap(), Some(policy));
        assert_eq!(s.drains().await.unwrap(), drains);
        assert_eq!(s.cluster_token("another").await.unwrap(), token);
        // And it takes new writes.
        s.put_turn("resp_new", &turns[0].1).await.unwrap();
    });
}
