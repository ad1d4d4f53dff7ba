//! Property tests of the response store and the conversation index (issue 45): random sequences
//! of operations by a few owners against a model of what must hold.
//!
//! - [`ResponseStore`]: a put never overwrites another owner's id; no owner reads or deletes
//!   another's turn; the store stays within its bytes and counts them exactly; eviction is fair
//!   per owner (an owner holding at most its share, `max_bytes / owners`, never loses a turn).
//! - [`Holdings`]: never more than its bound; every holding put in is, at every moment, either
//!   still found under its own last block or was handed back (by `insert` or `remove`) exactly
//!   once, so its lease is released, never leaked.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use pd_wire::KvTransferParams;
use proptest::prelude::*;
use serde_json::{Value, json};

use super::{Holding, Holdings, NewTurn, Owner, ResponseStore};

const OWNERS: usize = 3;
const MAX_BYTES: usize = 4096;

fn owner(i: usize) -> Owner {
    Owner::of(Some(["key-a", "key-b", "key-c"][i]))
}

#[derive(Debug, Clone)]
enum StoreOp {
    Put {
        owner: usize,
        id: u8,
        pad: usize,
        parent: Option<u8>,
    },
    Delete {
        owner: usize,
        id: u8,
    },
    History {
        owner: usize,
        id: u8,
    },
}

fn store_op() -> impl Strategy<Value = StoreOp> {
    prop_oneof![
        6 => (0..OWNERS, 0u8..24, 0usize..1500, proptest::option::of(0u8..24))
            .prop_map(|(owner, id, pad, parent)| StoreOp::Put { owner, id, pad, parent }),
        1 => (0..OWNERS, 0u8..24).prop_map(|(owner, id)| StoreOp::Delete { owner, id }),
        1 => (0..OWNERS, 0u8..24).prop_map(|(owner, id)| StoreOp::History { owner, id }),
    ]
}

fn id(i: u8) -> String {
    format!("resp_{i:02}")
}

fn turn_of(pad: usize, id: &str, owner_i: usize) -> (Vec<Value>, Vec<Value>, Value) {
    let input = vec![json!({"role": "user", "content": "x".repeat(pad)})];
    let output = vec![json!({"type": "message", "content": "y"})];
    let response = json!({"id": id, "owner": owner_i});
    (input, output, response)
}

/// The bytes the store counts for a turn: what it holds in memory.
fn bytes_of(
    input: &[Value],
    output: &[Value],
    response: &Value,
    id: &str,
    parent: Option<&str>,
) -> usize {
    let items: Vec<Value> = input.iter().chain(output).cloned().collect();
    super::store::turn_bytes(id, parent, &super::store::Packed::new(&items, response))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn the_response_store_keeps_owners_apart_within_its_bounds_and_evicts_fairly(
        ops in proptest::collection::vec(store_op(), 1..80)
    ) {
        let store = ResponseStore::new(MAX_BYTES, Duration::from_secs(3600));
        // What each id holds: its owner and bytes.
        let mut model: BTreeMap<String, (usize, usize)> = BTreeMap::new();
        for op in ops {
            match op {
                StoreOp::Put { owner: o, id: i, pad, parent } => {
                    let key = id(i);
                    let (input, output, response) = turn_of(pad, &key, o);
                    let parent = parent.map(id);
                    let bytes = bytes_of(&input, &output, &response, &key, parent.as_deref());
                    let before = model.clone();
                    let got = store.put(&key, NewTurn {
                        owner: owner(o),
                        parent: parent.as_deref(),
                        input,
                        output,
                        response: response.clone(),
                        held: None,
                    });
                    match model.get(&key) {
                        Some(&(holder, _)) if holder != o => {
                            prop_assert!(got.is_err(), "{key} of owner {holder} overwritten by {o}");
                            prop_assert_eq!(
                                store.response(&key, owner(holder)).map(|r| r["owner"].clone()),
                                Some(json!(holder))
                            );
                        }
                        _ => {
                            prop_assert!(got.is_ok());
                            if bytes <= MAX_BYTES {
                                model.insert(key.clone(), (o, bytes));
                            }
                        }
                    }
                    // Evictions: sync the model with what is still there; an owner within its
                    // share (after this put) must have lost nothing.
                    let mut per_owner = [0usize; OWNERS];
                    for (holder, b) in model.values() {
                        per_owner[*holder] += b;
                    }
                    let ids: Vec<String> = model.keys().cloned().collect();
                    for k in ids {
                        let (holder, _) = model[&k];
                        if store.response(&k, owner(holder)).is_none() {
                            prop_assert!(
                                per_owner[holder] > MAX_BYTES / OWNERS,
                                "owner {holder} holding {} of {MAX_BYTES} lost {k} (before: {before:?})",
                                per_owner[holder]
                            );
                            model.remove(&k);
                        }
                    }
                }
                StoreOp::Delete { owner: o, id: i } => {
                    let key = id(i);
                    let got = store.delete(&key, owner(o));
                    match model.get(&key) {
                        Some(&(holder, _)) if holder == o => {
                            prop_assert!(got.is_some());
                            model.remove(&key);
                        }
                        Some(_) => {
                            prop_assert!(got.is_none(), "owner {o} deleted another's {key}");
                        }
                        None => prop_assert!(got.is_none()),
                    }
                }
                StoreOp::History { owner: o, id: i } => {
                    let key = id(i);
                    let got = store.history(&key, owner(o));
                    if model.get(&key).is_none_or(|&(holder, _)| holder != o) {
                        prop_assert!(got.is_err(), "owner {o} read another's conversation {key}");
                    }
                }
            }
            // No owner reads another's turn; the store's bytes are within bounds and exact.
            for (k, &(holder, _)) in &model {
                for other in (0..OWNERS).filter(|x| *x != holder) {
                    prop_assert!(store.response(k, owner(other)).is_none());
                    prop_assert!(store.input_items(k, owner(other)).is_none());
                }
            }
            prop_assert!(store.bytes() <= MAX_BYTES);
            prop_assert_eq!(store.bytes(), model.values().map(|(_, b)| b).sum::<usize>());
        }
    }
}

#[derive(Debug, Clone)]
enum HoldOp {
    Insert {
        last: u8,
        prompt: Option<(u8, u32)>,
        expired: bool,
    },
    Remove {
        last: u8,
    },
    Longest {
        hashes: Vec<u8>,
    },
}

fn hold_op() -> impl Strategy<Value = HoldOp> {
    prop_oneof![
        5 => (0u8..32, proptest::option::of((0u8..32, 0u32..3)), proptest::bool::weighted(0.1))
            .prop_map(|(last, prompt, expired)| HoldOp::Insert { last, prompt, expired }),
        1 => (0u8..32).prop_map(|last| HoldOp::Remove { last }),
        2 => proptest::collection::vec(0u8..32, 0..6).prop_map(|hashes| HoldOp::Longest { hashes }),
    ]
}

/// A hash of small number `n` (distinct, nonzero).
fn h(n: u8) -> u64 {
    0x9e37_79b9_7f4a_7c15_u64.wrapping_mul(u64::from(n) + 1)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn the_conversation_index_stays_bounded_and_hands_back_every_holding_it_drops(
        cap in 1usize..8,
        ops in proptest::collection::vec(hold_op(), 1..100)
    ) {
        let holdings = Holdings::new(cap);
        let now = SystemTime::now();
        // Every holding put in and not handed back, by a serial number (its epoch): its key,
        // and whether it had expired (an expired holding met by `longest` is dropped without
        // being handed back: its lease ended on the node by itself).
        let mut live: BTreeMap<u64, (u64, bool)> = BTreeMap::new();
        let mut serial = 0u64;
        fn back(got: Vec<Holding>, live: &mut BTreeMap<u64, (u64, bool)>) -> Result<(), TestCaseError> {
            for g in got {
                prop_assert!(live.remove(&g.epoch).is_some(), "holding {} handed back twice or never put", g.epoch);
            }
            Ok(())
        }
        for op in ops {
            match op {
                HoldOp::Insert { last, prompt, expired } => {
                    serial += 1;
                    let holding = Holding {
                        engine_id: Arc::from("d1"),
                        epoch: serial,
                        tokens: 16,
                        last_hash: h(last),
                        expires: if expired { now - Duration::from_secs(1) } else { now + Duration::from_secs(600) },
                        params: KvTransferParams::default(),
                        prompt_key: prompt.map(|(p, t)| (h(p), t * 16)),
                    };
                    live.insert(serial, (h(last), expired));
                    back(holdings.insert(holding), &mut live)?;
                }
                HoldOp::Remove { last } => {
                    if let Some(g) = holdings.remove(h(last)) {
                        back(vec![g], &mut live)?;
                    }
                }
                HoldOp::Longest { hashes } => {
                    let hashes: Vec<u64> = hashes.into_iter().map(h).collect();
                    let (found, _) = holdings.longest(&hashes, now);
                    if let Some(f) = found {
                        prop_assert!(f.holding.expires > now, "an expired holding was found");
                        prop_assert!(live.contains_key(&f.holding.epoch), "found a holding handed back");
                    }
                }
            }
            let fresh = live.values().filter(|(_, expired)| !expired).count();
            prop_assert!(holdings.len() <= cap, "{} holdings over a bound of {cap}", holdings.len());
            prop_assert!(
                (fresh..=live.len()).contains(&holdings.len()),
                "{} indexed, {fresh} live and fresh, {} live: a holding was dropped without being handed back",
                holdings.len(),
                live.len()
            );
            // Each live, fresh holding is found under its own last block.
            for (&serial, &(key, expired)) in &live {
                if expired {
                    continue;
                }
                let (found, _) = holdings.longest(&[key], now);
                let found = found.map(|f| (f.holding.epoch, f.exact));
                prop_assert_eq!(found, Some((serial, true)), "holding {} lost", serial);
            }
        }
    }
}
