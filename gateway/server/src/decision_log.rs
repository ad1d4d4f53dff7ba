//! The decision log: a sample of the policy's decisions, inputs and outputs, as JSONL records
//! in the WIT's names ([`pd_policy::record`]), kept in memory for `GET /admin/decisions` and
//! optionally appended to a file, for `pd-gateway policy replay` and `policy test` cases.
//!
//! Bounded everywhere: every `every`-th decision is sampled; memory keeps the last `keep`
//! lines; the file is written by its own thread from a bounded queue (a full queue drops the
//! line, counted) and rotated to `FILE.1` when it passes `max_bytes`. The request path pays a
//! counter increment when not sampled, and the record's serialisation when sampled.

use std::collections::VecDeque;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};

use pd_policy::Record;

/// How the log samples and where it writes.
#[derive(Debug, Clone)]
pub struct DecisionLogConfig {
    /// Record one decision in this many (1: all; 0: none).
    pub every: u64,
    /// Records kept in memory for `GET /admin/decisions`.
    pub keep: usize,
    /// A JSONL file records are appended to.
    pub file: Option<PathBuf>,
    /// The file is rotated to `FILE.1` past this size.
    pub max_bytes: u64,
}

impl Default for DecisionLogConfig {
    fn default() -> Self {
        DecisionLogConfig {
            every: 100,
            keep: 1000,
            file: None,
            max_bytes: 64 << 20,
        }
    }
}

/// Lines queued for the file writer before new ones are dropped.
const FILE_QUEUE: usize = 4096;

/// What the file writer thread is sent.
#[derive(Debug)]
enum ToWriter {
    /// A record's line.
    Line(Arc<str>),
    /// Answer once everything sent before is written and flushed.
    Flush(mpsc::Sender<()>),
}

/// The sampled decision log. Shared by the router (writes) and the admin API (reads).
#[derive(Debug)]
pub struct DecisionLog {
    every: u64,
    keep: usize,
    seen: AtomicU64,
    recent: Mutex<VecDeque<Arc<str>>>,
    file: Option<mpsc::SyncSender<ToWriter>>,
    /// Lines the file writer could not take (queue full or writer gone).
    pub dropped: AtomicU64,
}

impl DecisionLog {
    /// A log with `config`; starts the file writer thread when there is a file.
    ///
    /// # Errors
    ///
    /// The file cannot be opened for appending, or the writer thread cannot start.
    pub fn new(config: DecisionLogConfig) -> std::io::Result<Self> {
        let file = match config.file {
            Some(path) => Some(spawn_writer(path, config.max_bytes)?),
            None => None,
        };
        Ok(DecisionLog {
            every: config.every,
            keep: config.keep,
            seen: AtomicU64::new(0),
            recent: Mutex::new(VecDeque::with_capacity(config.keep.min(4096))),
            file,
            dropped: AtomicU64::new(0),
        })
    }

    /// Whether this decision is sampled (call once per decision).
    pub fn sample(&self) -> bool {
        if self.every == 0 {
            return false;
        }
        self.seen
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(self.every)
    }

    /// Records one decision.
    pub fn record(&self, record: &Record) {
        let line: Arc<str> = record.to_json().to_string().into();
        if self.keep > 0 {
            let mut recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
            if recent.len() == self.keep {
                recent.pop_front();
            }
            recent.push_back(line.clone());
        }
        if let Some(tx) = &self.file
            && tx.try_send(ToWriter::Line(line)).is_err()
        {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Waits up to `timeout` until every line queued before the call is in the file (at once
    /// when there is no file). `false`: the writer did not answer in time, or is gone.
    pub fn flush(&self, timeout: std::time::Duration) -> bool {
        let Some(tx) = &self.file else {
            return true;
        };
        let (ack, done) = mpsc::channel();
        let deadline = std::time::Instant::now() + timeout;
        // A full queue is emptied by the writer; try again until the deadline.
        let mut msg = ToWriter::Flush(ack);
        loop {
            match tx.try_send(msg) {
                Ok(()) => break,
                Err(mpsc::TrySendError::Disconnected(_)) => return false,
                Err(mpsc::TrySendError::Full(m)) => {
                    if std::time::Instant::now() >= deadline {
                        return false;
                    }
                    msg = m;
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
        }
        done.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now()))
            .is_ok()
    }

    /// The last `limit` records, oldest first, one JSON object per line.
    pub fn recent(&self, limit: usize) -> String {
        let recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        let skip = recent.len().saturating_sub(limit);
        let mut out = String::new();
        for line in recent.iter().skip(skip) {
            out.push_str(line);
            out.push('\n');
        }
        out
    }
}

fn open_append(path: &PathBuf) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
}

/// Starts the thread that appends lines to `path`, rotating past `max_bytes`.
fn spawn_writer(path: PathBuf, max_bytes: u64) -> std::io::Result<mpsc::SyncSender<ToWriter>> {
    let file = open_append(&path)?;
    let mut size = file.metadata()?.len();
    let (tx, rx) = mpsc::sync_channel::<ToWriter>(FILE_QUEUE);
    std::thread::Builder::new()
        .name("pd-decision-log".into())
        .spawn(move || {
            let mut out = std::io::BufWriter::new(file);
            while let Ok(first) = rx.recv() {
                let mut acks = Vec::new();
                for msg in std::iter::once(first).chain(rx.try_iter()) {
                    let line = match msg {
                        ToWriter::Line(line) => line,
                        ToWriter::Flush(ack) => {
                            acks.push(ack);
                            continue;
                        }
                    };
                    let wrote = writeln!(out, "{line}");
                    if let Err(e) = wrote {
                        tracing::warn!(path = %path.display(), error = %e, "decision log: write failed");
                    }
                    size += line.len() as u64 + 1;
                }
                if let Err(e) = out.flush() {
                    tracing::warn!(path = %path.display(), error = %e, "decision log: flush failed");
                }
                for ack in acks {
                    let _ = ack.send(());
                }
                if size > max_bytes {
                    let rotated = path.with_extension(match path.extension() {
                        Some(e) => format!("{}.1", e.to_string_lossy()),
                        None => "1".into(),
                    });
                    let reopened = std::fs::rename(&path, &rotated).and_then(|()| open_append(&path));
                    match reopened {
                        Ok(f) => {
                            out = std::io::BufWriter::new(f);
                            size = 0;
                        }
                        Err(e) => {
                            tracing::warn!(path = %path.display(), error = %e, "decision log: rotation failed")
                        }
                    }
                }
            }
        })?;
    Ok(tx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pd_policy::{Api, Decision, Request, Route, View};

    fn record(seq: u64) -> Record {
        Record::new(
            Request {
                seq,
                api: Api::Completions,
                prompt_tokens: 1,
                block_size: 16,
                block_hashes: vec![],
                prefix_blocks: vec![],
                n: 1,
                max_tokens: None,
                stream: false,
                conversation_key: None,
            },
            View { nodes: vec![] },
            Decision {
                route: Route::Whole(vec![]),
                reverse_pull: None,
            },
        )
    }

    #[test]
    fn samples_keeps_the_last_and_writes_the_file() {
        let dir = std::env::temp_dir().join(format!("pd-decision-log-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("decisions.jsonl");
        let _ = std::fs::remove_file(&path);
        let log = DecisionLog::new(DecisionLogConfig {
            every: 3,
            keep: 2,
            file: Some(path.clone()),
            max_bytes: 1 << 20,
        })
        .expect("log");
        let mut sampled = 0;
        for seq in 0..9 {
            if log.sample() {
                sampled += 1;
                log.record(&record(seq));
            }
        }
        assert_eq!(sampled, 3, "one in three");
        let recent = log.recent(10);
        let seqs: Vec<u64> = recent
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).expect("json");
                Record::from_json(&v).expect("record").request.seq
            })
            .collect();
        assert_eq!(seqs, vec![3, 6], "the last two records kept");
        assert!(
            log.flush(std::time::Duration::from_secs(5)),
            "the writer answers"
        );
        assert_eq!(
            std::fs::read_to_string(&path)
                .expect("file")
                .lines()
                .count(),
            3,
            "flush returns once the queued lines are in the file"
        );
        log.record(&record(9));
        drop(log);
        // The writer drains its queue when the log goes away.
        for _ in 0..100 {
            if std::fs::read_to_string(&path).is_ok_and(|s| s.lines().count() == 4) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(
            std::fs::read_to_string(&path)
                .expect("file")
                .lines()
                .count(),
            4
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
