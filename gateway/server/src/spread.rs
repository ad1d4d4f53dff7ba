//! n>1 over several decode nodes: which children go where, and one answer made of several.
//!
//! A policy's decode list places the request's `n` children ([`plan`]): each entry that takes
//! children becomes a [`Group`], one decode request with its own lease on P's blocks (P grants
//! one per group, `num_consumers` in the request to P, answered in the list form). Group `j`
//! asks its node for `children` completions with seed `seed + offset`, so child `i` there is
//! child `offset + i` of a single node (the node seeds child `c` with `seed + c`): the merged
//! answer is token for token what one node gives.
//!
//! Answers come back merged: [`merge_json`] for a whole body, [`SseMerge`] for streams. Choice
//! indices are moved by each group's offset, one `id` is used throughout, usage is summed
//! (completion tokens) or taken at its lowest over the groups (`prompt_tokens_details`, so a
//! decode node that recomputed instead of pulling shows), and `[DONE]` ends the merged stream
//! once, after every group's. A group's `kv_transfer_params` (the lease on a turn its node
//! kept) never reach the client: both mergers take them out and hand them to the caller, which
//! releases them (a spread turn has no one holder to continue it).

use pd_policy::DecodeTarget;
use pd_wire::sse::{self, Framer};
use serde_json::{Map, Value, json};

/// Most groups one request is spread over: the number of leases a producer grants for one
/// prefill is bounded the same (`num_consumers` ≤ 16 on our nodes). A plan with more groups is
/// served on one decode node.
pub const MAX_GROUPS: usize = 16;

/// One decode request of a split: `children` completions, the request's `offset..offset +
/// children`, on the first of `candidates` that answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    /// Index of this group's first child among the request's `n`.
    pub offset: u32,
    /// Children this group decodes.
    pub children: u32,
    /// The node the policy placed them on, then the decision's failover entries.
    pub candidates: Vec<u32>,
}

/// Places `n` children as the WIT says: walk `decode`, giving each entry its `children` until
/// all `n` are placed; entries left over are failover candidates of every group. With one group,
/// its candidates are the whole list in order (the same node twice is tried once).
pub fn plan(decode: &[DecodeTarget], n: u32) -> Vec<Group> {
    let n = n.max(1);
    let mut groups: Vec<Group> = Vec::new();
    let mut placed = 0u32;
    let mut rest = Vec::new();
    for t in decode {
        if placed < n {
            let take = t.children.min(n - placed).max(1);
            groups.push(Group {
                offset: placed,
                children: take,
                candidates: vec![t.node],
            });
            placed += take;
        } else {
            rest.push(t.node);
        }
    }
    for g in &mut groups {
        for &node in &rest {
            if !g.candidates.contains(&node) {
                g.candidates.push(node);
            }
        }
    }
    groups
}

/// The body for group `g`: the decode body with `g.children` completions and the seed moved
/// by its offset. `seed` is the client's, or one the gateway drew for a spread request.
pub fn group_body(decode_body: &Map<String, Value>, g: &Group, seed: i64) -> Map<String, Value> {
    let mut b = decode_body.clone();
    b.insert("n".into(), json!(g.children));
    b.insert("seed".into(), json!(seed.wrapping_add(i64::from(g.offset))));
    b
}

/// Moves every `choices[].index` of `v` by `offset`.
fn shift_choices(v: &mut Value, offset: u32) {
    if let Some(Value::Array(choices)) = v.get_mut("choices") {
        for c in choices {
            if let Some(i) = c.get("index").and_then(Value::as_u64) {
                c["index"] = json!(i + u64::from(offset));
            }
        }
    }
}

/// Usage summed over groups: completion tokens added, prompt tokens from the first, each
/// `prompt_tokens_details` count at its lowest (absent if any group lacks it).
fn merge_usage(usages: &[&Value]) -> Option<Value> {
    let first = (*usages.first()?).clone();
    let mut out = first;
    let completion: u64 = usages
        .iter()
        .filter_map(|u| u.get("completion_tokens").and_then(Value::as_u64))
        .sum();
    let prompt = out
        .get("prompt_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    out["completion_tokens"] = json!(completion);
    out["total_tokens"] = json!(prompt + completion);
    if let Some(Value::Object(details)) = out.get_mut("prompt_tokens_details") {
        let keys: Vec<String> = details.keys().cloned().collect();
        for k in keys {
            let low = usages
                .iter()
                .map(|u| {
                    u.get("prompt_tokens_details")
                        .and_then(|d| d.get(&k))
                        .and_then(Value::as_u64)
                })
                .try_fold(u64::MAX, |low, v| v.map(|v| low.min(v)));
            match low {
                Some(v) => details[&k] = json!(v),
                None => {
                    details.remove(&k);
                }
            }
        }
    }
    Some(out)
}

/// Why spread children's answers could not be merged.
#[derive(Debug, thiserror::Error)]
pub enum MergeError {
    /// A part is not JSON.
    #[error("a decode node's body: {0}")]
    Body(#[from] serde_json::Error),
    /// A part has no `choices` list.
    #[error("a decode node answered without choices: {0}")]
    NoChoices(Value),
    /// No part at all.
    #[error("no decode answer")]
    Empty,
}

/// One whole answer from several: `parts[j]` is group `j`'s body, moved by `offsets[j]`.
///
/// # Errors
/// A part that is not a JSON object with a `choices` list.
pub fn merge_json(parts: &[(u32, &[u8])]) -> Result<Merged, MergeError> {
    let mut values = Vec::with_capacity(parts.len());
    let mut leases = Vec::new();
    for (offset, body) in parts {
        let mut v: Value = serde_json::from_slice(body)?;
        if !v.get("choices").is_some_and(Value::is_array) {
            return Err(MergeError::NoChoices(v));
        }
        leases.extend(take_params(&mut v));
        shift_choices(&mut v, *offset);
        values.push(v);
    }
    let Some(mut out) = values.first().cloned() else {
        return Err(MergeError::Empty);
    };
    let mut choices: Vec<Value> = values
        .iter()
        .filter_map(|v| v.get("choices").and_then(Value::as_array))
        .flatten()
        .cloned()
        .collect();
    choices.sort_by_key(|c| c.get("index").and_then(Value::as_u64).unwrap_or(u64::MAX));
    out["choices"] = Value::Array(choices);
    let usages: Vec<&Value> = values.iter().filter_map(|v| v.get("usage")).collect();
    if usages.len() == values.len()
        && let Some(u) = merge_usage(&usages)
    {
        out["usage"] = u;
    }
    Ok(Merged {
        answer: out,
        leases,
    })
}

/// A merged answer ([`merge_json`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Merged {
    /// The client's answer: no group's `kv_transfer_params` in it.
    pub answer: Value,
    /// Every group's `kv_transfer_params` as the nodes answered them (retained turns' leases),
    /// for the caller to release.
    pub leases: Vec<Value>,
}

/// Takes `kv_transfer_params` out of a group's answer or chunk.
fn take_params(v: &mut Value) -> Option<Value> {
    v.as_object_mut()?
        .remove(pd_wire::kv::FIELD)
        .filter(|p| !p.is_null())
}

/// Merges the SSE streams of several groups into one, event by event, as bytes arrive.
#[derive(Debug)]
pub struct SseMerge {
    offsets: Vec<u32>,
    pending: Vec<Framer>,
    done: Vec<bool>,
    /// The `id` of the first chunk seen, used for every chunk.
    id: Option<Value>,
    /// Each group's usage chunk, held until every group finished.
    usage: Vec<Option<Value>>,
    /// Groups' `kv_transfer_params` taken out of their chunks ([`SseMerge::take_leases`]).
    leases: Vec<Value>,
    /// Each group's latest usage so far (vLLM's `continuous_usage_stats`): a chunk carrying
    /// one gets every group's summed instead.
    so_far: Vec<Option<Value>>,
}

impl SseMerge {
    /// For groups whose first children are `offsets`.
    pub fn new(offsets: Vec<u32>) -> Self {
        let k = offsets.len();
        Self {
            offsets,
            pending: (0..k).map(|_| Framer::new()).collect(),
            done: vec![false; k],
            id: None,
            usage: vec![None; k],
            so_far: vec![None; k],
            leases: Vec::new(),
        }
    }

    /// The groups' `kv_transfer_params` taken out of their chunks so far (retained turns'
    /// leases), for the caller to release.
    pub fn take_leases(&mut self) -> Vec<Value> {
        std::mem::take(&mut self.leases)
    }

    /// Feeds bytes of group `j`'s stream; returns the merged bytes ready to send.
    pub fn feed(&mut self, j: usize, bytes: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        let Some(framer) = self.pending.get_mut(j) else {
            return out;
        };
        framer.push(bytes);
        let events: Vec<_> = std::iter::from_fn(|| framer.next_event()).collect();
        for event in events {
            self.event(j, &event, &mut out);
        }
        out
    }

    fn event(&mut self, j: usize, event: &[u8], out: &mut Vec<u8>) {
        let parsed = sse::Event::parse(event);
        if parsed.data.is_none() {
            // A comment or keep-alive: pass it on.
            out.extend_from_slice(event);
            return;
        }
        if parsed.is_done() {
            self.done[j] = true;
            return;
        }
        let Some(mut v) = parsed.json() else {
            out.extend_from_slice(event);
            return;
        };
        if v.get("error").is_some() {
            out.extend_from_slice(event);
            return;
        }
        self.leases.extend(take_params(&mut v));
        let empty = v
            .get("choices")
            .and_then(Value::as_array)
            .is_some_and(Vec::is_empty);
        if empty && v.get("usage").is_some_and(|u| !u.is_null()) {
            self.usage[j] = Some(v);
            return;
        }
        shift_choices(&mut v, self.offsets[j]);
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            self.so_far[j] = Some(u.clone());
            let known: Vec<&Value> = self.so_far.iter().flatten().collect();
            if let Some(u) = merge_usage(&known) {
                v["usage"] = u;
            }
        }
        if let Some(id) = v.get("id") {
            match &self.id {
                None => self.id = Some(id.clone()),
                Some(first) => v["id"] = first.clone(),
            }
        }
        write_data(out, &v);
    }

    /// Whether every group's stream ended with `[DONE]`.
    pub fn complete(&self) -> bool {
        self.done.iter().all(|d| *d)
    }

    /// The merged usage chunk (when the groups sent usage) and `[DONE]`.
    pub fn finish(&mut self) -> Vec<u8> {
        let mut out = Vec::new();
        let chunks: Vec<&Value> = self.usage.iter().flatten().collect();
        if chunks.len() == self.usage.len() && !chunks.is_empty() {
            let usages: Vec<&Value> = chunks.iter().filter_map(|c| c.get("usage")).collect();
            let mut chunk = chunks[0].clone();
            if let Some(u) = merge_usage(&usages) {
                chunk["usage"] = u;
            }
            if let Some(id) = &self.id {
                chunk["id"] = id.clone();
            }
            write_data(&mut out, &chunk);
        }
        out.extend_from_slice(sse::DONE);
        out
    }
}

fn write_data(out: &mut Vec<u8>, v: &Value) {
    sse::write_json(out, None, v);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(node: u32, children: u32) -> DecodeTarget {
        DecodeTarget { node, children }
    }

    #[test]
    fn plans_follow_the_wit() {
        // All on the first entry: one group, the rest failover.
        let g = plan(&[t(4, 3), t(2, 3)], 3);
        assert_eq!(
            g,
            vec![Group {
                offset: 0,
                children: 3,
                candidates: vec![4, 2]
            }]
        );
        // Dealt: 2 + 1, the third entry is every group's failover.
        let g = plan(&[t(4, 2), t(2, 1), t(5, 1)], 3);
        assert_eq!(g.len(), 2);
        assert_eq!(
            (g[0].offset, g[0].children, &g[0].candidates),
            (0, 2, &vec![4, 5])
        );
        assert_eq!(
            (g[1].offset, g[1].children, &g[1].candidates),
            (2, 1, &vec![2, 5])
        );
        // An entry offering more than is left takes only what is left.
        let g = plan(&[t(1, 2), t(2, 5)], 3);
        assert_eq!((g[1].offset, g[1].children), (2, 1));
    }

    #[test]
    fn group_bodies_move_the_seed() {
        let body = match json!({"model": "m", "n": 3, "seed": 7}) {
            Value::Object(m) => m,
            _ => unreachable!(),
        };
        let g = Group {
            offset: 2,
            children: 1,
            candidates: vec![0],
        };
        let b = group_body(&body, &g, 7);
        assert_eq!((b["n"].clone(), b["seed"].clone()), (json!(1), json!(9)));
        assert_eq!(group_body(&body, &g, i64::MAX)["seed"], json!(i64::MIN + 1));
    }

    #[test]
    fn whole_answers_merge_indices_and_usage() {
        let a =
            json!({"id": "a", "choices": [{"index": 0, "text": "x"}, {"index": 1, "text": "y"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 8, "total_tokens": 18,
                      "prompt_tokens_details": {"cached_tokens": 9, "kv_pulled_tokens": 9}}})
            .to_string();
        let b = json!({"id": "b", "choices": [{"index": 0, "text": "z"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14,
                      "prompt_tokens_details": {"cached_tokens": 9}},
            "kv_transfer_params": {"do_remote_decode": true, "remote_block_ids": [1, 2]}})
        .to_string();
        let merged = merge_json(&[(0, a.as_bytes()), (2, b.as_bytes())]).unwrap();
        // The group's lease goes to the caller, not into the client's answer.
        assert_eq!(
            merged.leases,
            vec![json!({"do_remote_decode": true, "remote_block_ids": [1, 2]})]
        );
        let m = merged.answer;
        assert!(m.get("kv_transfer_params").is_none(), "{m}");
        assert_eq!(m["id"], "a");
        let idx: Vec<u64> = m["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["index"].as_u64().unwrap())
            .collect();
        assert_eq!(idx, vec![0, 1, 2]);
        assert_eq!(m["choices"][2]["text"], "z");
        assert_eq!(m["usage"]["completion_tokens"], 12);
        assert_eq!(m["usage"]["total_tokens"], 22);
        // Group b pulled nothing: the merged answer does not claim a pull.
        assert_eq!(
            m["usage"]["prompt_tokens_details"],
            json!({"cached_tokens": 9})
        );
        assert!(merge_json(&[(0, b"{}".as_slice())]).is_err());
    }

    #[test]
    fn streams_merge_event_by_event() {
        let mut m = SseMerge::new(vec![0, 2]);
        let c = |id: &str, i: u32, s: &str| {
            format!(
                "data: {}\n\n",
                json!({"id": id, "choices": [{"index": i, "delta": {"content": s}}]})
            )
        };
        // An event split across reads is held until complete.
        let first = c("a", 1, "x");
        let (head, tail) = first.split_at(10);
        assert!(m.feed(0, head.as_bytes()).is_empty());
        let out = String::from_utf8(m.feed(0, tail.as_bytes())).unwrap();
        assert!(out.contains(r#""index":1"#) && out.contains(r#""id":"a""#));
        let out = String::from_utf8(m.feed(1, c("b", 0, "z").as_bytes())).unwrap();
        assert!(
            out.contains(r#""index":2"#) && out.contains(r#""id":"a""#),
            "{out}"
        );
        // A group's lease params (a turn its node kept, on its last chunk) go to the caller,
        // not into the stream.
        let kept = json!({"id": "b", "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
            "kv_transfer_params": {"do_remote_decode": true, "remote_block_ids": [7]}});
        let out = String::from_utf8(m.feed(1, format!("data: {kept}\n\n").as_bytes())).unwrap();
        assert!(
            !out.contains("kv_transfer_params") && out.contains(r#""index":2"#),
            "{out}"
        );
        assert_eq!(
            m.take_leases(),
            vec![json!({"do_remote_decode": true, "remote_block_ids": [7]})]
        );
        assert!(m.take_leases().is_empty());
        // [DONE] and usage are held until every group is done.
        let usage = |n: u64| {
            format!(
                "data: {}\n\ndata: [DONE]\n\n",
                json!({"id": "q", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}})
            )
        };
        assert!(m.feed(0, usage(6).as_bytes()).is_empty());
        assert!(!m.complete());
        assert!(m.feed(1, usage(3).as_bytes()).is_empty());
        assert!(m.complete());
        let out = String::from_utf8(m.finish()).unwrap();
        assert!(out.contains(r#""completion_tokens":9"#), "{out}");
        assert!(out.contains(r#""total_tokens":14"#), "{out}");
        assert!(out.ends_with("data: [DONE]\n\n"));
        assert_eq!(out.matches("[DONE]").count(), 1);
    }

    /// `continuous_usage_stats`: a chunk's usage so far is every group's, summed.
    #[test]
    fn usage_so_far_is_summed_over_the_groups() {
        let mut m = SseMerge::new(vec![0, 2]);
        let c = |i: u32, n: u64| {
            format!(
                "data: {}\n\n",
                json!({"id": "a", "choices": [{"index": i, "delta": {"content": "x"}}],
                       "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}})
            )
        };
        let out = String::from_utf8(m.feed(0, c(0, 2).as_bytes())).unwrap();
        assert!(out.contains(r#""completion_tokens":2"#), "{out}");
        let out = String::from_utf8(m.feed(1, c(0, 1).as_bytes())).unwrap();
        assert!(out.contains(r#""completion_tokens":3"#), "{out}");
        let out = String::from_utf8(m.feed(0, c(1, 4).as_bytes())).unwrap();
        assert!(
            out.contains(r#""completion_tokens":5"#) && out.contains(r#""total_tokens":10"#),
            "{out}"
        );
    }

    /// Any SSE line ending, and data split over several lines, merge as `\n\n` framing does.
    #[test]
    fn crlf_framed_and_multi_line_events_merge() {
        let mut m = SseMerge::new(vec![0, 1]);
        let chunk = "data: {\"id\": \"a\",\r\ndata: \"choices\": [{\"index\": 0, \"text\": \"x\"}]}\r\n\r\n";
        let (head, tail) = chunk.split_at(chunk.len() - 1);
        assert!(m.feed(1, head.as_bytes()).is_empty());
        let out = String::from_utf8(m.feed(1, tail.as_bytes())).unwrap();
        assert!(out.contains(r#""index":1"#), "{out}");
        assert!(
            m.feed(1, b": keep-alive\r\n\r\n")
                .starts_with(b": keep-alive")
        );
        m.feed(0, b"data: [DONE]\r\n\r\n");
        m.feed(1, b"data: [DONE]\n\n");
        assert!(m.complete());
    }
}
