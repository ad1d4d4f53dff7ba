//! The cluster's TLS: every hop between the gateway and the nodes, and between nodes, under
//! mutual TLS with one cluster CA.
//!
//! Owns: reading a process's certificate chain, private key and the cluster CA (PEM, once, at
//! start) into [`ClusterTls`]; the rustls configs every hop uses — a server that requires a
//! client certificate issued by the CA, a client that trusts only the CA and presents its own
//! certificate; tonic's configs for the gRPC hops built from the same files; [`TlsIncoming`],
//! an accept loop for plain TCP servers whose handshakes run off the accept path, each under a
//! deadline (a client that opens a connection and says nothing holds one task, not the port),
//! and [`TlsListener`], the same as an axum listener; [`server_only`], a server's TLS for
//! clients outside the cluster (the gateway's admin API).
//!
//! Must not: check tokens or API keys (each protocol still checks its own, inside the tunnel),
//! know any protocol, or touch the process-wide rustls provider: every config names ring
//! explicitly, so a build that also links another provider behaves the same.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::{TlsAcceptor, TlsConnector};

mod listener;

pub use listener::TlsListener;
pub use tokio_rustls::client::TlsStream as ClientStream;
pub use tokio_rustls::server::TlsStream as ServerStream;
pub use {rustls, tokio_rustls};

/// How long a peer may take to finish its handshake after connecting.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Handshakes in progress at once on one [`TlsIncoming`]; further connections wait in the
/// kernel's backlog.
const MAX_HANDSHAKES: usize = 256;

/// Why the TLS files could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A file holds no PEM item of the kind needed.
    #[error("{path}: {what}")]
    Pem { path: PathBuf, what: String },
    /// rustls refused the certificate, key or CA (a key that does not match the certificate,
    /// a CA that is not a CA...).
    #[error("{what}: {source}")]
    Rustls {
        what: &'static str,
        source: rustls::Error,
    },
    /// The client verifier could not be built from the CA.
    #[error("the cluster CA: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
    /// Some of `--tls-cert`, `--tls-key`, `--tls-ca` were given, not all three.
    #[error("mutual TLS needs all of --tls-cert, --tls-key and --tls-ca; missing: {0}")]
    Partial(String),
    /// A peer's host is no DNS name or IP address a certificate could name.
    #[error("`{0}` is no host name a certificate can name")]
    ServerName(String),
}

/// Where a process's TLS files are: its certificate chain and key, and the cluster CA that
/// issued every certificate of the cluster.
#[derive(Debug, Clone)]
pub struct TlsPaths {
    /// PEM certificate chain, the process's own certificate first. Its subject alternative
    /// names must cover the addresses peers dial it at.
    pub cert: PathBuf,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// PEM certificate(s) of the cluster CA: the only roots a peer is checked against.
    pub ca: PathBuf,
}

/// The command-line flags of both binaries: all three, or none (plain TCP).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TlsArgs {
    /// This process's certificate chain (PEM) for mutual TLS on every cluster hop (registry,
    /// gateway→node HTTP, the KV side channel and data port). Its subject alternative names
    /// must cover the addresses peers dial it at. Needs --tls-key and --tls-ca
    /// (`scripts/cluster-certs.sh` mints all three). Default: `$PD_TLS_CERT`.
    #[arg(long, env = "PD_TLS_CERT", value_name = "PEM")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM). Default: `$PD_TLS_KEY`.
    #[arg(long, env = "PD_TLS_KEY", value_name = "PEM")]
    pub tls_key: Option<PathBuf>,
    /// The cluster CA (PEM): the only issuer whose certificates this process accepts from
    /// peers, and requires of them. Default: `$PD_TLS_CA`.
    #[arg(long, env = "PD_TLS_CA", value_name = "PEM")]
    pub tls_ca: Option<PathBuf>,
}

impl TlsArgs {
    /// The files, when all three flags were given; `None` when none was.
    ///
    /// # Errors
    /// [`TlsError::Partial`] when some were given.
    pub fn paths(&self) -> Result<Option<TlsPaths>, TlsError> {
        match (&self.tls_cert, &self.tls_key, &self.tls_ca) {
            (None, None, None) => Ok(None),
            (Some(cert), Some(key), Some(ca)) => Ok(Some(TlsPaths {
                cert: cert.clone(),
                key: key.clone(),
                ca: ca.clone(),
            })),
            (cert, key, ca) => {
                let missing = [("--tls-cert", cert), ("--tls-key", key), ("--tls-ca", ca)]
                    .iter()
                    .filter(|(_, v)| v.is_none())
                    .map(|(n, _)| *n)
                    .collect::<Vec<_>>();
                Err(TlsError::Partial(missing.join(", ")))
            }
        }
    }

    /// [`ClusterTls::load`] of [`Self::paths`].
    ///
    /// # Errors
    /// As those two.
    pub fn load(&self) -> Result<Option<ClusterTls>, TlsError> {
        self.paths()?.as_ref().map(ClusterTls::load).transpose()
    }
}

/// A process's TLS identity in the cluster, cheap to clone.
#[derive(Clone)]
pub struct ClusterTls(Arc<Inner>);

struct Inner {
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    ca_pem: Vec<u8>,
    server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
}

impl fmt::Debug for ClusterTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterTls").finish_non_exhaustive()
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_owned(),
        source,
    })
}

fn certs(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem {
            path: path.to_owned(),
            what: format!("not PEM certificates: {e}"),
        })?;
    if certs.is_empty() {
        return Err(TlsError::Pem {
            path: path.to_owned(),
            what: "no certificate in it".into(),
        });
    }
    Ok(certs)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl ClusterTls {
    /// Reads the three files and builds the configs.
    ///
    /// # Errors
    /// A file cannot be read or holds no usable PEM, or the key does not match the certificate.
    pub fn load(paths: &TlsPaths) -> Result<Self, TlsError> {
        let cert_pem = read(&paths.cert)?;
        let key_pem = read(&paths.key)?;
        let ca_pem = read(&paths.ca)?;
        let chain = certs(&paths.cert, &cert_pem)?;
        let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| TlsError::Pem {
            path: paths.key.clone(),
            what: format!("no private key in it: {e}"),
        })?;
        let mut roots = RootCertStore::empty();
        for ca in certs(&paths.ca, &ca_pem)? {
            roots.add(ca).map_err(|source| TlsError::Rustls {
                what: "the cluster CA",
                source,
            })?;
        }
        let roots = Arc::new(roots);
        let verifier =
            WebPkiClientVerifier::builder_with_provider(roots.clone(), provider()).build()?;
        let server = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|source| TlsError::Rustls {
                what: "protocol versions",
                source,
            })?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(|source| TlsError::Rustls {
                what: "the certificate and key",
                source,
            })?;
        let client = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|source| TlsError::Rustls {
                what: "protocol versions",
                source,
            })?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .map_err(|source| TlsError::Rustls {
                what: "the certificate and key",
                source,
            })?;
        Ok(Self(Arc::new(Inner {
            cert_pem,
            key_pem,
            ca_pem,
            server: Arc::new(server),
            client: Arc::new(client),
        })))
    }

    /// A server's config: its certificate, and a client certificate issued by the CA required.
    pub fn server_config(&self) -> Arc<ServerConfig> {
        self.0.server.clone()
    }

    /// A client's config: only the CA trusted, its own certificate presented.
    pub fn client_config(&self) -> Arc<ClientConfig> {
        self.0.client.clone()
    }

    /// Accepts with [`Self::server_config`].
    pub fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.server_config())
    }

    /// Connects with [`Self::client_config`].
    pub fn connector(&self) -> TlsConnector {
        TlsConnector::from(self.client_config())
    }

    /// tonic's server config from the same files: client certificates from the CA required.
    pub fn grpc_server(&self) -> tonic::transport::ServerTlsConfig {
        tonic::transport::ServerTlsConfig::new()
            .identity(self.identity())
            .client_ca_root(tonic::transport::Certificate::from_pem(&self.0.ca_pem))
            .timeout(HANDSHAKE_TIMEOUT)
    }

    /// tonic's client config from the same files: the server's name is the URI's host.
    pub fn grpc_client(&self) -> tonic::transport::ClientTlsConfig {
        tonic::transport::ClientTlsConfig::new()
            .identity(self.identity())
            .ca_certificate(tonic::transport::Certificate::from_pem(&self.0.ca_pem))
            .timeout(HANDSHAKE_TIMEOUT)
    }

    fn identity(&self) -> tonic::transport::Identity {
        tonic::transport::Identity::from_pem(&self.0.cert_pem, &self.0.key_pem)
    }
}

/// A server's TLS for clients outside the cluster: `cert` (a PEM chain) and `key`, no client
/// certificate asked for.
///
/// # Errors
/// A file cannot be read or holds no usable PEM, or the key does not match the certificate.
pub fn server_only(cert: &Path, key: &Path) -> Result<TlsAcceptor, TlsError> {
    let cert_pem = read(cert)?;
    let chain = certs(cert, &cert_pem)?;
    let key_der = PrivateKeyDer::from_pem_slice(&read(key)?).map_err(|e| TlsError::Pem {
        path: key.to_owned(),
        what: format!("no private key in it: {e}"),
    })?;
    let config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Rustls {
            what: "protocol versions",
            source,
        })?
        .with_no_client_auth()
        .with_single_cert(chain, key_der)
        .map_err(|source| TlsError::Rustls {
            what: "the certificate and key",
            source,
        })?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// A client config that trusts no root: for a client that speaks TLS only under the cluster's
/// (whose every `https` connection without it fails).
pub fn no_roots() -> ClientConfig {
    ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map(|b| {
            b.with_root_certificates(RootCertStore::empty())
                .with_no_client_auth()
        })
        .unwrap_or_else(|_| unreachable!("ring supports the default protocol versions"))
}

/// A client config that trusts the CA certificates in `ca` (PEM) and presents none: for a
/// server outside the cluster with a CA of its own (the gateways' PostgreSQL state store).
///
/// # Errors
/// The file cannot be read or holds no usable certificate.
pub fn client_trusting(ca: &Path) -> Result<ClientConfig, TlsError> {
    let pem = read(ca)?;
    let mut roots = RootCertStore::empty();
    for c in certs(ca, &pem)? {
        roots.add(c).map_err(|source| TlsError::Rustls {
            what: "a CA certificate",
            source,
        })?;
    }
    Ok(ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Rustls {
            what: "protocol versions",
            source,
        })?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// The name a certificate must carry for `host` (a DNS name or an IP address; IPv6 in brackets
/// or not).
///
/// # Errors
/// [`TlsError::ServerName`] for anything else.
pub fn server_name(host: &str) -> Result<ServerName<'static>, TlsError> {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    ServerName::try_from(bare.to_owned()).map_err(|_| TlsError::ServerName(host.to_owned()))
}

/// The scheme for a URI to a peer: `https` under TLS, `http` without.
pub fn scheme(tls: Option<&ClusterTls>) -> &'static str {
    if tls.is_some() { "https" } else { "http" }
}

/// A tonic endpoint for a gRPC peer at `uri` (`http://host:port`, `https://host:port` or
/// `host:port`): under `tls`, `https` with [`ClusterTls::grpc_client`] (the certificate must
/// name the URI's host); without, as given.
///
/// # Errors
/// The URI is not one, or tonic refused the TLS config.
pub fn grpc_endpoint(
    uri: &str,
    tls: Option<&ClusterTls>,
) -> Result<tonic::transport::Endpoint, tonic::transport::Error> {
    grpc_endpoint_named(uri, tls, None)
}

/// [`grpc_endpoint`], but under `tls` the peer's certificate must name `server_name` when
/// given, not the URI's host: for a peer reached at an address that a DNS name resolved to
/// (one of a headless Service's pods), whose certificate names the DNS name.
///
/// # Errors
/// The URI is not one, or tonic refused the TLS config.
pub fn grpc_endpoint_named(
    uri: &str,
    tls: Option<&ClusterTls>,
    server_name: Option<&str>,
) -> Result<tonic::transport::Endpoint, tonic::transport::Error> {
    let rest = uri
        .strip_prefix("http://")
        .or_else(|| uri.strip_prefix("https://"))
        .unwrap_or(uri);
    let uri = match uri.split_once("://") {
        Some(("http" | "https", _)) | None => format!("{}://{rest}", scheme(tls)),
        Some(_) => uri.to_owned(),
    };
    let endpoint = tonic::transport::Endpoint::from_shared(uri)?;
    match (tls, server_name) {
        (Some(tls), Some(name)) => endpoint.tls_config(
            tls.grpc_client()
                .domain_name(name.trim_start_matches('[').trim_end_matches(']')),
        ),
        (Some(tls), None) => endpoint.tls_config(tls.grpc_client()),
        (None, _) => Ok(endpoint),
    }
}

/// TLS connections accepted from a TCP listener: TCP accepted on one task, each handshake on
/// its own under [`HANDSHAKE_TIMEOUT`], at most [`MAX_HANDSHAKES`] at once. A handshake that
/// fails (no certificate, one the CA did not issue, a plain-text client) is logged and
/// dropped; the server never sees it.
#[derive(Debug)]
pub struct TlsIncoming {
    rx: mpsc::Receiver<(ServerStream<TcpStream>, SocketAddr)>,
}

impl TlsIncoming {
    /// Starts accepting on the current tokio runtime; accepting stops when this is dropped.
    pub fn spawn(listener: TcpListener, acceptor: TlsAcceptor, what: &'static str) -> Self {
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(async move {
            let slots = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
            loop {
                let Ok(slot) = slots.clone().acquire_owned().await else {
                    return;
                };
                let (tcp, peer) = tokio::select! {
                    accepted = listener.accept() => match accepted {
                        Ok(a) => a,
                        Err(e) => {
                            // Out of descriptors and the like: wait rather than spin.
                            tracing::warn!(what, error = %e, "accept failed");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    },
                    () = tx.closed() => return,
                };
                let _ = tcp.set_nodelay(true);
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    let _slot = slot;
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => {
                            tracing::warn!(what, %peer, error = %e, "TLS handshake refused");
                        }
                        Err(_) => {
                            tracing::warn!(what, %peer, "TLS handshake timed out");
                        }
                    }
                });
            }
        });
        Self { rx }
    }

    /// The next connection whose handshake succeeded; `None` once accepting stopped.
    pub async fn next(&mut self) -> Option<(ServerStream<TcpStream>, SocketAddr)> {
        self.rx.recv().await
    }
}

#[cfg(test)]
mod tests;
