//! The client port's connections, before pingora's HTTP/1 server reads them: at most
//! `--max-connections` open at once (one more is closed at once, before a byte of it is read),
//! and each request's head read within `--header-timeout-ms` (from the connection's start for
//! its first request, from the first byte for the next ones on a keep-alive connection), else
//! a `408` with an OpenAI error object and the connection closed.
//!
//! pingora 0.9.1 offers neither: its connection filter (the `connection_filter` feature) sees
//! one address at a time and never learns that a connection ended, so it cannot count; its
//! read timeout (60 s) is per read, so a client sending a byte a minute holds a connection
//! forever (slowloris). So the service's app is [`Front`], which counts connections and wraps
//! each in [`HeadDeadline`] before pingora's own HTTP handling (`HttpProxy`'s `ServerApp`)
//! takes it.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use pingora::apps::ServerApp;
use pingora::protocols::raw_connect::ProxyDigest;
use pingora::protocols::{
    ALPN, GetProxyDigest, GetSocketDigest, GetTimingDigest, Peek, Shutdown, SocketDigest, Ssl,
    Stream, TimingDigest, UniqueID, UniqueIDType,
};
use pingora::server::ShutdownWatch;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tracing::debug;

use crate::error::GatewayError;

/// Limits on the client port's connections.
#[derive(Debug, Clone, Copy)]
pub struct FrontLimits {
    /// Connections open at once (0: no limit).
    pub max_connections: usize,
    /// A request's head must be in within this (`None`: pingora's per-read timeout only).
    pub header_timeout: Option<Duration>,
}

/// A pingora app (`HttpProxy`) behind the connection cap and the head deadline.
#[derive(Debug)]
pub struct Front<A> {
    inner: Arc<A>,
    open: Arc<AtomicUsize>,
    limits: FrontLimits,
}

impl<A> Front<A> {
    /// `inner` behind `limits`.
    pub fn new(inner: A, limits: FrontLimits) -> Self {
        Self {
            inner: Arc::new(inner),
            open: Arc::new(AtomicUsize::new(0)),
            limits,
        }
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }
}

/// One counted connection; dropping it frees its place.
struct Counted(Arc<AtomicUsize>);

impl Counted {
    fn take(open: &Arc<AtomicUsize>, max: usize) -> Option<Self> {
        if open.fetch_add(1, Ordering::AcqRel) >= max && max > 0 {
            open.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(Self(open.clone()))
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[async_trait]
impl<A: ServerApp + Send + Sync + 'static> ServerApp for Front<A> {
    async fn process_new(
        self: &Arc<Self>,
        stream: Stream,
        shutdown: &ShutdownWatch,
    ) -> Option<Stream> {
        let Some(_counted) = Counted::take(&self.open, self.limits.max_connections) else {
            // Closed before a byte is read: the client sees the connection end at once (as
            // Envoy's `max_downstream_connections` does) and may retry.
            debug!(
                max = self.limits.max_connections,
                "connection refused: too many open"
            );
            return None;
        };
        let stream: Stream = match self.limits.header_timeout {
            // HTTP/2 frames its heads itself: only HTTP/1 is watched here.
            Some(t) if !matches!(stream.selected_alpn_proto(), Some(ALPN::H2)) => {
                Box::new(HeadDeadline::new(stream, t))
            }
            _ => stream,
        };
        // The connection's keep-alive requests are all served in this call; what it returns is
        // never reused (pingora's HTTP app returns `None`).
        self.inner.process_new(stream, shutdown).await
    }

    async fn cleanup(&self) {
        self.inner.cleanup().await;
    }
}

/// Whether `bytes` (read during a head whose last bytes so far are `tail`) end it: an empty
/// line (`\r\n\r\n`, or a bare `\n\n`).
fn head_ends(tail: &mut [u8; 3], bytes: &[u8]) -> bool {
    for &b in bytes {
        let t = *tail;
        if b == b'\n' && (t[2] == b'\n' || (t[1] == b'\n' && t[2] == b'\r')) {
            *tail = [0; 3];
            return true;
        }
        *tail = [t[1], t[2], b];
    }
    false
}

/// Where a connection is in its request/answer cycle, as far as reads and writes show.
#[derive(Debug)]
enum Phase {
    /// Reading a request's head: the deadline runs (from `Some`).
    Head(Option<Pin<Box<tokio::time::Sleep>>>),
    /// The head is in; the body (bounded by its own deadline) and the answer follow.
    Body,
    /// Something was written: the next byte read starts the next request's head.
    Answered,
    /// The deadline passed: every read fails.
    TimedOut,
}

/// An HTTP/1 connection whose request heads must arrive within a deadline. The end of a head
/// is found by watching the bytes read for an empty line; a write (the answer) means the next
/// byte read starts a new request. When the deadline passes, a `408` is written and every read
/// fails, which ends pingora's handling of the connection.
#[derive(Debug)]
pub struct HeadDeadline {
    inner: Stream,
    timeout: Duration,
    phase: Phase,
    /// The last three bytes of the head read so far.
    tail: [u8; 3],
}

impl HeadDeadline {
    /// `inner`, its first head due within `timeout` from now.
    pub fn new(inner: Stream, timeout: Duration) -> Self {
        Self {
            inner,
            timeout,
            phase: Phase::Head(Some(Box::pin(tokio::time::sleep(timeout)))),
            tail: [0; 3],
        }
    }

    /// The `408` answer, written best-effort (a fresh connection's send buffer takes it).
    fn send_timeout(&mut self, cx: &mut Context<'_>) {
        let e = GatewayError::ReadTimeout {
            what: "request head",
            limit: self.timeout,
        };
        let body = e.body();
        let mut out = format!(
            "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        )
        .into_bytes();
        out.extend_from_slice(&body);
        let inner = Pin::new(&mut self.inner);
        let _ = inner.poll_write(cx, &out);
        let _ = Pin::new(&mut self.inner).poll_flush(cx);
    }
}

impl AsyncRead for HeadDeadline {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if let Phase::TimedOut = this.phase {
            return Poll::Ready(Err(std::io::ErrorKind::TimedOut.into()));
        }
        let before = buf.filled().len();
        let read = Pin::new(&mut this.inner).poll_read(cx, buf);
        match read {
            Poll::Ready(Ok(())) => {
                let new = &buf.filled()[before..];
                if new.is_empty() {
                    return Poll::Ready(Ok(()));
                }
                if let Phase::Answered = this.phase {
                    // The next request's first byte: its head is due within the timeout.
                    this.phase = Phase::Head(Some(Box::pin(tokio::time::sleep(this.timeout))));
                }
                if let Phase::Head(_) = this.phase
                    && head_ends(&mut this.tail, new)
                {
                    this.phase = Phase::Body;
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => {
                if let Phase::Head(Some(deadline)) = &mut this.phase
                    && deadline.as_mut().poll(cx).is_ready()
                {
                    debug!(timeout = ?this.timeout, "request head not in by its deadline: 408");
                    this.phase = Phase::TimedOut;
                    this.send_timeout(cx);
                    return Poll::Ready(Err(std::io::ErrorKind::TimedOut.into()));
                }
                Poll::Pending
            }
        }
    }
}

impl HeadDeadline {
    fn wrote(&mut self, n: usize) {
        if n > 0 && matches!(self.phase, Phase::Body) {
            self.phase = Phase::Answered;
        }
    }
}

impl AsyncWrite for HeadDeadline {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = r {
            this.wrote(n);
        }
        r
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = r {
            this.wrote(n);
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[async_trait]
impl Shutdown for HeadDeadline {
    async fn shutdown(&mut self) {
        Shutdown::shutdown(&mut *self.inner).await;
    }
}

impl UniqueID for HeadDeadline {
    fn id(&self) -> UniqueIDType {
        self.inner.id()
    }
}

impl Ssl for HeadDeadline {
    fn get_ssl(&self) -> Option<&pingora::protocols::tls::TlsRef> {
        self.inner.get_ssl()
    }

    fn get_ssl_digest(&self) -> Option<Arc<pingora::protocols::tls::SslDigest>> {
        self.inner.get_ssl_digest()
    }

    fn selected_alpn_proto(&self) -> Option<ALPN> {
        self.inner.selected_alpn_proto()
    }
}

impl GetTimingDigest for HeadDeadline {
    fn get_timing_digest(&self) -> Vec<Option<TimingDigest>> {
        self.inner.get_timing_digest()
    }

    fn get_read_pending_time(&self) -> Duration {
        self.inner.get_read_pending_time()
    }

    fn get_write_pending_time(&self) -> Duration {
        self.inner.get_write_pending_time()
    }
}

impl GetProxyDigest for HeadDeadline {
    fn get_proxy_digest(&self) -> Option<Arc<ProxyDigest>> {
        self.inner.get_proxy_digest()
    }

    fn set_proxy_digest(&mut self, digest: ProxyDigest) {
        self.inner.set_proxy_digest(digest);
    }
}

impl GetSocketDigest for HeadDeadline {
    fn get_socket_digest(&self) -> Option<Arc<SocketDigest>> {
        self.inner.get_socket_digest()
    }

    fn set_socket_digest(&mut self, digest: SocketDigest) {
        self.inner.set_socket_digest(digest);
    }
}

#[async_trait]
impl Peek for HeadDeadline {
    async fn try_peek(&mut self, buf: &mut [u8]) -> std::io::Result<bool> {
        self.inner.try_peek(buf).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_end_of_a_head_is_found_across_reads() {
        let mut tail = [0; 3];
        assert!(!head_ends(&mut tail, b"GET / HTTP/1.1\r\nHost: x\r"));
        assert!(!head_ends(&mut tail, b"\n\r"));
        assert!(head_ends(&mut tail, b"\nbody"));
        assert!(!head_ends(&mut tail, b"GET / HTTP/1.1\nHost: x\n"));
        assert!(head_ends(&mut tail, b"\n"));
    }

    #[test]
    fn connections_past_the_cap_are_refused() {
        let open = Arc::new(AtomicUsize::new(0));
        let a = Counted::take(&open, 2).unwrap();
        let _b = Counted::take(&open, 2).unwrap();
        assert!(Counted::take(&open, 2).is_none());
        drop(a);
        assert!(Counted::take(&open, 2).is_some());
        assert_eq!(open.load(Ordering::Acquire), 1);
        let unlimited: Vec<_> = (0..10).filter_map(|_| Counted::take(&open, 0)).collect();
        assert_eq!(unlimited.len(), 10);
    }
}
