//! Prometheus metrics of the transfer layer (own registry, no global state).

use std::sync::Mutex;

use prometheus::{
    Gauge, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry,
};

use crate::consumer::confirm::Confirmed;
use crate::lease_authority::PoolStats;
use crate::peer::TransferError;
use crate::pull::PullStats;
use crate::puller::LeaseTrace;

/// Pulls smaller than this do not move the bandwidth average: their time is mostly fixed cost
/// (a thread's wake-up, a preemption on a busy host), and a rate read from them is far below
/// the link's. (At 256 KiB, a prefill node's first pull back, two blocks, once read 1 MB/s on
/// the 2-core VM, against 5–11 GB/s from every later pull; see docs/bench-log/multi-turn.md,
/// "Reservations are not work".)
pub const PULL_RATE_MIN_BYTES: usize = 4 << 20;

/// `reason` labels of [`TransferMetrics::recomputes`] besides a pull's failure
/// ([`TransferError::REASONS`]): the pull was not worth it (`below_threshold`), the producer
/// failed lately (`peer_suspect`), or it is no longer an allowed peer (`peer_not_allowed`).
pub const RECOMPUTE_REASONS: [&str; 3] = ["below_threshold", "peer_suspect", "peer_not_allowed"];

/// Weight of the newest pull in the bandwidth average.
pub const PULL_RATE_EWMA_WEIGHT: f64 = 0.2;

/// The bandwidth average after a pull measured at `sample` bytes/s: the first sample as is,
/// then a moving average ([`PULL_RATE_EWMA_WEIGHT`]) over samples floored at half the
/// average. A slow outlier (the pull's thread preempted) can halve the figure but not
/// collapse it: a policy that reads a collapsed rate stops pulling, and then nothing measures
/// the rate again.
pub fn pull_rate_average(old: f64, sample: f64) -> f64 {
    if old > 0.0 {
        old + PULL_RATE_EWMA_WEIGHT * (sample.max(old / 2.0) - old)
    } else {
        sample
    }
}

/// Transfer and lease metrics of one node.
#[derive(Debug)]
pub struct TransferMetrics {
    registry: Registry,
    /// Seconds from first posted read to completion.
    pub transfer_seconds: Histogram,
    /// Seconds spent posting reads.
    pub post_seconds: Histogram,
    /// Bytes pulled.
    pub bytes: IntCounter,
    /// Descriptors (contiguous reads) per transfer.
    pub descriptors: Histogram,
    /// Failed transfers by reason (`peer_unreachable`, `handshake_refused`, `transfer_error`,
    /// `lease_expired`, ...).
    pub failures: IntCounterVec,
    /// Renewals or releases the owner did not acknowledge.
    pub notification_failures: IntCounter,
    /// Side-channel calls refused on this node as owner for lacking the cluster token.
    pub side_channel_refused: IntCounter,
    /// Leases granted / renewed / released / expired on this node as owner; pd-node adds
    /// `gateway_left`: released (also counted in `released`) because the gateway whose request
    /// they were granted for left.
    pub leases: IntCounterVec,
    /// Live leases on this node as owner.
    pub live_leases: IntGauge,
    /// Requests that expected KV from a peer and computed their prompt here instead, by reason
    /// (a failure reason under the `recompute` policy, or `below_threshold`): no silent recompute.
    pub recomputes: IntCounterVec,
    /// Requests whose `kv_transfer_params` asked for a pull but lacked a field (served without a
    /// pull, as vLLM does), by the first missing field.
    pub incomplete_params: IntCounterVec,
    /// Pulls from a peer whose blocks differ from ours in size or order, converted after the
    /// reads (`pd_kv_rechunked_pulls_total`).
    pub rechunked_pulls: IntCounter,
    /// Bytes of mapped-pool copies that the copy helper thread moved
    /// (`pd_kv_copy_helper_bytes_total`; the rest moved on the puller thread).
    pub copy_helper_bytes: IntCounter,
    /// Pulled blocks uploaded into a staged compute pool by the pull as they landed
    /// (`pd_kv_landed_blocks_total`; [`crate::Landing`]).
    pub landed_blocks: IntCounter,
    /// Of those, blocks handed on before their pull's last block was in: the uploads that
    /// overlapped the pull (`pd_kv_landed_early_blocks_total`).
    pub landed_early_blocks: IntCounter,
    /// Bytes per second of this node's pulls: a moving average over pulls of at least
    /// [`PULL_RATE_MIN_BYTES`] (0 until one). Reported to the gateway, so a policy can weigh
    /// pulling a prefix against recomputing it.
    pub pull_bytes_per_second: Gauge,
    /// Seconds a consumer request spends in each stage of its handoff, by `stage`: `wait_blocks`
    /// (arrival to blocks reserved), `prepare` (side-channel client and handshake, cached after
    /// the first), `reads` (handing the pull to the puller to its reads' completion), `confirm`
    /// (the owner's confirm RPC), `first_token` (engine told to decode to the first event
    /// after it). Where D's added time to first token goes.
    pub consume_stage_seconds: HistogramVec,
    /// Leases confirmed for a pull, by how: `board` (the lease's record on the owner's lease
    /// board, read one-sidedly right after the reads, still showing it — with the owner's
    /// `ConfirmLease` alongside the reads, or without it, see `board_alone`) or `rpc`
    /// (`ConfirmLease` after the reads).
    pub confirms: IntCounterVec,
    /// Of the `board` confirmations, those that did not wait for the owner's answer: the
    /// board's beat showed the owner alive a moment before.
    pub board_alone: IntCounter,
    /// Pulls by how the blocks were read: `mapped` (copied from the peer's pool mapped here) or
    /// `get` (UCX gets).
    pub pulls: IntCounterVec,
    /// The path pulls from each peer take (`pd_kv_peer_path_info{peer, transports, via}` = 1):
    /// the endpoint's UCX transports and whether blocks are copied from a mapped pool or read
    /// with gets. Set at scrape time from the puller ([`TransferMetrics::observe_peer_paths`]).
    pub peer_paths: IntGaugeVec,
    last_counts: Mutex<pd_kv_pool::LeaseCounts>,
}

impl TransferMetrics {
    /// Creates and registers every metric.
    pub fn new() -> Self {
        let registry = Registry::new();
        let h = |name: &str, help: &str, buckets: Vec<f64>| {
            let h = Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets))
                .expect("valid histogram");
            registry
                .register(Box::new(h.clone()))
                .expect("unique metric");
            h
        };
        let secs = vec![
            1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0,
        ];
        let transfer_seconds = h(
            "pd_kv_transfer_seconds",
            "Seconds per KV pull",
            secs.clone(),
        );
        let post_seconds = h(
            "pd_kv_transfer_post_seconds",
            "Seconds posting the reads of a KV pull",
            secs,
        );
        let descriptors = h(
            "pd_kv_transfer_descriptors",
            "Contiguous reads per KV pull",
            vec![1.0, 2.0, 4.0, 8.0, 16.0, 64.0, 256.0, 1024.0, 4096.0],
        );
        let bytes =
            IntCounter::new("pd_kv_transfer_bytes_total", "Bytes pulled").expect("valid counter");
        let notification_failures = IntCounter::new(
            "pd_kv_notification_failures_total",
            "Lease renewals or releases not acknowledged",
        )
        .expect("valid counter");
        let side_channel_refused = IntCounter::new(
            "pd_kv_side_channel_refused_total",
            "KV side-channel calls refused for lacking the cluster token",
        )
        .expect("valid counter");
        let failures = IntCounterVec::new(
            Opts::new("pd_kv_transfer_failures_total", "Failed KV pulls by reason"),
            &["reason"],
        )
        .expect("valid counter");
        let leases = IntCounterVec::new(
            Opts::new("pd_kv_leases_total", "Lease events on this node as owner"),
            &["event"],
        )
        .expect("valid counter");
        let recomputes = IntCounterVec::new(
            Opts::new(
                "pd_kv_recompute_total",
                "Requests that expected remote KV and computed the prompt locally, by reason",
            ),
            &["reason"],
        )
        .expect("valid counter");
        let incomplete_params = IntCounterVec::new(
            Opts::new(
                "pd_kv_params_incomplete_total",
                "kv_transfer_params asking for a pull but missing a field (no pull), by field",
            ),
            &["field"],
        )
        .expect("valid counter");
        let rechunked_pulls = IntCounter::new(
            "pd_kv_rechunked_pulls_total",
            "Pulls from a peer whose blocks differ in size or order, converted after the reads",
        )
        .expect("valid counter");
        let copy_helper_bytes = IntCounter::new(
            "pd_kv_copy_helper_bytes_total",
            "Bytes of pulls copied from a peer's mapped pool by the copy helper thread",
        )
        .expect("valid counter");
        let landed_blocks = IntCounter::new(
            "pd_kv_landed_blocks_total",
            "Pulled blocks uploaded into the compute pool by the pull as they landed (staged KV)",
        )
        .expect("valid counter");
        let landed_early_blocks = IntCounter::new(
            "pd_kv_landed_early_blocks_total",
            "Pulled blocks uploaded into the compute pool before their pull's last block was in",
        )
        .expect("valid counter");
        let live_leases = IntGauge::new("pd_kv_leases_live", "Live leases on this node as owner")
            .expect("valid gauge");
        let pull_bytes_per_second = Gauge::new(
            "pd_kv_pull_bytes_per_second",
            "Bytes per second of this node's pulls (moving average)",
        )
        .expect("valid gauge");
        let consume_stage_seconds = HistogramVec::new(
            HistogramOpts::new(
                "pd_kv_consume_stage_seconds",
                "Seconds a consumer request spends in each stage of its KV handoff",
            )
            .buckets(vec![
                2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.05, 0.1, 1.0, 10.0,
            ]),
            &["stage"],
        )
        .expect("valid histogram");
        let confirms = IntCounterVec::new(
            Opts::new(
                "pd_kv_lease_confirms_total",
                "Leases confirmed for a pull, by how (board: the board record after the reads, with the owner's answer alongside them or a recent beat; rpc: confirmed after the reads)",
            ),
            &["via"],
        )
        .expect("valid counter");
        let board_alone = IntCounter::new(
            "pd_kv_lease_board_alone_confirms_total",
            "Leases confirmed on the owner's lease board without waiting for its answer (its board beat a moment before)",
        )
        .expect("valid counter");
        let pulls = IntCounterVec::new(
            Opts::new(
                "pd_kv_pulls_total",
                "KV pulls by how the blocks were read (mapped: copied from the peer's pool mapped here; get: UCX gets; tcp: the owner's TCP data port)",
            ),
            &["via"],
        )
        .expect("valid counter");
        let peer_paths = IntGaugeVec::new(
            Opts::new(
                "pd_kv_peer_path_info",
                "The path pulls from each peer take: its endpoint's UCX transports (transport/device) and how blocks are read (mapped or get)",
            ),
            &["peer", "transports", "via"],
        )
        .expect("valid gauge");
        // Closed label sets start at 0: a dashboard or an alert reads 0, not "no data", before
        // the first event.
        for reason in TransferError::REASONS {
            failures.with_label_values(&[reason]);
            recomputes.with_label_values(&[reason]);
        }
        for reason in RECOMPUTE_REASONS {
            recomputes.with_label_values(&[reason]);
        }
        for via in ["mapped", "get", "tcp"] {
            pulls.with_label_values(&[via]);
        }
        for c in [
            Box::new(consume_stage_seconds.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(peer_paths.clone()),
            Box::new(pulls.clone()),
            Box::new(confirms.clone()),
            Box::new(board_alone.clone()),
            Box::new(bytes.clone()),
            Box::new(notification_failures.clone()),
            Box::new(side_channel_refused.clone()),
            Box::new(failures.clone()),
            Box::new(leases.clone()),
            Box::new(live_leases.clone()),
            Box::new(recomputes.clone()),
            Box::new(incomplete_params.clone()),
            Box::new(rechunked_pulls.clone()),
            Box::new(copy_helper_bytes.clone()),
            Box::new(landed_blocks.clone()),
            Box::new(landed_early_blocks.clone()),
            Box::new(pull_bytes_per_second.clone()),
        ] {
            registry.register(c).expect("unique metric");
        }
        Self {
            registry,
            transfer_seconds,
            post_seconds,
            bytes,
            descriptors,
            failures,
            notification_failures,
            side_channel_refused,
            leases,
            live_leases,
            recomputes,
            incomplete_params,
            rechunked_pulls,
            copy_helper_bytes,
            landed_blocks,
            landed_early_blocks,
            pull_bytes_per_second,
            consume_stage_seconds,
            confirms,
            board_alone,
            pulls,
            peer_paths,
            last_counts: Mutex::new(Default::default()),
        }
    }

    /// Sets `pd_kv_peer_path_info` to `paths` (engine id, path), replacing what it held.
    pub fn observe_peer_paths(&self, paths: &[(String, crate::PeerPath)]) {
        self.peer_paths.reset();
        for (peer, path) in paths {
            self.peer_paths
                .with_label_values(&[peer.as_str(), path.transports.as_str(), path.via])
                .set(1);
        }
    }

    /// The registry, for a `/metrics` endpoint.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Records that a consumer request spent `d` in `stage` (see
    /// [`TransferMetrics::consume_stage_seconds`]).
    pub fn record_stage(&self, stage: &str, d: std::time::Duration) {
        self.consume_stage_seconds
            .with_label_values(&[stage])
            .observe(d.as_secs_f64());
    }

    /// Records a completed pull.
    pub fn record_pull(&self, s: &PullStats) {
        self.transfer_seconds.observe(s.total_time.as_secs_f64());
        let via = match (s.copied, s.tcp) {
            (true, _) => "mapped",
            (false, true) => "tcp",
            (false, false) => "get",
        };
        self.pulls.with_label_values(&[via]).inc();
        self.post_seconds.observe(s.post_time.as_secs_f64());
        self.bytes.inc_by(s.bytes as u64);
        self.copy_helper_bytes.inc_by(s.helper_bytes as u64);
        self.landed_blocks.inc_by(s.landed_blocks as u64);
        self.landed_early_blocks.inc_by(s.landed_early as u64);
        self.descriptors.observe(s.descriptors as f64);
        let secs = s.total_time.as_secs_f64();
        if s.bytes >= PULL_RATE_MIN_BYTES && secs > 0.0 {
            let old = self.pull_bytes_per_second.get();
            self.pull_bytes_per_second
                .set(pull_rate_average(old, s.bytes as f64 / secs));
        }
    }

    /// Records a failed pull by its reason.
    pub fn record_failure(&self, e: &TransferError) {
        self.failures.with_label_values(&[e.reason()]).inc();
    }

    /// Records the pull of one lease as far as it got ([`crate::puller::pull_under_lease_with`]):
    /// its reads' stage, how the lease was confirmed and that stage, and the pull or its
    /// failure.
    pub fn record_lease_pull(
        &self,
        trace: &LeaseTrace,
        result: &Result<crate::puller::LeasePull, TransferError>,
    ) {
        if let Some(d) = trace.reads {
            self.record_stage("reads", d);
        }
        if let Some(via) = trace.confirmed {
            if via == Confirmed::BoardAlone {
                self.board_alone.inc();
            }
            self.confirms.with_label_values(&[via.label()]).inc();
        }
        if let Some(d) = trace.confirm {
            self.record_stage("confirm", d);
        }
        match result {
            Ok(p) => self.record_pull(&p.stats),
            Err(e) => self.record_failure(e),
        }
    }

    /// Brings the owner-side lease metrics up to `stats`.
    pub fn observe_leases(&self, stats: &PoolStats) {
        let mut last = self.last_counts.lock().unwrap_or_else(|p| p.into_inner());
        let c = stats.counts;
        for (event, now, before) in [
            ("granted", c.granted, last.granted),
            ("renewed", c.renewed, last.renewed),
            ("confirmed", c.confirmed, last.confirmed),
            ("released", c.released, last.released),
            ("expired", c.expired, last.expired),
            ("revoked", c.revoked, last.revoked),
        ] {
            self.leases
                .with_label_values(&[event])
                .inc_by(now.saturating_sub(before));
        }
        *last = c;
        self.live_leases.set(stats.live_leases as i64);
    }
}

impl Default for TransferMetrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn lease_counters_follow_the_table_by_deltas() {
        let m = TransferMetrics::new();
        let mut s = PoolStats {
            live_leases: 2,
            ..Default::default()
        };
        s.counts.granted = 3;
        m.observe_leases(&s);
        s.counts.granted = 5;
        s.counts.expired = 1;
        s.live_leases = 1;
        m.observe_leases(&s);
        assert_eq!(m.leases.with_label_values(&["granted"]).get(), 5);
        assert_eq!(m.leases.with_label_values(&["expired"]).get(), 1);
        assert_eq!(m.live_leases.get(), 1);
        let text = prometheus::TextEncoder::new()
            .encode_to_string(&m.registry().gather())
            .unwrap();
        assert!(
            text.contains("pd_kv_leases_total{event=\"granted\"} 5"),
            "{text}"
        );
    }

    /// Closed label sets are exported at 0 before their first event.
    #[test]
    fn reasons_and_transports_start_at_zero() {
        let m = TransferMetrics::new();
        let text = prometheus::TextEncoder::new()
            .encode_to_string(&m.registry().gather())
            .unwrap();
        for reason in TransferError::REASONS {
            for name in ["pd_kv_transfer_failures_total", "pd_kv_recompute_total"] {
                let sample = format!("{name}{{reason=\"{reason}\"}} 0");
                assert!(text.contains(&sample), "no {sample} in:\n{text}");
            }
        }
        for sample in [
            r#"pd_kv_recompute_total{reason="below_threshold"} 0"#,
            r#"pd_kv_recompute_total{reason="peer_not_allowed"} 0"#,
            r#"pd_kv_pulls_total{via="mapped"} 0"#,
            r#"pd_kv_pulls_total{via="tcp"} 0"#,
        ] {
            assert!(text.contains(sample), "no {sample} in:\n{text}");
        }
    }

    /// Small pulls do not move the average; a slow outlier halves it at most; fast samples
    /// move it by the average's weight.
    #[test]
    fn the_pull_rate_ignores_small_pulls_and_survives_an_outlier() {
        let m = TransferMetrics::new();
        let pull = |bytes: usize, ms: u64| PullStats {
            bytes,
            descriptors: 1,
            post_time: Duration::ZERO,
            total_time: Duration::from_millis(ms),
            copied: true,
            tcp: false,
            helper_bytes: 0,
            landed_blocks: 0,
            landed_early: 0,
        };
        // Two blocks, preempted: 1 MB/s would make every later pull look 5000x too slow.
        m.record_pull(&pull(2 << 20, 2000));
        assert_eq!(m.pull_bytes_per_second.get(), 0.0);
        m.record_pull(&pull(8 << 20, 1));
        let first = m.pull_bytes_per_second.get();
        assert_eq!(first, f64::from(8u32 << 20) * 1e3);
        // An outlier 1000x slower: the sample counts at half the average, no lower.
        m.record_pull(&pull(8 << 20, 1000));
        let after = m.pull_bytes_per_second.get();
        assert!(
            (after - first * (1.0 - PULL_RATE_EWMA_WEIGHT / 2.0)).abs() < 1.0,
            "{after}"
        );
        assert_eq!(pull_rate_average(100.0, 200.0), 120.0);
        assert_eq!(pull_rate_average(100.0, 10.0), 90.0);
        assert_eq!(pull_rate_average(0.0, 10.0), 10.0);
    }
}
