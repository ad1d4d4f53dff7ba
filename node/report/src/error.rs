//! What can go wrong between the reporter and the gateway.

use std::time::Duration;

/// Why a connection to the gateway failed or ended. Every one of these but
/// [`Refused`](Self::Refused) makes the reporter back off and reconnect; only
/// [`InvalidAddress`](Self::InvalidAddress) is returned to the caller
/// (from [`Reporter::spawn`](crate::Reporter::spawn)), the rest show up in
/// [`ReporterStatus::last_error`](crate::ReporterStatus::last_error) and the logs.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// `--gateway` is not a usable address (`host:port` or `http://host:port`).
    #[error("invalid gateway address {addr:?}")]
    InvalidAddress {
        /// The address as given.
        addr: String,
        /// Why it was refused.
        #[source]
        source: tonic::transport::Error,
    },
    /// No connection to the gateway (refused, unreachable, or the connect timed out).
    #[error("cannot connect to the gateway at {addr}")]
    Connect {
        /// The gateway's URI.
        addr: String,
        /// The transport's reason.
        #[source]
        source: tonic::transport::Error,
    },
    /// The gateway refused the registration or the stream failed (status from the gateway or the
    /// transport).
    #[error("gateway stream failed ({:?})", .0.code())]
    Rpc(#[source] tonic::Status),
    /// The gateway refused the registration with `UNAUTHENTICATED`: the node's cluster token
    /// (`--cluster-token` / `PD_CLUSTER_TOKEN`) is missing or not the gateway's.
    #[error(
        "the gateway refused this node's cluster token (missing or wrong --cluster-token / PD_CLUSTER_TOKEN): {}",
        .0.message()
    )]
    Unauthenticated(tonic::Status),
    /// The gateway refused the registration for good: `ALREADY_EXISTS` (another live node holds
    /// this engine id) or `INVALID_ARGUMENT` (no retry can fix it, e.g. an address nobody can
    /// reach). The reporter stops; the node should exit with it.
    #[error("the gateway refused this node: {}", .0.message())]
    Refused(tonic::Status),
    /// The gateway ended the stream without an error.
    #[error("the gateway closed the stream")]
    Closed,
    /// The gateway did not acknowledge the registration in time.
    #[error("no registration acknowledgement within {0:?}")]
    AckTimeout(Duration),
    /// A `--gateway` entry is not `host:port` (or `http://host:port`, `https://host:port`).
    #[error("invalid gateway address {addr:?}: {why}")]
    InvalidGateway {
        /// The entry as given.
        addr: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// The node refused this gateway for good: its acknowledgement carried a cluster token
    /// other than the one the node took from another gateway that is still connected (the
    /// gateways do not share one `--cluster-token`). Its reporter stops.
    #[error(
        "the gateway at {gateway} handed out a cluster token other than the one this node uses, \
         from the gateway at {other}; refusing it (give every gateway the same --cluster-token)"
    )]
    TokenConflict {
        /// The gateway refused.
        gateway: String,
        /// The connected gateway whose token the node uses.
        other: String,
    },
}

impl ReportError {
    /// Whether retrying cannot help ([`Refused`](Self::Refused),
    /// [`TokenConflict`](Self::TokenConflict)).
    pub fn is_final(&self) -> bool {
        matches!(self, Self::Refused(_) | Self::TokenConflict { .. })
    }
}

impl From<tonic::Status> for ReportError {
    fn from(status: tonic::Status) -> Self {
        match status.code() {
            tonic::Code::Unauthenticated => Self::Unauthenticated(status),
            tonic::Code::AlreadyExists | tonic::Code::InvalidArgument => Self::Refused(status),
            _ => Self::Rpc(status),
        }
    }
}

/// `err` and its sources, joined with `": "` (for logs).
pub(crate) fn chain(err: &dyn std::error::Error) -> String {
    let mut out = err.to_string();
    let mut source = err.source();
    while let Some(e) = source {
        out.push_str(": ");
        out.push_str(&e.to_string());
        source = e.source();
    }
    out
}
