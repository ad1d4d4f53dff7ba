//! `pd-gateway policy replay`: runs a decision log's recorded (request, view) pairs through
//! another policy and reports where and how its decisions differ from the recorded ones (or
//! from a second policy's): route shapes, first choices, the prefix tokens each would reuse,
//! and how each spreads the load over the nodes.
//!
//! Prefix tokens reused by a decision: the cached prefix of the prompt on the node that would
//! prefill it (the first prefill candidate of a split, the first candidate of a whole), that
//! is `min(prefix-blocks[node] × block-size, prompt-tokens)`, as the gateway's
//! `pd_gateway_prefix_hit_tokens_total` counts it.

use std::collections::BTreeMap;
use std::fmt;

use pd_policy::record::decision_json;
use pd_policy::{Decision, Installed, Record, Route};
use serde_json::{Value, json};

use crate::cases::names;

/// How one side (recorded, baseline or new) decided over the log.
#[derive(Debug, Default, Clone)]
pub struct Side {
    /// What decided: `recorded`, or the policy's name.
    pub label: String,
    /// Decisions made (records minus failures).
    pub decisions: u64,
    /// Prefix tokens the decisions would reuse (see the module docs).
    pub prefix_tokens: u64,
    /// Requests per node name taking the first prefill/whole slot.
    pub prefill_spread: BTreeMap<String, u64>,
    /// Requests per node name taking the first decode slot.
    pub decode_spread: BTreeMap<String, u64>,
    /// Splits, wholes and rejections.
    pub shapes: [u64; 3],
    /// Records on which the policy failed (trap, limit, invalid decision).
    pub failures: u64,
}

impl Side {
    fn new(label: &str) -> Self {
        Side {
            label: label.to_string(),
            ..Side::default()
        }
    }

    fn add(&mut self, record: &Record, d: &Decision) {
        self.decisions += 1;
        let names = names(record);
        let name = |i: u32| names.get(i as usize).map_or("?".into(), |n| n.to_string());
        match &d.route {
            Route::Split(s) => {
                self.shapes[0] += 1;
                if let Some(&p) = s.prefill.first() {
                    *self.prefill_spread.entry(name(p)).or_default() += 1;
                    self.prefix_tokens += prefix_tokens(record, p);
                }
                if let Some(t) = s.decode.first() {
                    *self.decode_spread.entry(name(t.node)).or_default() += 1;
                }
            }
            Route::Whole(c) => {
                self.shapes[1] += 1;
                if let Some(&p) = c.first() {
                    *self.prefill_spread.entry(name(p)).or_default() += 1;
                    self.prefix_tokens += prefix_tokens(record, p);
                }
            }
            Route::Reject(_) => self.shapes[2] += 1,
        }
    }

    /// The largest share of first prefill choices any one node took (1.0: all on one node).
    pub fn max_prefill_share(&self) -> f64 {
        let total: u64 = self.prefill_spread.values().sum();
        let max = self.prefill_spread.values().copied().max().unwrap_or(0);
        if total == 0 {
            0.0
        } else {
            max as f64 / total as f64
        }
    }

    fn to_json(&self) -> Value {
        json!({
            "label": self.label,
            "decisions": self.decisions,
            "failures": self.failures,
            "prefix_tokens": self.prefix_tokens,
            "splits": self.shapes[0],
            "wholes": self.shapes[1],
            "rejects": self.shapes[2],
            "prefill_spread": self.prefill_spread,
            "decode_spread": self.decode_spread,
            "max_prefill_share": self.max_prefill_share(),
        })
    }
}

/// Cached prompt tokens on node `i` of the record's view.
fn prefix_tokens(record: &Record, i: u32) -> u64 {
    let r = &record.request;
    let blocks = r.prefix_blocks.get(i as usize).copied().unwrap_or(0);
    (u64::from(blocks) * u64::from(r.block_size)).min(u64::from(r.prompt_tokens))
}

/// What [`replay`] found.
#[derive(Debug)]
pub struct ReplayReport {
    /// Records replayed.
    pub records: u64,
    /// The side compared against: the recorded decisions, or the baseline policy's.
    pub before: Side,
    /// The replayed policy.
    pub after: Side,
    /// Records where both decided and the decisions are equal.
    pub same: u64,
    /// Records where the route's shape changed (split, whole, reject).
    pub shape_changed: u64,
    /// Records where the first prefill/whole node changed.
    pub first_changed: u64,
    /// Records where the first decode node changed.
    pub decode_changed: u64,
    /// The first differences, described.
    pub examples: Vec<String>,
}

/// Differences described in full in a report.
const EXAMPLES: usize = 10;

fn first(d: &Decision) -> (Option<u32>, Option<u32>, usize) {
    match &d.route {
        Route::Split(s) => (
            s.prefill.first().copied(),
            s.decode.first().map(|t| t.node),
            0,
        ),
        Route::Whole(c) => (c.first().copied(), None, 1),
        Route::Reject(_) => (None, None, 2),
    }
}

/// Replays `records` through `after`, against the recorded decisions or, given one, a
/// `before` policy run on the same records.
pub fn replay(records: &[Record], after: &Installed, before: Option<&Installed>) -> ReplayReport {
    let mut report = ReplayReport {
        records: records.len() as u64,
        before: Side::new(before.map_or("recorded", |b| b.name())),
        after: Side::new(after.name()),
        same: 0,
        shape_changed: 0,
        first_changed: 0,
        decode_changed: 0,
        examples: Vec::new(),
    };
    for record in records {
        let names = names(record);
        let decide = |p: &Installed| {
            let at = record.time_ms.unwrap_or(0);
            p.decide_at(&record.request, &record.view, &record.measured, &names, at)
        };
        let old = match before {
            Some(b) => decide(b),
            None => Ok(record.decision.clone()),
        };
        let new = decide(after);
        match &old {
            Ok(d) => report.before.add(record, d),
            Err(_) => report.before.failures += 1,
        }
        match &new {
            Ok(d) => report.after.add(record, d),
            Err(_) => report.after.failures += 1,
        }
        let (Ok(old), Ok(new)) = (old, new) else {
            continue;
        };
        if old == new {
            report.same += 1;
            continue;
        }
        let (o, n) = (first(&old), first(&new));
        report.shape_changed += u64::from(o.2 != n.2);
        report.first_changed += u64::from(o.0 != n.0);
        report.decode_changed += u64::from(o.1 != n.1);
        if report.examples.len() < EXAMPLES {
            report.examples.push(format!(
                "seq {}: {} -> {}",
                record.request.seq,
                decision_json(&old),
                decision_json(&new)
            ));
        }
    }
    report
}

impl ReplayReport {
    /// The report as JSON (`--json`).
    pub fn to_json(&self) -> Value {
        json!({
            "records": self.records,
            "same": self.same,
            "shape_changed": self.shape_changed,
            "first_changed": self.first_changed,
            "decode_changed": self.decode_changed,
            "before": self.before.to_json(),
            "after": self.after.to_json(),
            "examples": self.examples,
        })
    }
}

impl fmt::Display for ReplayReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (b, a) = (&self.before, &self.after);
        writeln!(
            f,
            "{} records: {} decided the same, {} differently ({} changed route shape, {} first prefill/whole node, {} first decode node)",
            self.records,
            self.same,
            self.records - self.same,
            self.shape_changed,
            self.first_changed,
            self.decode_changed
        )?;
        writeln!(f, "{:<28} {:>16} {:>16}", "", b.label, a.label)?;
        let row = |f: &mut fmt::Formatter<'_>, k: &str, x: String, y: String| {
            writeln!(f, "{k:<28} {x:>16} {y:>16}")
        };
        row(
            f,
            "prefix tokens reused",
            b.prefix_tokens.to_string(),
            a.prefix_tokens.to_string(),
        )?;
        row(
            f,
            "split / whole / reject",
            format!("{}/{}/{}", b.shapes[0], b.shapes[1], b.shapes[2]),
            format!("{}/{}/{}", a.shapes[0], a.shapes[1], a.shapes[2]),
        )?;
        row(
            f,
            "policy failures",
            b.failures.to_string(),
            a.failures.to_string(),
        )?;
        row(
            f,
            "busiest node's prefill share",
            format!("{:.2}", b.max_prefill_share()),
            format!("{:.2}", a.max_prefill_share()),
        )?;
        let nodes: std::collections::BTreeSet<&String> = b
            .prefill_spread
            .keys()
            .chain(a.prefill_spread.keys())
            .chain(b.decode_spread.keys())
            .chain(a.decode_spread.keys())
            .collect();
        for n in nodes {
            let get = |m: &BTreeMap<String, u64>| m.get(n).copied().unwrap_or(0);
            row(
                f,
                &format!("  {n} (prefill/decode)"),
                format!("{}/{}", get(&b.prefill_spread), get(&b.decode_spread)),
                format!("{}/{}", get(&a.prefill_spread), get(&a.decode_spread)),
            )?;
        }
        for e in &self.examples {
            writeln!(f, "  {e}")?;
        }
        Ok(())
    }
}
