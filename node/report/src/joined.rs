//! What the gateways a node reports to told it, merged into what the node uses: one KV peer
//! list, one cluster token, one observed host; and what happened to them: which gateway left
//! (for its leases), and whether every one refused the node.
//!
//! Each [`Reporter`](crate::Reporter) tells its [`Joined`] what its gateway said, under a key of
//! its own. The rules:
//!
//! - **Peers**: the union, in gateway order, of the lists of the gateways connected now. While
//!   none is connected, the last union stays (a node whose gateways are all away keeps what it
//!   was told, as with one gateway).
//! - **Cluster token**: a node with its own token keeps it, whatever an acknowledgement says.
//!   A node without one takes the first token a gateway hands out. A gateway whose token
//!   differs from the one in effect while a connected gateway vouches for that one is refused
//!   ([`ReportError::TokenConflict`]): its reporter stops. When nobody connected vouches for the
//!   token in effect any more (one gateway, restarted, minted a new one), the new one replaces
//!   it.
//! - **Observed host**: the first one a gateway reported, followed while that gateway reports
//!   another; after it is gone, the next one reported.
//! - **Gateway left**: a registered stream that ended other than by this node's own stop emits
//!   [`GatewayLeft`] with the `gateway_id` its acknowledgement gave.
//! - **Refused**: once every gateway the node has a reporter for refused it for good (and every
//!   name given resolved at least once), [`Joined::watch_all_refused`] carries the last refusal.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use pd_rpc::registry as pb;
use tokio::sync::{mpsc, watch};
use tracing::{error, info, warn};

use crate::error::ReportError;

/// A gateway's registry stream ended (EOF or an error) after it acknowledged the node, other
/// than by the node's own stop: the gateway is gone or cut off, and the requests it was
/// driving with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewayLeft {
    /// The `gateway_id` of its acknowledgement: what it sent as `x-pd-gateway-id`.
    pub gateway_id: String,
    /// The address the node reached it at (for logs).
    pub addr: String,
}

/// One gateway as the merge sees it.
#[derive(Debug, Default)]
struct Gateway {
    label: String,
    connected: bool,
    gateway_id: Option<String>,
    /// The cluster token its current acknowledgement carried, if any.
    token: Option<String>,
    peers: Option<Vec<String>>,
    refused: Option<Arc<ReportError>>,
}

#[derive(Debug, Default)]
struct State {
    configured_token: Option<String>,
    /// The token in effect when not configured, and the gateway it came from.
    adopted: Option<(String, String)>,
    gateways: BTreeMap<u64, Gateway>,
    next_key: u64,
    /// Who the observed host came from.
    observed_from: Option<u64>,
    /// Names given that never resolved yet.
    unresolved: usize,
}

/// The merge; see the module docs.
#[derive(Debug)]
pub(crate) struct Joined {
    state: Mutex<State>,
    peers: watch::Sender<Option<Vec<String>>>,
    token: watch::Sender<Option<String>>,
    observed_host: watch::Sender<Option<String>>,
    all_refused: watch::Sender<Option<Arc<ReportError>>>,
    left: mpsc::UnboundedSender<GatewayLeft>,
}

/// A view of one gateway of a [`crate::Gateways`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewayView {
    /// Where the node reaches it (`name:port at ip:port`, or `ip:port`).
    pub addr: String,
    /// Registered and streaming now.
    pub connected: bool,
    /// The `gateway_id` of its last acknowledgement.
    pub gateway_id: Option<String>,
    /// It refused the node (or the node it) for good; its reporter stopped.
    pub refused: bool,
}

impl Joined {
    /// A merge for a node configured with `configured_token` (empty: none); the receiver gets
    /// every [`GatewayLeft`].
    pub(crate) fn new(configured_token: &str) -> (Arc<Self>, mpsc::UnboundedReceiver<GatewayLeft>) {
        let configured = Some(configured_token.to_owned()).filter(|t| !t.is_empty());
        let (left, left_rx) = mpsc::unbounded_channel();
        let joined = Self {
            peers: watch::channel(None).0,
            token: watch::channel(configured.clone()).0,
            observed_host: watch::channel(None).0,
            all_refused: watch::channel(None).0,
            left,
            state: Mutex::new(State {
                configured_token: configured,
                ..State::default()
            }),
        };
        (Arc::new(joined), left_rx)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new gateway, named `label` in logs; returns its key.
    pub(crate) fn add(&self, label: &str) -> u64 {
        let mut st = self.lock();
        let key = st.next_key;
        st.next_key += 1;
        st.gateways.insert(
            key,
            Gateway {
                label: label.to_owned(),
                ..Gateway::default()
            },
        );
        self.recompute(&st);
        key
    }

    /// Gateway `key` is no longer one of the node's (its address went away).
    pub(crate) fn remove(&self, key: u64) {
        let mut st = self.lock();
        st.gateways.remove(&key);
        if st.observed_from == Some(key) {
            st.observed_from = None;
        }
        self.recompute(&st);
    }

    /// How many names given have not resolved yet (the node is not refused by all meanwhile).
    pub(crate) fn set_unresolved(&self, n: usize) {
        let mut st = self.lock();
        st.unresolved = n;
        self.recompute(&st);
    }

    /// Gateway `key` acknowledged the registration with `ack`: the token rule (see the module
    /// docs), then it counts as connected.
    ///
    /// # Errors
    /// [`ReportError::TokenConflict`]: its token is not the one in effect, which a connected
    /// gateway vouches for. It is not connected then.
    pub(crate) fn acked(&self, key: u64, ack: &pb::RegisterAck) -> Result<(), ReportError> {
        let mut st = self.lock();
        let label = st
            .gateways
            .get(&key)
            .map(|g| g.label.clone())
            .unwrap_or_default();
        let offered = Some(ack.cluster_token.clone()).filter(|t| !t.is_empty());
        if let Some(t) = &offered {
            self.take_token(&mut st, key, &label, t)?;
        }
        if let Some(g) = st.gateways.get_mut(&key) {
            g.connected = true;
            g.gateway_id = Some(ack.gateway_id.clone());
            g.token = offered;
        }
        if !ack.observed_host.is_empty()
            && (st.observed_from.is_none() || st.observed_from == Some(key))
        {
            st.observed_from = Some(key);
            let host = ack.observed_host.clone();
            self.observed_host.send_if_modified(|h| {
                let changed = h.as_deref() != Some(host.as_str());
                *h = Some(host);
                changed
            });
        }
        self.recompute(&st);
        Ok(())
    }

    fn take_token(
        &self,
        st: &mut State,
        key: u64,
        label: &str,
        offered: &str,
    ) -> Result<(), ReportError> {
        if let Some(own) = &st.configured_token {
            if own != offered {
                warn!(gateway = %label, "the gateway sent a cluster token other than this node's own; keeping the node's (--cluster-token)");
            }
            return Ok(());
        }
        match &st.adopted {
            Some((current, _)) if current == offered => return Ok(()),
            Some((current, from)) => {
                let voucher = st.gateways.iter().find(|(k, g)| {
                    **k != key && g.connected && g.token.as_deref() == Some(current.as_str())
                });
                if let Some((_, other)) = voucher {
                    return Err(ReportError::TokenConflict {
                        gateway: label.to_owned(),
                        other: other.label.clone(),
                    });
                }
                info!(gateway = %label, previous = %from, "using the cluster token the gateway sent (no connected gateway holds the previous one)");
            }
            None => info!(gateway = %label, "using the cluster token the gateway sent"),
        }
        st.adopted = Some((offered.to_owned(), label.to_owned()));
        self.token.send_replace(Some(offered.to_owned()));
        Ok(())
    }

    /// Gateway `key` sent `list`.
    pub(crate) fn peers(&self, key: u64, list: Vec<String>) {
        let mut st = self.lock();
        if let Some(g) = st.gateways.get_mut(&key) {
            g.peers = Some(list);
        }
        self.recompute(&st);
    }

    /// Gateway `key`'s stream ended; `stopped`: by this node's own stop. Emits [`GatewayLeft`]
    /// for a registered stream that ended otherwise.
    pub(crate) fn ended(&self, key: u64, stopped: bool) {
        let mut st = self.lock();
        let Some(g) = st.gateways.get_mut(&key) else {
            return;
        };
        let was = std::mem::replace(&mut g.connected, false);
        g.token = None;
        if was
            && !stopped
            && let Some(id) = g.gateway_id.clone()
        {
            let _ = self.left.send(GatewayLeft {
                gateway_id: id,
                addr: g.label.clone(),
            });
        }
        self.recompute(&st);
    }

    /// Gateway `key` refused the node for good (or the node it): its reporter stopped.
    pub(crate) fn refused(&self, key: u64, err: Arc<ReportError>) {
        let mut st = self.lock();
        if let Some(g) = st.gateways.get_mut(&key) {
            g.connected = false;
            g.refused = Some(err);
        }
        self.recompute(&st);
    }

    /// The merged peers, token and refusal, from `st`.
    fn recompute(&self, st: &State) {
        let connected: Vec<&Gateway> = st.gateways.values().filter(|g| g.connected).collect();
        if !connected.is_empty() {
            let lists: Vec<&Vec<String>> =
                connected.iter().filter_map(|g| g.peers.as_ref()).collect();
            if !lists.is_empty() {
                let mut union: Vec<String> = Vec::new();
                for addr in lists.into_iter().flatten() {
                    if !union.contains(addr) {
                        union.push(addr.clone());
                    }
                }
                let changed = self.peers.send_if_modified(|p| {
                    let changed = p.as_ref() != Some(&union);
                    if changed {
                        *p = Some(union.clone());
                    }
                    changed
                });
                if changed {
                    info!(peers = ?union, gateways = connected.len(), "KV peers registered with the gateways");
                }
            }
        }
        let all_refused = st.unresolved == 0
            && !st.gateways.is_empty()
            && st.gateways.values().all(|g| g.refused.is_some());
        if all_refused && self.all_refused.borrow().is_none() {
            let last = st.gateways.values().rev().find_map(|g| g.refused.clone());
            error!(
                gateways = st.gateways.len(),
                "every gateway this node was given refused it"
            );
            self.all_refused.send_replace(last);
        }
    }

    /// The union of the connected gateways' peer lists (see the module docs).
    pub(crate) fn watch_peers(&self) -> watch::Receiver<Option<Vec<String>>> {
        self.peers.subscribe()
    }

    /// The cluster token in effect.
    pub(crate) fn watch_token(&self) -> watch::Receiver<Option<String>> {
        self.token.subscribe()
    }

    /// The observed host in effect.
    pub(crate) fn watch_observed_host(&self) -> watch::Receiver<Option<String>> {
        self.observed_host.subscribe()
    }

    /// Set once every gateway refused the node.
    pub(crate) fn watch_all_refused(&self) -> watch::Receiver<Option<Arc<ReportError>>> {
        self.all_refused.subscribe()
    }

    /// Every gateway, in the order they were added.
    pub(crate) fn views(&self) -> Vec<GatewayView> {
        self.lock()
            .gateways
            .values()
            .map(|g| GatewayView {
                addr: g.label.clone(),
                connected: g.connected,
                gateway_id: g.gateway_id.clone(),
                refused: g.refused.is_some(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ack(id: &str, token: &str, host: &str) -> pb::RegisterAck {
        pb::RegisterAck {
            gateway_id: id.into(),
            state_interval_ms: 0,
            cluster_token: token.into(),
            observed_host: host.into(),
        }
    }

    #[test]
    fn peers_are_the_union_of_the_connected_gateways_lists() {
        let (j, _left) = Joined::new("own");
        let (a, b) = (j.add("a"), j.add("b"));
        let peers = j.watch_peers();
        j.acked(a, &ack("ga", "", "")).unwrap();
        j.acked(b, &ack("gb", "", "")).unwrap();
        j.peers(a, vec!["p1:1".into(), "p2:1".into()]);
        j.peers(b, vec!["p2:1".into(), "p3:1".into()]);
        let want: Vec<String> = vec!["p1:1".into(), "p2:1".into(), "p3:1".into()];
        assert_eq!(peers.borrow().as_ref(), Some(&want));
        // b leaves: its own peer (p3) goes; all leave: the last union stays.
        j.ended(b, false);
        assert_eq!(
            peers.borrow().as_deref(),
            Some(&["p1:1".to_string(), "p2:1".to_string()][..])
        );
        j.ended(a, false);
        assert_eq!(peers.borrow().as_ref().map(Vec::len), Some(2));
    }

    #[test]
    fn a_node_without_a_token_takes_the_first_and_refuses_a_conflicting_one() {
        let (j, _left) = Joined::new("");
        let (a, b) = (j.add("a"), j.add("b"));
        let token = j.watch_token();
        assert_eq!(*token.borrow(), None);
        j.acked(a, &ack("ga", "t1", "")).unwrap();
        assert_eq!(token.borrow().as_deref(), Some("t1"));
        let err = j.acked(b, &ack("gb", "t2", "")).expect_err("a conflict");
        assert!(
            matches!(&err, ReportError::TokenConflict { gateway, other } if gateway == "b" && other == "a"),
            "{err:?}"
        );
        assert!(err.is_final());
        assert_eq!(token.borrow().as_deref(), Some("t1"));
        // The same token is fine; a restarted gateway (nobody vouching) replaces it.
        j.acked(b, &ack("gb", "t1", "")).unwrap();
        j.ended(a, false);
        j.ended(b, false);
        j.acked(a, &ack("ga2", "t3", "")).unwrap();
        assert_eq!(token.borrow().as_deref(), Some("t3"));
    }

    #[test]
    fn a_node_with_its_own_token_keeps_it() {
        let (j, _left) = Joined::new("own");
        let a = j.add("a");
        j.acked(a, &ack("ga", "minted", "")).unwrap();
        assert_eq!(j.watch_token().borrow().as_deref(), Some("own"));
    }

    #[test]
    fn the_first_observed_host_stays_until_its_gateway_is_gone() {
        let (j, _left) = Joined::new("");
        let (a, b) = (j.add("a"), j.add("b"));
        let host = j.watch_observed_host();
        j.acked(b, &ack("gb", "", "10.0.0.2")).unwrap();
        j.acked(a, &ack("ga", "", "10.0.0.1")).unwrap();
        assert_eq!(host.borrow().as_deref(), Some("10.0.0.2"));
        j.acked(b, &ack("gb", "", "10.0.0.3")).unwrap();
        assert_eq!(host.borrow().as_deref(), Some("10.0.0.3"));
        j.remove(b);
        j.acked(a, &ack("ga", "", "10.0.0.1")).unwrap();
        assert_eq!(host.borrow().as_deref(), Some("10.0.0.1"));
    }

    #[test]
    fn a_stream_that_ends_names_its_gateway_unless_the_node_stopped_it() {
        let (j, mut left) = Joined::new("");
        let (a, b) = (j.add("a"), j.add("b"));
        j.ended(a, false);
        assert!(left.try_recv().is_err(), "never registered: nothing to say");
        j.acked(a, &ack("ga", "", "")).unwrap();
        j.acked(b, &ack("gb", "", "")).unwrap();
        j.ended(a, false);
        j.ended(b, true);
        assert_eq!(
            left.try_recv().ok(),
            Some(GatewayLeft {
                gateway_id: "ga".into(),
                addr: "a".into()
            })
        );
        assert!(left.try_recv().is_err(), "b was stopped by the node");
    }

    #[test]
    fn the_node_is_refused_only_when_every_gateway_refused() {
        let (j, _left) = Joined::new("");
        let (a, b) = (j.add("a"), j.add("b"));
        let all = j.watch_all_refused();
        j.refused(a, Arc::new(ReportError::Closed));
        assert!(all.borrow().is_none());
        j.set_unresolved(1);
        j.refused(b, Arc::new(ReportError::Closed));
        assert!(all.borrow().is_none(), "a name not resolved yet");
        j.set_unresolved(0);
        assert!(all.borrow().is_some());
    }
}
