//! A node reporting to several gateways at once (active-active): one [`Reporter`] per gateway
//! address, what they hear merged (see `joined.rs`).
//!
//! Each entry of `--gateway` is `HOST:PORT` ([`GatewayEntry`]). An IP address is one gateway. A
//! DNS name may stand for several (a Kubernetes headless Service lists one address per ready
//! pod): it is resolved at start and again every [`GatewaysOptions::resolve_every`]; a reporter
//! starts for each address that appears and stops (cleanly: the gateway sees the node leave)
//! for each that disappears. A failed lookup changes nothing. Under TLS the node connects to
//! the address but checks the gateway's certificate against the name.
//!
//! The node is refused ([`Gateways::refused`]) only once every gateway it has a reporter for
//! refused it for good; one gateway refusing stops that gateway's reporter alone.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use pd_rpc::registry as pb;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use crate::error::ReportError;
use crate::joined::{GatewayLeft, GatewayView, Joined};
use crate::registration::Registration;
use crate::reporter::{Reporter, ReporterHandle, ReporterOptions, Target};
use crate::source::StateSource;

/// One `--gateway` entry: `host:port`, `http://host:port` or `https://host:port` (the scheme
/// follows TLS either way); an IPv6 address in brackets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewayEntry {
    /// The entry as given.
    pub given: String,
    /// The host: a DNS name or an IP address (no brackets).
    pub host: String,
    /// The registry port.
    pub port: u16,
}

impl GatewayEntry {
    /// Parses one entry.
    ///
    /// # Errors
    /// [`ReportError::InvalidGateway`] when it is not `host:port`.
    pub fn parse(given: &str) -> Result<Self, ReportError> {
        let bad = |why| ReportError::InvalidGateway {
            addr: given.to_owned(),
            why,
        };
        let trimmed = given.trim();
        let rest = trimmed
            .strip_prefix("http://")
            .or_else(|| trimmed.strip_prefix("https://"))
            .unwrap_or(trimmed);
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        if rest.contains('/') || rest.contains("://") {
            return Err(bad("expected host:port, without a path or another scheme"));
        }
        let (host, port) = rest.rsplit_once(':').ok_or_else(|| bad("no :port"))?;
        let port: u16 = port.parse().map_err(|_| bad("the port is not a number"))?;
        if port == 0 {
            return Err(bad("port 0"));
        }
        let host = match host.strip_prefix('[') {
            Some(v6) => {
                let v6 = v6.strip_suffix(']').ok_or_else(|| bad("unclosed ["))?;
                v6.parse::<std::net::Ipv6Addr>()
                    .map_err(|_| bad("not an IPv6 address in brackets"))?;
                v6.to_owned()
            }
            None if host.contains(':') => return Err(bad("an IPv6 address needs brackets")),
            None => host.to_owned(),
        };
        if host.is_empty() {
            return Err(bad("no host"));
        }
        Ok(Self {
            given: trimmed.to_owned(),
            host,
            port,
        })
    }

    /// The host as an IP address, when it is one (then it is never looked up).
    pub fn ip(&self) -> Option<IpAddr> {
        self.host.parse().ok()
    }
}

impl fmt::Display for GatewayEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.ip() {
            Some(IpAddr::V6(ip)) => write!(f, "[{ip}]:{}", self.port),
            _ => write!(f, "{}:{}", self.host, self.port),
        }
    }
}

/// Addresses a name stands for, as the future [`Resolve::resolve`] returns them.
pub type Resolving<'a> =
    Pin<Box<dyn Future<Output = std::io::Result<Vec<SocketAddr>>> + Send + 'a>>;

/// Looks names up: [`SystemResolver`] in production, a table in tests.
pub trait Resolve: Send + Sync + fmt::Debug + 'static {
    /// The addresses `host` (a DNS name) stands for now, each with `port`.
    fn resolve<'a>(&'a self, host: &'a str, port: u16) -> Resolving<'a>;
}

/// The system's resolver (`getaddrinfo` on the blocking pool, as `tokio::net::lookup_host`):
/// `/etc/hosts`, then DNS, as the machine is configured.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemResolver;

impl Resolve for SystemResolver {
    fn resolve<'a>(&'a self, host: &'a str, port: u16) -> Resolving<'a> {
        Box::pin(async move { Ok(tokio::net::lookup_host((host, port)).await?.collect()) })
    }
}

/// Options of [`Gateways::spawn`].
#[derive(Debug, Clone)]
pub struct GatewaysOptions {
    /// Each reporter's.
    pub reporter: ReporterOptions,
    /// How often names are looked up again. Default: 5 s.
    pub resolve_every: Duration,
    /// Who looks them up. Default: [`SystemResolver`].
    pub resolver: Arc<dyn Resolve>,
}

impl Default for GatewaysOptions {
    fn default() -> Self {
        Self {
            reporter: ReporterOptions::default(),
            resolve_every: Duration::from_secs(5),
            resolver: Arc::new(SystemResolver),
        }
    }
}

/// Reports to every gateway of a list; see the module docs. Dropping it stops every reporter,
/// as [`shutdown`](Self::shutdown) does, without waiting.
#[derive(Debug)]
pub struct Gateways {
    joined: Arc<Joined>,
    left: Option<mpsc::UnboundedReceiver<GatewayLeft>>,
    stop: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
}

impl Gateways {
    /// Starts reporting `registration` and `source` to every gateway of `entries` (each
    /// `host:port`) on the current tokio runtime, and returns at once: names are looked up and
    /// gateways connected in the background.
    ///
    /// # Errors
    /// [`ReportError::InvalidGateway`] for an entry that is not `host:port`, or no entry;
    /// nothing is spawned then.
    ///
    /// # Panics
    /// Outside a tokio runtime.
    pub fn spawn(
        entries: &[String],
        registration: Registration,
        source: Arc<dyn StateSource>,
        options: GatewaysOptions,
    ) -> Result<Self, ReportError> {
        let entries = entries
            .iter()
            .map(|e| GatewayEntry::parse(e))
            .collect::<Result<Vec<_>, _>>()?;
        if entries.is_empty() {
            return Err(ReportError::InvalidGateway {
                addr: String::new(),
                why: "no gateway given",
            });
        }
        let (joined, left) = Joined::new(&registration.cluster_token);
        let (stop, stop_rx) = watch::channel(false);
        let driver = Driver {
            entries,
            register: pb::Register::from(&registration),
            source,
            options,
            joined: joined.clone(),
            running: BTreeMap::new(),
            resolved_once: Vec::new(),
        };
        let task = tokio::spawn(driver.run(stop_rx));
        Ok(Self {
            joined,
            left: Some(left),
            stop,
            task: Some(task),
        })
    }

    /// The KV side channels the connected gateways registered: the union of their lists
    /// (kept while none is connected); `None` until a gateway sent one.
    pub fn peers(&self) -> watch::Receiver<Option<Vec<String>>> {
        self.joined.watch_peers()
    }

    /// The cluster token in effect: the node's own when it has one, else the first a gateway
    /// handed out.
    pub fn cluster_token(&self) -> watch::Receiver<Option<String>> {
        self.joined.watch_token()
    }

    /// The address the first gateway that said so saw this node register from.
    pub fn observed_host(&self) -> watch::Receiver<Option<String>> {
        self.joined.watch_observed_host()
    }

    /// Every gateway's stream that ended after its acknowledgement, other than by this node's
    /// stop (the node releases that gateway's leases). Taken once; `None` after.
    pub fn take_gateways_left(&mut self) -> Option<mpsc::UnboundedReceiver<GatewayLeft>> {
        self.left.take()
    }

    /// The gateways reported to now (one per address).
    pub fn gateways(&self) -> Vec<GatewayView> {
        self.joined.views()
    }

    /// Resolves with the last refusal once every gateway refused this node for good; never
    /// otherwise.
    pub async fn refused(&self) -> Arc<ReportError> {
        let mut all = self.joined.watch_all_refused();
        match all.wait_for(Option::is_some).await {
            Ok(e) => e.clone().unwrap_or_else(|| Arc::new(ReportError::Closed)),
            Err(_) => std::future::pending().await,
        }
    }

    /// Stops every reporter (each live stream ended cleanly) and returns once they ended.
    pub async fn shutdown(mut self) {
        self.stop.send_replace(true);
        if let Some(task) = self.task.take()
            && let Err(e) = task.await
        {
            warn!(error = %e, "the gateways' task did not end cleanly");
        }
    }
}

impl Drop for Gateways {
    fn drop(&mut self) {
        self.stop.send_replace(true);
    }
}

/// One reporter of the set.
#[derive(Debug)]
struct Running {
    key: u64,
    handle: ReporterHandle,
}

/// The task behind [`Gateways`]: resolves, starts and stops reporters.
struct Driver {
    entries: Vec<GatewayEntry>,
    register: pb::Register,
    source: Arc<dyn StateSource>,
    options: GatewaysOptions,
    joined: Arc<Joined>,
    /// Per entry, its reporters by address.
    running: BTreeMap<(usize, SocketAddr), Running>,
    /// Entries that resolved at least once.
    resolved_once: Vec<usize>,
}

/// Resolves once a stop is requested (or the handle is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

impl Driver {
    async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let names = self.entries.iter().any(|e| e.ip().is_none());
        let mut tick =
            tokio::time::interval(self.options.resolve_every.max(Duration::from_millis(10)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stopped(&mut stop) => break,
            }
            // A lookup that hangs does not hold a shutdown up.
            tokio::select! {
                () = self.resolve_all() => {}
                _ = stopped(&mut stop) => break,
            }
            if !names {
                // Addresses only: nothing will change.
                stopped(&mut stop).await;
                break;
            }
        }
        let stopping: Vec<_> = std::mem::take(&mut self.running)
            .into_values()
            .map(|r| tokio::spawn(r.handle.shutdown()))
            .collect();
        for s in stopping {
            let _ = s.await;
        }
    }

    /// Looks every entry up and brings the reporters in line.
    async fn resolve_all(&mut self) {
        for i in 0..self.entries.len() {
            let entry = self.entries[i].clone();
            let addrs = match entry.ip() {
                Some(ip) => vec![SocketAddr::new(ip, entry.port)],
                None => match self.options.resolver.resolve(&entry.host, entry.port).await {
                    Ok(mut a) => {
                        a.sort();
                        a.dedup();
                        a
                    }
                    Err(e) => {
                        debug!(gateway = %entry, error = %e, "cannot resolve the gateway's name; keeping its reporters");
                        continue;
                    }
                },
            };
            if !self.resolved_once.contains(&i) && !addrs.is_empty() {
                self.resolved_once.push(i);
            }
            self.converge(i, &entry, &addrs);
        }
        self.joined
            .set_unresolved(self.entries.len() - self.resolved_once.len());
    }

    /// Starts a reporter for each of `addrs` not reported to yet, stops those of entry `i`
    /// whose address is gone.
    fn converge(&mut self, i: usize, entry: &GatewayEntry, addrs: &[SocketAddr]) {
        let gone: Vec<(usize, SocketAddr)> = self
            .running
            .keys()
            .filter(|(e, a)| *e == i && !addrs.contains(a))
            .copied()
            .collect();
        for k in gone {
            if let Some(r) = self.running.remove(&k) {
                info!(gateway = %entry, addr = %k.1, "the gateway's address is gone; stop reporting to it");
                self.joined.remove(r.key);
                tokio::spawn(r.handle.shutdown());
            }
        }
        for addr in addrs {
            // Another entry already reports to this address.
            if self.running.keys().any(|(_, a)| a == addr) {
                continue;
            }
            match self.start(entry, *addr) {
                Ok(r) => {
                    self.running.insert((i, *addr), r);
                }
                Err(e) => {
                    warn!(gateway = %entry, addr = %addr, error = %e, "cannot report to this address")
                }
            }
        }
    }

    fn start(&self, entry: &GatewayEntry, addr: SocketAddr) -> Result<Running, ReportError> {
        let named = entry.ip().is_none();
        let label = match named {
            true => format!("{entry} at {addr}"),
            false => entry.to_string(),
        };
        let tls = self.options.reporter.tls.as_ref();
        let endpoint =
            pd_tls::grpc_endpoint_named(&addr.to_string(), tls, named.then_some(&*entry.host))
                .map_err(|source| ReportError::InvalidAddress {
                    addr: label.clone(),
                    source,
                })?;
        info!(gateway = %label, "reporting to the gateway");
        let key = self.joined.add(&label);
        let handle = Reporter::launch(
            Target {
                addr: label,
                endpoint,
            },
            self.register.clone(),
            self.source.clone(),
            self.options.reporter.clone(),
            self.joined.clone(),
            key,
        );
        Ok(Running { key, handle })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_parse_as_host_and_port() {
        let e = GatewayEntry::parse("pd-gateway-registry:50051").unwrap();
        assert_eq!(
            (e.host.as_str(), e.port, e.ip()),
            ("pd-gateway-registry", 50051, None)
        );
        let e = GatewayEntry::parse("http://10.0.0.1:7000/").unwrap();
        assert_eq!(e.to_string(), "10.0.0.1:7000");
        assert!(e.ip().is_some());
        let e = GatewayEntry::parse("https://[::1]:7000").unwrap();
        assert_eq!(
            (e.host.as_str(), e.to_string()),
            ("::1", "[::1]:7000".into())
        );
        for bad in [
            "",
            "host",
            "host:",
            "host:0",
            "host:99999",
            ":7000",
            "::1:7000",
            "[::1:7000",
            "[nothost]:7000",
            "grpc://host:7000",
            "host:7000/path",
        ] {
            assert!(
                matches!(
                    GatewayEntry::parse(bad),
                    Err(ReportError::InvalidGateway { .. })
                ),
                "{bad:?} accepted"
            );
        }
    }
}
