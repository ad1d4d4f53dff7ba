//! Admission at the front door: at most `max_in_flight` generation requests are served at once,
//! up to `max_queued` more wait their turn (first come, first served) for at most
//! `queue_timeout`, and the rest are refused at once with a 429 the OpenAI SDKs retry with
//! backoff. This bounds what a burst of clients can make the cluster hold (queued requests,
//! their blocks, P's leases) and the gateway hold (bodies are read only by requests with a
//! place) instead of letting every node's queue grow without limit. On by default:
//! [`DEFAULT_MAX_CONCURRENT`] at once; `--max-concurrent-requests 0` lifts the limit.
//!
//! This module only counts and waits; the proxy decides what is a generation request and
//! answers the refusal.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Requests served at once by default: a fixed number, not one from the gateway's CPU count
/// (the gateway's work per request is small; the limit guards the nodes' queues and the
/// gateway's memory), a few full batches of a typical node.
pub const DEFAULT_MAX_CONCURRENT: usize = 256;

/// The limit and the waiting line.
#[derive(Debug)]
pub struct Admission {
    /// `None`: unlimited.
    permits: Option<Arc<Semaphore>>,
    max_in_flight: usize,
    queued: AtomicUsize,
    max_queued: usize,
    queue_timeout: Duration,
}

/// A request's place among those served; dropping it lets the next one in.
#[derive(Debug)]
pub struct Admitted {
    _permit: Option<OwnedSemaphorePermit>,
}

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Every slot busy and the waiting line full.
    QueueFull,
    /// It waited `queue_timeout` without a slot freeing up.
    QueueTimeout,
}

impl Refused {
    /// The `reason` label of `pd_gateway_admission_refused_total`.
    pub fn label(self) -> &'static str {
        match self {
            Self::QueueFull => "queue_full",
            Self::QueueTimeout => "queue_timeout",
        }
    }
}

impl Admission {
    /// No limit: every request is admitted at once.
    pub fn unlimited() -> Self {
        Self {
            permits: None,
            max_in_flight: 0,
            queued: AtomicUsize::new(0),
            max_queued: 0,
            queue_timeout: Duration::ZERO,
        }
    }

    /// At most `max_in_flight` served at once (0: unlimited), `max_queued` waiting for at most
    /// `queue_timeout` each.
    pub fn new(max_in_flight: usize, max_queued: usize, queue_timeout: Duration) -> Self {
        if max_in_flight == 0 {
            return Self::unlimited();
        }
        Self {
            permits: Some(Arc::new(Semaphore::new(max_in_flight))),
            max_in_flight,
            queued: AtomicUsize::new(0),
            max_queued,
            queue_timeout,
        }
    }

    /// Waits for a slot, or says why the request gets none.
    pub async fn admit(&self) -> Result<Admitted, Refused> {
        self.admit_weighted(1).await
    }

    /// Waits for `weight` slots at once (a completions request listing several prompts is as
    /// many requests; at most every slot, so a large one still gets in alone), or says why the
    /// request gets none.
    pub async fn admit_weighted(&self, weight: usize) -> Result<Admitted, Refused> {
        let Some(permits) = &self.permits else {
            return Ok(Admitted { _permit: None });
        };
        let weight = u32::try_from(weight.clamp(1, self.max_in_flight)).unwrap_or(u32::MAX);
        // Free slots go to the queue's head first (tokio's semaphore is fair), so this only
        // succeeds when nobody is waiting.
        if let Ok(p) = permits.clone().try_acquire_many_owned(weight) {
            return Ok(Admitted { _permit: Some(p) });
        }
        if self.queued.fetch_add(1, Ordering::AcqRel) >= self.max_queued {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            return Err(Refused::QueueFull);
        }
        let _in_line = InLine(&self.queued);
        match tokio::time::timeout(
            self.queue_timeout,
            permits.clone().acquire_many_owned(weight),
        )
        .await
        {
            Ok(Ok(p)) => Ok(Admitted { _permit: Some(p) }),
            // (The semaphore is never closed.)
            Ok(Err(_)) | Err(_) => Err(Refused::QueueTimeout),
        }
    }

    /// Waits for `extra` more slots for a request that already holds one (a completions
    /// request found, once its body is read, to list several prompts); at most every slot but
    /// the one held, so it cannot wait for itself.
    pub async fn admit_more(&self, extra: usize) -> Result<Admitted, Refused> {
        if extra == 0 || self.max_in_flight <= 1 {
            return Ok(Admitted { _permit: None });
        }
        self.admit_weighted(extra.min(self.max_in_flight - 1)).await
    }

    /// Whether a limit is set.
    pub fn limited(&self) -> bool {
        self.permits.is_some()
    }

    /// Requests being served now (0 when unlimited: not tracked).
    pub fn in_flight(&self) -> usize {
        self.permits
            .as_ref()
            .map_or(0, |p| self.max_in_flight - p.available_permits())
    }

    /// Requests waiting for a slot now.
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::Acquire)
    }
}

/// One place in the waiting line, given up however the wait ends (a slot, the timeout, or the
/// waiting task dropped).
struct InLine<'a>(&'a AtomicUsize);

impl Drop for InLine<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn until_queued(a: &Admission, n: usize) {
        while a.queued() != n {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn serves_the_limit_queues_the_line_and_refuses_the_rest() {
        let a = Arc::new(Admission::new(2, 1, Duration::from_millis(200)));
        let first = a.admit().await.unwrap();
        let _second = a.admit().await.unwrap();
        assert_eq!(a.in_flight(), 2);
        // The third waits in line; the fourth finds the line full.
        let waiting = tokio::spawn({
            let a = a.clone();
            async move { a.admit().await.map(|_| ()) }
        });
        until_queued(&a, 1).await;
        assert_eq!(a.admit().await.unwrap_err(), Refused::QueueFull);
        // A slot freed goes to the one in line.
        drop(first);
        assert_eq!(waiting.await.unwrap(), Ok(()));
        assert_eq!(a.queued(), 0);
        // In line with every slot busy until the timeout: refused, and the line is empty again.
        let _third = a.admit().await.unwrap();
        let late = tokio::spawn({
            let a = a.clone();
            async move { a.admit().await.map(|_| ()) }
        });
        until_queued(&a, 1).await;
        assert_eq!(late.await.unwrap(), Err(Refused::QueueTimeout));
        assert_eq!(a.queued(), 0);
    }

    #[tokio::test]
    async fn a_weighted_request_takes_its_slots_and_waits_for_them() {
        let a = Arc::new(Admission::new(4, 2, Duration::from_millis(200)));
        let one = a.admit().await.unwrap();
        let three = a.admit_weighted(3).await.unwrap();
        assert_eq!(a.in_flight(), 4);
        // More than every slot: it waits for all of them, not forever.
        let big = tokio::spawn({
            let a = a.clone();
            async move { a.admit_weighted(100).await.map(|p| (p, a.in_flight())) }
        });
        until_queued(&a, 1).await;
        drop(one);
        tokio::task::yield_now().await;
        assert_eq!(a.queued(), 1, "one slot free is not enough");
        drop(three);
        let (held, in_flight) = big.await.unwrap().unwrap();
        assert_eq!(in_flight, 4);
        drop(held);
        assert_eq!(a.in_flight(), 0);
    }

    #[tokio::test]
    async fn more_slots_never_wait_for_the_one_held() {
        let a = Admission::new(3, 2, Duration::from_millis(100));
        let first = a.admit().await.unwrap();
        let more = a.admit_more(10).await.unwrap();
        assert_eq!(a.in_flight(), 3);
        drop((first, more));
        assert_eq!(a.in_flight(), 0);
    }

    #[tokio::test]
    async fn unlimited_admits_everyone() {
        let a = Admission::new(0, 0, Duration::ZERO);
        let held: Vec<_> = futures_admit_all(&a, 100).await;
        assert_eq!(held.len(), 100);
        assert_eq!((a.in_flight(), a.queued()), (0, 0));
    }

    async fn futures_admit_all(a: &Admission, n: usize) -> Vec<Admitted> {
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(a.admit().await.unwrap());
        }
        out
    }
}
