//! The reconnect delay.

use std::time::Duration;

use rand::Rng;

/// Exponential backoff with jitter: `initial`, doubling up to `max`; each delay is drawn from
/// `[d/2, d]` so that nodes restarted together do not reconnect in lockstep.
#[derive(Debug)]
pub(crate) struct Backoff {
    initial: Duration,
    max: Duration,
    next: Duration,
    /// Delays handed out since the last reset.
    pub(crate) attempts: u32,
}

impl Backoff {
    pub(crate) fn new(initial: Duration, max: Duration) -> Self {
        let initial = initial.max(Duration::from_millis(1));
        Self {
            initial,
            max: max.max(initial),
            next: initial,
            attempts: 0,
        }
    }

    pub(crate) fn next_delay(&mut self) -> Duration {
        let d = self.next;
        self.next = (d * 2).min(self.max);
        self.attempts += 1;
        let half = d / 2;
        half + rand::rng().random_range(Duration::ZERO..=d - half)
    }

    pub(crate) fn reset(&mut self) {
        self.next = self.initial;
        self.attempts = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_the_cap_with_jitter_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(400));
        let bounds = [(50, 100), (100, 200), (200, 400), (200, 400), (200, 400)];
        for (lo, hi) in bounds {
            let d = b.next_delay();
            assert!(
                d >= Duration::from_millis(lo) && d <= Duration::from_millis(hi),
                "{d:?} not in [{lo}, {hi}] ms"
            );
        }
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }
}
