//! Which producers a consumer may contact. `remote_host` comes from the request, so a node
//! reachable by untrusted clients must restrict it (vLLM #47843 was an SSRF through it): the
//! consumer checks every producer a request names before anything is contacted — not even to
//! release its lease.

use tokio::sync::watch;

/// The producers a consumer may contact: `--kv-allowed-peers`, plus, on a node reporting to a
/// gateway, the KV side channels of the gateway's latest `PeerList` (swapped in by the reporter
/// as lists arrive; read on every request).
///
/// - No gateway: the static list; empty allows any producer (the behaviour before gateways).
/// - A gateway: the static list *or* the gateway's list; with an empty static list only the
///   gateway's, and before the gateway sent one, none.
#[derive(Debug, Clone, Default)]
pub struct AllowedPeers {
    /// `--kv-allowed-peers`: `host` or `host:port` (IPv6 in brackets).
    pub fixed: Vec<String>,
    /// The gateway's peer list (`host:port` each; `pd_report::ReporterHandle::peers`), when the
    /// node reports to a gateway: `None` inside until the first list arrives.
    pub gateway: Option<watch::Receiver<Option<Vec<String>>>>,
}

/// Why a producer may not be contacted (the message is for the client).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PeerRefused {
    /// Not in `--kv-allowed-peers`, on a node without a gateway.
    #[error("{0} is not an allowed KV peer of this node (--kv-allowed-peers)")]
    NotAllowed(String),
    /// Not in the gateway's list (nor in `--kv-allowed-peers` when there is one).
    #[error("{addr} is not a KV peer registered with the gateway{nor_fixed}")]
    NotRegistered {
        /// `host:port`.
        addr: String,
        /// ` nor in --kv-allowed-peers` where a static list is set, else empty.
        nor_fixed: &'static str,
    },
    /// The gateway has not sent its list yet.
    #[error(
        "{addr} is not an allowed KV peer: this node is not registered with the gateway yet \
         (no KV peer list received){nor_fixed}"
    )]
    NoListYet {
        /// `host:port`.
        addr: String,
        /// As in [`PeerRefused::NotRegistered`].
        nor_fixed: &'static str,
    },
}

impl AllowedPeers {
    /// Only `--kv-allowed-peers` (no gateway).
    pub fn fixed(peers: Vec<String>) -> Self {
        Self {
            fixed: peers,
            gateway: None,
        }
    }

    /// `Ok` when the producer at `host:port` may be contacted; otherwise why not.
    ///
    /// # Errors
    /// [`PeerRefused`].
    pub fn check(&self, host: &str, port: u16) -> Result<(), PeerRefused> {
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let listed = |list: &[String]| list.iter().any(|a| peer_matches(a, host, port));
        if listed(&self.fixed) {
            return Ok(());
        }
        let addr = format!("{host}:{port}");
        let Some(gateway) = &self.gateway else {
            if self.fixed.is_empty() {
                return Ok(());
            }
            return Err(PeerRefused::NotAllowed(addr));
        };
        let nor_fixed = if self.fixed.is_empty() {
            ""
        } else {
            " nor in --kv-allowed-peers"
        };
        match &*gateway.borrow() {
            Some(peers) if listed(peers) => Ok(()),
            Some(_) => Err(PeerRefused::NotRegistered { addr, nor_fixed }),
            None => Err(PeerRefused::NoListYet { addr, nor_fixed }),
        }
    }

    /// Whether `host:port` may be contacted (see [`AllowedPeers::check`]).
    pub fn allows(&self, host: &str, port: u16) -> bool {
        self.check(host, port).is_ok()
    }
}

/// Whether the allow-list entry `entry` (`host` or `host:port`, IPv6 in brackets) names
/// `host:port` (`host` without brackets).
fn peer_matches(entry: &str, host: &str, port: u16) -> bool {
    let entry = entry.trim();
    match entry
        .rsplit_once(':')
        .filter(|(h, p)| !h.ends_with(':') && p.parse::<u16>().is_ok())
    {
        Some((h, p)) => {
            h.trim_start_matches('[').trim_end_matches(']') == host
                && p.parse::<u16>().ok() == Some(port)
        }
        None => entry.trim_start_matches('[').trim_end_matches(']') == host,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixed(allowed: &[&str]) -> AllowedPeers {
        AllowedPeers::fixed(allowed.iter().map(|s| s.to_string()).collect())
    }

    #[test]
    fn allowed_peers_match_host_or_host_and_port() {
        assert!(fixed(&[]).allows("anything", 1));
        let c = fixed(&["10.0.0.1", "p2.local:9100", "[::1]:7000"]);
        assert!(c.allows("10.0.0.1", 5));
        assert!(c.allows("p2.local", 9100));
        assert!(!c.allows("p2.local", 9101));
        assert!(c.allows("::1", 7000));
        assert!(c.allows("[::1]", 7000));
        assert!(!c.allows("::1", 7001));
        assert!(!c.allows("169.254.169.254", 80));
        let e = c.check("169.254.169.254", 80).unwrap_err().to_string();
        assert!(e.contains("--kv-allowed-peers"), "{e}");
        assert!(e.starts_with("169.254.169.254:80 is not"), "{e}");
    }

    #[test]
    fn with_a_gateway_only_its_peers_and_the_static_ones_are_allowed() {
        let (tx, rx) = watch::channel(None);
        let gw = AllowedPeers {
            fixed: Vec::new(),
            gateway: Some(rx.clone()),
        };
        // Before the first list: nobody, with a message saying why.
        let e = gw.check("10.0.0.1", 9000).unwrap_err().to_string();
        assert!(e.contains("not registered with the gateway"), "{e}");

        tx.send_replace(Some(vec!["10.0.0.1:9000".into(), "[::1]:7000".into()]));
        assert!(gw.check("10.0.0.1", 9000).is_ok());
        assert!(gw.check("[::1]", 7000).is_ok());
        let e = gw.check("10.0.0.1", 9001).unwrap_err().to_string();
        assert!(
            e.contains("not a KV peer registered with the gateway"),
            "{e}"
        );
        assert!(gw.check("169.254.169.254", 80).is_err());

        // A new list replaces the old one.
        tx.send_replace(Some(vec!["10.0.0.2:9000".into()]));
        assert!(gw.check("10.0.0.1", 9000).is_err());
        assert!(gw.check("10.0.0.2", 9000).is_ok());

        // Static peers are allowed besides the gateway's, even before its first list.
        let (tx, rx) = watch::channel(None);
        let both = AllowedPeers {
            fixed: vec!["p.local".into()],
            gateway: Some(rx),
        };
        assert!(both.check("p.local", 1).is_ok());
        let e = both.check("10.0.0.1", 9000).unwrap_err().to_string();
        assert!(e.contains("not registered with the gateway"), "{e}");
        assert!(e.contains("--kv-allowed-peers"), "{e}");
        tx.send_replace(Some(vec!["10.0.0.1:9000".into()]));
        assert!(both.check("10.0.0.1", 9000).is_ok());
        assert!(both.check("p.local", 2).is_ok());
        assert!(both.check("10.0.0.3", 9000).is_err());
    }
}
