//! The owner's clock as a consumer sees it: the owner states its monotonic clock in the
//! handshake, and the beat on its lease board is a reading of that clock (its latest grant). A
//! consumer that maps the board judges how long ago the owner was alive by comparing the beat
//! with its estimate of the owner's clock now.
//!
//! Both clocks are `CLOCK_MONOTONIC` of one host (a board is only mapped on the same host), so
//! they tick together; the offset the handshake measures covers time namespaces, where two
//! processes of one host read different values.

use std::time::Duration;

/// This process's `CLOCK_MONOTONIC`, nanoseconds (the clock `std::time::Instant` uses on Linux).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write; CLOCK_MONOTONIC always exists on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    if rc != 0 {
        return 0;
    }
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

/// The owner's clock, as the offset from ours measured at the handshake.
///
/// The offset is the owner's reading minus our clock when we *sent* the handshake, so our
/// estimate of the owner's clock never runs behind the real one (it may run ahead by the
/// handshake's round trip): a beat never looks younger than it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OwnerClock {
    offset_ns: i128,
}

impl OwnerClock {
    /// This process's own clock ([`monotonic_ns`]), as an owner states it.
    pub fn local() -> Self {
        Self { offset_ns: 0 }
    }

    /// From the owner's reading `owner_ns` (0: the owner states no clock) and our clock
    /// `sent_ns` when we asked.
    pub fn from_handshake(owner_ns: u64, sent_ns: u64) -> Option<Self> {
        (owner_ns != 0).then(|| Self {
            offset_ns: i128::from(owner_ns) - i128::from(sent_ns),
        })
    }

    /// How long before our `now_ns` the owner's clock read `beat_ns`; `None` for no beat (0) or
    /// one our estimate puts in the future (the clocks disagree: trust neither).
    pub fn age(&self, beat_ns: u64, now_ns: u64) -> Option<Duration> {
        if beat_ns == 0 {
            return None;
        }
        let age = i128::from(now_ns) + self.offset_ns - i128::from(beat_ns);
        u64::try_from(age).ok().map(Duration::from_nanos)
    }

    /// Whether the owner's clock has not yet reached `deadline_ns` (by our estimate, which may
    /// run ahead: a deadline never looks further away than it is).
    pub fn before(&self, deadline_ns: u64) -> bool {
        self.before_at(deadline_ns, monotonic_ns())
    }

    /// [`OwnerClock::before`] at our clock's reading `now_ns`.
    pub fn before_at(&self, deadline_ns: u64, now_ns: u64) -> bool {
        i128::from(now_ns) + self.offset_ns < i128::from(deadline_ns)
    }

    /// Whether the owner beat at most `within` before now.
    pub fn beat_within(&self, beat_ns: u64, within: Duration) -> bool {
        self.age(beat_ns, monotonic_ns())
            .is_some_and(|age| age <= within)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_are_measured_on_the_owners_clock_and_never_negative() {
        // The owner's clock reads 1 s ahead of ours; it answered 2 ms after we asked.
        let clock = OwnerClock::from_handshake(1_002_000_000 + 500, 500).unwrap();
        // A beat the owner wrote at its 1.010 s, seen at our 0.015 s (its ~1.015 s): ~5 ms old,
        // or up to the handshake's 2 ms older by our estimate.
        let age = clock.age(1_010_000_000, 15_000_000).unwrap();
        assert_eq!(age, Duration::from_millis(7));
        assert_eq!(clock.age(0, 15_000_000), None, "never beat");
        assert_eq!(clock.age(2_000_000_000, 15_000_000), None, "in the future");
        assert_eq!(OwnerClock::from_handshake(0, 5), None, "no clock stated");
        let mono = monotonic_ns();
        assert!(mono > 0 && monotonic_ns() >= mono);
        let here = OwnerClock::local();
        assert!(here.beat_within(monotonic_ns(), Duration::from_secs(1)));
        assert!(!here.beat_within(1, Duration::from_secs(1)));
        assert!(here.before(u64::MAX));
        assert!(!here.before(monotonic_ns()));
    }
}
