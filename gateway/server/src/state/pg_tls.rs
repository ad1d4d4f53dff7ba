//! TLS to the PostgreSQL state store: tokio-postgres's connector traits over tokio-rustls (ring,
//! the provider every other hop uses), trusting the CA given with `--state-tls-ca`. No channel
//! binding is offered (SCRAM without `-PLUS`): the server's certificate is checked instead.
//! Whether TLS is required is the URL's `sslmode` (`require` refuses a server without it).

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::ServerName;

/// Makes a TLS connection per database connection.
#[derive(Clone)]
pub struct Rustls(pub Arc<rustls::ClientConfig>);

impl std::fmt::Debug for Rustls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Rustls")
    }
}

/// One connection's handshake, to `name`.
#[derive(Debug)]
pub struct Connect {
    config: Arc<rustls::ClientConfig>,
    name: ServerName<'static>,
}

/// A TLS stream to the database.
#[derive(Debug)]
pub struct Stream<S>(tokio_rustls::client::TlsStream<S>);

impl<S> MakeTlsConnect<S> for Rustls
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = Stream<S>;
    type TlsConnect = Connect;
    type Error = io::Error;

    fn make_tls_connect(&mut self, domain: &str) -> io::Result<Connect> {
        let name = pd_tls::server_name(domain)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        Ok(Connect {
            config: self.0.clone(),
            name,
        })
    }
}

impl<S> TlsConnect<S> for Connect
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = Stream<S>;
    type Error = io::Error;
    type Future = BoxFuture<'static, io::Result<Stream<S>>>;

    fn connect(self, stream: S) -> Self::Future {
        Box::pin(async move {
            tokio_rustls::TlsConnector::from(self.config)
                .connect(self.name, stream)
                .await
                .map(Stream)
        })
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for Stream<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Stream<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> tokio_postgres::tls::TlsStream for Stream<S> {
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}
