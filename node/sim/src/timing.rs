//! The timing model: how long a simulated node takes to prefill, pull and decode.
//!
//! Sans-IO: durations from token counts, nothing waits here. A rate of 0 means "instant", so a
//! fleet with every rate at 0 measures only the gateway and the protocol.

use std::time::Duration;

/// The rates a simulated node serves at. Requests do not slow each other (no batching model):
/// the simulator measures routers, not engines.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    /// Prompt tokens computed per second (0: prefill is instant).
    pub prefill_tokens_per_s: f64,
    /// Time per output token after the first.
    pub tpot: Duration,
    /// KV pull bandwidth, MB/s (10^6 bytes; 0: pulls are instant).
    pub pull_mb_per_s: f64,
    /// KV bytes per prompt token (what a pull moves).
    pub kv_bytes_per_token: u32,
}

impl Default for Timing {
    /// Roughly the tiny model on this project's 2-core VM: 20 000 prompt tokens/s, 5 ms per
    /// output token, 1 000 MB/s pulls of 4 KiB per token.
    fn default() -> Self {
        Self {
            prefill_tokens_per_s: 20_000.0,
            tpot: Duration::from_millis(5),
            pull_mb_per_s: 1_000.0,
            kv_bytes_per_token: 4096,
        }
    }
}

impl Timing {
    /// Every phase instant: only the gateway's and the wire's own costs remain.
    pub const INSTANT: Timing = Timing {
        prefill_tokens_per_s: 0.0,
        tpot: Duration::ZERO,
        pull_mb_per_s: 0.0,
        kv_bytes_per_token: 4096,
    };

    /// Computing `tokens` prompt tokens.
    pub fn prefill(&self, tokens: usize) -> Duration {
        per_second(tokens as f64, self.prefill_tokens_per_s)
    }

    /// Pulling the KV of `tokens` prompt tokens from a peer.
    pub fn pull(&self, tokens: usize) -> Duration {
        let bytes = tokens as f64 * f64::from(self.kv_bytes_per_token);
        per_second(bytes, self.pull_mb_per_s * 1e6)
    }

    /// The gap before output token `k` (0-based) once the prompt is in: none before the first.
    pub fn before_token(&self, k: usize) -> Duration {
        if k == 0 { Duration::ZERO } else { self.tpot }
    }

    /// KV bytes of `tokens` prompt tokens.
    pub fn kv_bytes(&self, tokens: usize) -> u64 {
        tokens as u64 * u64::from(self.kv_bytes_per_token)
    }
}

fn per_second(amount: f64, rate: f64) -> Duration {
    if rate <= 0.0 || amount <= 0.0 {
        return Duration::ZERO;
    }
    Duration::from_secs_f64(amount / rate)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_follow_the_rates() {
        let t = Timing {
            prefill_tokens_per_s: 1000.0,
            tpot: Duration::from_millis(7),
            pull_mb_per_s: 2.0,
            kv_bytes_per_token: 1000,
        };
        assert_eq!(t.prefill(500), Duration::from_millis(500));
        // 1 000 tokens × 1 000 B = 1 MB at 2 MB/s.
        assert_eq!(t.pull(1000), Duration::from_millis(500));
        assert_eq!(t.before_token(0), Duration::ZERO);
        assert_eq!(t.before_token(3), Duration::from_millis(7));
        assert_eq!(t.kv_bytes(3), 3000);
    }

    #[test]
    fn a_zero_rate_is_instant() {
        let t = Timing::INSTANT;
        assert_eq!(t.prefill(1 << 20), Duration::ZERO);
        assert_eq!(t.pull(1 << 20), Duration::ZERO);
        assert_eq!(t.before_token(5), Duration::ZERO);
    }
}
