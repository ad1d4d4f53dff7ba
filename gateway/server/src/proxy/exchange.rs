//! [`Exchange`]: one request's state from its first phase to `logging` (pingora's `CTX`):
//! what was read and decided ([`Prepared`](super::prepare::Prepared)), and what happened since
//! ([`Progress`]: time spent waiting on nodes, the first byte, what was taken from the answer).

use std::time::{Duration, Instant};

use pd_policy::Api;

use super::prepare::Prepared;
use crate::answer::Captured;
use crate::metrics::Metrics;
use crate::openai;

/// How a generation request ended, when it did not fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outcome {
    Ok,
    /// The client left; whatever was in flight was cancelled.
    Aborted,
}

/// Time spent waiting on nodes, subtracted from end-to-end time for the added-latency metric.
#[derive(Debug)]
pub(super) struct Timing {
    pub(super) start: Instant,
    pub(super) waiting: Duration,
    pub(super) first_byte: Option<Instant>,
    /// When routing was decided (nothing before it waits on nodes).
    pub(super) prepared: Option<Instant>,
}

impl Timing {
    /// Awaits `fut`, counting the time as waiting on the cluster.
    pub(super) async fn wait<T>(&mut self, fut: impl std::future::Future<Output = T>) -> T {
        let t = Instant::now();
        let out = fut.await;
        self.waiting += t.elapsed();
        out
    }

    /// The first byte reached the client (now, unless earlier).
    pub(super) fn answered(&mut self) {
        self.first_byte.get_or_insert_with(Instant::now);
    }
}

/// What happened to a request since it was prepared.
#[derive(Debug)]
pub(super) struct Progress {
    pub(super) timing: Timing,
    /// What was taken from the answer (a retained turn's params, a response object).
    pub(super) captured: Captured,
    /// An event stream's head went out: an error from now on is its last event.
    pub(super) streaming: bool,
    /// The `/v1/responses` turn was stored before the answer's end went out
    /// ([`super::Gateway::keep_turn_now`]).
    pub(super) turn_kept: bool,
    /// The decode node said it could not reach the producer whose lease it was given: the
    /// gateway releases that lease itself once the answer is done.
    pub(super) lease_left: bool,
    /// The status of the node's answer relayed to the client (0: none yet).
    pub(super) relayed: u16,
}

/// One request, as pingora's per-request context.
#[derive(Debug)]
pub struct Exchange {
    /// The generation API, for generation requests (the others record no request metrics).
    pub(super) api: Option<Api>,
    /// The `outcome` label of the request counter, once it ended.
    pub(super) outcome: Option<&'static str>,
    /// What was read and decided, once prepared.
    pub(super) request: Option<Prepared>,
    pub(super) progress: Progress,
}

impl Exchange {
    /// A request just arrived.
    pub(super) fn new() -> Self {
        Self {
            api: None,
            outcome: None,
            request: None,
            progress: Progress {
                timing: Timing {
                    start: Instant::now(),
                    waiting: Duration::ZERO,
                    first_byte: None,
                    prepared: None,
                },
                captured: Captured::default(),
                streaming: false,
                turn_kept: false,
                lease_left: false,
                relayed: 0,
            },
        }
    }

    /// The request's metrics: its count by outcome, end-to-end time, time to first byte, the
    /// gateway's own (added) time and the `respond` phase.
    pub(super) fn record(&self, m: &Metrics) {
        let (Some(api), Some(outcome)) = (self.api, self.outcome) else {
            return;
        };
        let label = openai::api_label(api);
        let t = &self.progress.timing;
        m.requests.with_label_values(&[label, outcome]).inc();
        let e2e = t.start.elapsed();
        m.e2e.with_label_values(&[label]).observe(e2e.as_secs_f64());
        if let Some(first) = t.first_byte {
            let ttfb = (first - t.start).as_secs_f64();
            m.ttft.with_label_values(&[label]).observe(ttfb);
            // How a retained turn this request continues was used.
            if let Some(how) = self.request.as_ref().and_then(|r| r.continued) {
                m.continued_ttft.with_label_values(&[how]).observe(ttfb);
            }
        }
        let own = e2e.saturating_sub(t.waiting);
        m.added
            .with_label_values(&[label])
            .observe(own.as_secs_f64());
        if let Some(p) = t.prepared {
            m.phase
                .with_label_values(&["respond"])
                .observe(own.saturating_sub(p - t.start).as_secs_f64());
        }
    }
}

/// Laps of the gateway's own phases, into `pd_gateway_phase_seconds{phase}`.
pub(super) struct PhaseClock<'a> {
    metrics: &'a Metrics,
    last: Instant,
}

impl<'a> PhaseClock<'a> {
    pub(super) fn new(metrics: &'a Metrics) -> Self {
        Self {
            metrics,
            last: Instant::now(),
        }
    }

    pub(super) fn lap(&mut self, phase: &'static str) {
        let now = Instant::now();
        self.metrics
            .phase
            .with_label_values(&[phase])
            .observe((now - self.last).as_secs_f64());
        self.last = now;
    }
}
