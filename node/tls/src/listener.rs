//! [`TlsIncoming`] as an axum listener: an HTTP API served only over TLS.

use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;

use crate::{ServerStream, TlsIncoming};

/// Accepts connections whose TLS handshake with `acceptor` succeeded (under
/// [`crate::ClusterTls::acceptor`], only peers holding a certificate from the cluster CA).
#[derive(Debug)]
pub struct TlsListener {
    incoming: TlsIncoming,
    local: SocketAddr,
}

impl TlsListener {
    /// Starts the handshakes' accept loop on `listener`; `what` names the server in logs.
    ///
    /// # Errors
    /// The listener's address cannot be read.
    pub fn new(
        listener: TcpListener,
        acceptor: TlsAcceptor,
        what: &'static str,
    ) -> std::io::Result<Self> {
        let local = listener.local_addr()?;
        let incoming = TlsIncoming::spawn(listener, acceptor, what);
        Ok(Self { incoming, local })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = ServerStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.incoming.next().await {
            Some(accepted) => accepted,
            // The accept loop ended (the listener is gone): nothing more will come.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}
