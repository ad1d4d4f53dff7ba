//! `pd-gateway policy test`: runs a policy against recorded cases (a request, a view and the
//! expected decision, as [`pd_policy::Record`]s) without a cluster, and reports per case and
//! with latency percentiles.
//!
//! Cases are read from a directory (every `*.json` file is one case, every `*.jsonl` file one
//! case per line, in file-name order) or from one such file; a decision log written by the
//! gateway is a valid `*.jsonl` case file. A policy is named by a component file
//! (`FILE.wasm`) or a built-in policy (`native:least-loaded`).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pd_policy::native::NativePolicy;
use pd_policy::record::decision_json;
use pd_policy::{Decision, Installed, PolicyEngine, PolicyError, PolicySpec, Record};

/// Why cases or a policy could not be read.
#[derive(Debug, thiserror::Error)]
pub enum CaseError {
    /// A file or directory could not be read.
    #[error("{path}: {source}")]
    Io {
        /// What was read.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A case is not JSON or not a record.
    #[error("{path}{line}: {message}", line = line.map(|l| format!(":{l}")).unwrap_or_default())]
    Parse {
        /// The file.
        path: PathBuf,
        /// The line of a `.jsonl` file.
        line: Option<usize>,
        /// What is wrong.
        message: String,
    },
    /// No case was found.
    #[error("{0}: no cases (*.json or *.jsonl)")]
    Empty(PathBuf),
    /// The policy could not be loaded.
    #[error("loading {name}: {source}")]
    Policy {
        /// The policy argument.
        name: String,
        /// Why.
        #[source]
        source: PolicyError,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CaseError + '_ {
    move |source| CaseError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// One case: its name (file, or file:line) and its record.
#[derive(Debug, Clone)]
pub struct Case {
    /// `file.json` or `file.jsonl:LINE`.
    pub name: String,
    /// Request, view and the expected decision.
    pub record: Record,
}

/// Reads the cases at `path` (a directory, a `.json` file or a `.jsonl` file).
///
/// # Errors
///
/// [`CaseError`] for an unreadable file, a case that is not a record (naming the field), or
/// no case at all.
pub fn read_cases(path: &Path) -> Result<Vec<Case>, CaseError> {
    let mut files = Vec::new();
    if path.is_dir() {
        for entry in std::fs::read_dir(path).map_err(io(path))? {
            let p = entry.map_err(io(path))?.path();
            if matches!(
                p.extension().and_then(|e| e.to_str()),
                Some("json" | "jsonl")
            ) {
                files.push(p);
            }
        }
        files.sort();
    } else {
        files.push(path.to_path_buf());
    }
    let mut cases = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).map_err(io(&file))?;
        let short = file.file_name().map_or_else(
            || file.display().to_string(),
            |n| n.to_string_lossy().into(),
        );
        let parse = |text: &str, line: Option<usize>| -> Result<Record, CaseError> {
            let fail = |message: String| CaseError::Parse {
                path: file.clone(),
                line,
                message,
            };
            let v: serde_json::Value =
                serde_json::from_str(text).map_err(|e| fail(e.to_string()))?;
            Record::from_json(&v).map_err(|e| fail(e.to_string()))
        };
        if file.extension().and_then(|e| e.to_str()) == Some("jsonl") {
            for (i, line) in text.lines().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                cases.push(Case {
                    name: format!("{short}:{}", i + 1),
                    record: parse(line, Some(i + 1))?,
                });
            }
        } else {
            cases.push(Case {
                name: short,
                record: parse(&text, None)?,
            });
        }
    }
    if cases.is_empty() {
        return Err(CaseError::Empty(path.to_path_buf()));
    }
    Ok(cases)
}

/// Loads the policy named by `arg`: `native:NAME` for a built-in policy, else a component
/// file loaded (compiled, smoke-tested) with `spec`.
///
/// # Errors
///
/// [`CaseError::Io`] for an unreadable file, [`CaseError::Policy`] for an unknown built-in
/// policy or a component the engine refuses.
pub fn load_policy(
    engine: &PolicyEngine,
    arg: &str,
    mut spec: PolicySpec,
) -> Result<Installed, CaseError> {
    let policy_err = |source| CaseError::Policy {
        name: arg.to_string(),
        source,
    };
    if let Some(name) = arg.strip_prefix("native:") {
        NativePolicy::from_name(name).map_err(policy_err)?;
        return Ok(Installed::Native {
            name: name.to_string(),
        });
    }
    let path = Path::new(arg);
    let bytes = std::fs::read(path).map_err(io(path))?;
    if spec.name == PolicySpec::default().name {
        spec.name = path
            .file_stem()
            .map_or_else(|| arg.to_string(), |s| s.to_string_lossy().into_owned());
    }
    engine
        .load(&bytes, spec)
        .map(Installed::Wasm)
        .map_err(policy_err)
}

/// Node names of a record (`node-<i>` where the record has none).
pub fn names(record: &Record) -> Arc<[Arc<str>]> {
    (0..record.view.nodes.len())
        .map(|i| match record.node_names.get(i) {
            Some(n) => Arc::from(n.as_str()),
            None => Arc::from(format!("node-{i}")),
        })
        .collect()
}

/// What one case gave.
#[derive(Debug)]
pub enum Outcome {
    /// The expected decision.
    Pass,
    /// Another (valid) decision.
    Mismatch {
        /// The case's decision.
        expected: Decision,
        /// The policy's.
        got: Decision,
    },
    /// The policy failed (trap, limit, invalid decision).
    Failed(PolicyError),
}

/// The result of [`run_cases`].
#[derive(Debug)]
pub struct Report {
    /// Per case, in order.
    pub results: Vec<(String, Outcome)>,
    /// Every call's duration (host path included), all repeats.
    pub latencies: Vec<Duration>,
}

impl Report {
    /// Cases that did not pass.
    pub fn failures(&self) -> usize {
        self.results
            .iter()
            .filter(|(_, o)| !matches!(o, Outcome::Pass))
            .count()
    }

    /// The `q`-quantile (0..=1) of the call durations.
    pub fn quantile(&self, q: f64) -> Duration {
        let mut l = self.latencies.clone();
        l.sort_unstable();
        if l.is_empty() {
            return Duration::ZERO;
        }
        let i = ((l.len() - 1) as f64 * q).round() as usize;
        l[i.min(l.len() - 1)]
    }
}

/// Runs every case `repeat` times (at least once; the first call decides the outcome, every
/// call is timed).
pub fn run_cases(policy: &Installed, cases: &[Case], repeat: usize) -> Report {
    let mut results = Vec::with_capacity(cases.len());
    let mut latencies = Vec::with_capacity(cases.len() * repeat.max(1));
    for case in cases {
        let r = &case.record;
        let names = names(r);
        let mut outcome = None;
        for _ in 0..repeat.max(1) {
            let start = Instant::now();
            let at = r.time_ms.unwrap_or(0);
            let got = policy.decide_at(&r.request, &r.view, &r.measured, &names, at);
            latencies.push(start.elapsed());
            outcome.get_or_insert(match got {
                Ok(d) if d == r.decision => Outcome::Pass,
                Ok(d) => Outcome::Mismatch {
                    expected: r.decision.clone(),
                    got: d,
                },
                Err(e) => Outcome::Failed(e),
            });
        }
        if let Some(o) = outcome {
            results.push((case.name.clone(), o));
        }
    }
    Report { results, latencies }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (name, outcome) in &self.results {
            match outcome {
                Outcome::Pass => writeln!(f, "ok    {name}")?,
                Outcome::Mismatch { expected, got } => writeln!(
                    f,
                    "FAIL  {name}\n      expected {}\n      got      {}",
                    decision_json(expected),
                    decision_json(got)
                )?,
                Outcome::Failed(e) => writeln!(f, "ERROR {name}: {e}")?,
            }
        }
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        writeln!(
            f,
            "{} cases, {} passed, {} failed; decision latency over {} calls: p50 {:.1} µs, p99 {:.1} µs, max {:.1} µs",
            self.results.len(),
            self.results.len() - self.failures(),
            self.failures(),
            self.latencies.len(),
            us(self.quantile(0.5)),
            us(self.quantile(0.99)),
            us(self.quantile(1.0)),
        )
    }
}
