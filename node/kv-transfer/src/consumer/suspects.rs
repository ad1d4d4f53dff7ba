//! Producers this consumer could not reach lately (a pull ran past its deadline, or the
//! connection was refused): for a cool-off after such a failure, requests whose KV is there
//! compute their prompt instead of waiting out another deadline — where the failure policy
//! would recompute anyway, so only the cost changes, never the tokens. One request at a time
//! probes a suspect once its cool-off passed: a pull that succeeds (or fails for a reason that
//! says nothing about reaching the producer) clears it, one that fails the same way arms the
//! cool-off again. Decides without IO; [`super::Consumer`] asks and reports.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::peer::TransferError;

/// Producers remembered at most; beyond, the one whose cool-off ends first is forgotten.
pub const MAX_SUSPECTS: usize = 64;

/// What to do with a pull from a producer ([`Suspects::check`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Pull: nothing against the producer.
    Pull,
    /// Pull as the one probe of a suspect (report how it went).
    Probe,
    /// Do not pull: compute the prompt.
    Skip,
}

#[derive(Debug, Clone, Copy)]
struct Suspect {
    until: Instant,
    probing: bool,
}

/// Suspect producers by side-channel address.
#[derive(Debug)]
pub struct Suspects {
    cool_off: Duration,
    peers: HashMap<String, Suspect>,
}

/// Whether `e` says the producer could not be reached (not: what it answered).
pub fn unreachable(e: &TransferError) -> bool {
    matches!(e.reason(), "deadline" | "peer_unreachable")
}

impl Suspects {
    /// Suspects kept `cool_off` after each failure.
    pub fn new(cool_off: Duration) -> Self {
        Self {
            cool_off,
            peers: HashMap::new(),
        }
    }

    /// Whether to pull from `peer` at `now`.
    pub fn check(&mut self, peer: &str, now: Instant) -> Verdict {
        match self.peers.get_mut(peer) {
            None => Verdict::Pull,
            Some(s) if s.probing || now < s.until => Verdict::Skip,
            Some(s) => {
                s.probing = true;
                Verdict::Probe
            }
        }
    }

    /// A pull from `peer` ended at `now` with `result`; `probe`: it was the probe.
    pub fn ended(&mut self, peer: &str, now: Instant, result: Result<(), &TransferError>) {
        match result {
            Err(e) if unreachable(e) => {
                if self.peers.len() >= MAX_SUSPECTS && !self.peers.contains_key(peer) {
                    let first = self
                        .peers
                        .iter()
                        .min_by_key(|(_, s)| s.until)
                        .map(|(p, _)| p.clone());
                    if let Some(p) = first {
                        self.peers.remove(&p);
                    }
                }
                self.peers.insert(
                    peer.to_owned(),
                    Suspect {
                        until: now + self.cool_off,
                        probing: false,
                    },
                );
            }
            _ => {
                self.peers.remove(peer);
            }
        }
    }

    /// The probe of `peer` ended without an answer either way (its request was cancelled):
    /// the next request probes.
    pub fn probe_abandoned(&mut self, peer: &str) {
        if let Some(s) = self.peers.get_mut(peer) {
            s.probing = false;
        }
    }

    /// The suspect producers' side channels.
    pub fn peers(&self) -> Vec<String> {
        self.peers.keys().cloned().collect()
    }

    /// How many producers are suspect now.
    pub fn len(&self) -> usize {
        self.peers.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.peers.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: &str = "10.0.0.1:5000";

    fn deadline() -> TransferError {
        TransferError::Deadline("no answer".into())
    }

    #[test]
    fn an_unreachable_producer_is_skipped_until_its_cool_off_then_probed_once() {
        let t0 = Instant::now();
        let cool = Duration::from_secs(2);
        let mut s = Suspects::new(cool);
        assert_eq!(s.check(P, t0), Verdict::Pull);
        s.ended(P, t0, Err(&deadline()));
        assert_eq!(s.check(P, t0 + Duration::from_millis(10)), Verdict::Skip);
        assert_eq!(
            s.check("10.0.0.2:5000", t0),
            Verdict::Pull,
            "others untouched"
        );
        // Past the cool-off: one probe, the others still skip while it runs.
        assert_eq!(s.check(P, t0 + cool), Verdict::Probe);
        assert_eq!(s.check(P, t0 + cool), Verdict::Skip);
        // The probe fails the same way: cool-off again.
        s.ended(P, t0 + cool, Err(&deadline()));
        assert_eq!(
            s.check(P, t0 + cool + Duration::from_millis(10)),
            Verdict::Skip
        );
        assert_eq!(s.check(P, t0 + cool * 2), Verdict::Probe);
        // It succeeds: cleared.
        s.ended(P, t0 + cool * 2, Ok(()));
        assert_eq!(s.check(P, t0 + cool * 2), Verdict::Pull);
        assert!(s.is_empty());
    }

    #[test]
    fn only_failures_to_reach_the_producer_make_it_suspect() {
        let t0 = Instant::now();
        let mut s = Suspects::new(Duration::from_secs(2));
        let refused = TransferError::PeerUnreachable {
            addr: P.into(),
            message: "connection refused".into(),
        };
        s.ended(P, t0, Err(&refused));
        assert_eq!(s.check(P, t0), Verdict::Skip);
        // It answered (the lease was gone): reachable, cleared.
        let lost = TransferError::LeaseLost {
            lease: "1".into(),
            reason: "expired".into(),
        };
        s.ended(P, t0, Err(&lost));
        assert_eq!(s.check(P, t0), Verdict::Pull);
    }

    #[test]
    fn an_abandoned_probe_lets_the_next_request_probe() {
        let t0 = Instant::now();
        let cool = Duration::from_secs(1);
        let mut s = Suspects::new(cool);
        s.ended(P, t0, Err(&deadline()));
        assert_eq!(s.check(P, t0 + cool), Verdict::Probe);
        s.probe_abandoned(P);
        assert_eq!(s.check(P, t0 + cool), Verdict::Probe);
    }

    #[test]
    fn at_most_so_many_are_remembered() {
        let t0 = Instant::now();
        let mut s = Suspects::new(Duration::from_secs(1));
        for i in 0..(MAX_SUSPECTS + 10) {
            s.ended(
                &format!("10.0.{i}.1:1"),
                t0 + Duration::from_millis(i as u64),
                Err(&deadline()),
            );
        }
        assert_eq!(s.len(), MAX_SUSPECTS);
        assert_eq!(
            s.check("10.0.0.1:1", t0),
            Verdict::Pull,
            "the first forgotten"
        );
    }
}
