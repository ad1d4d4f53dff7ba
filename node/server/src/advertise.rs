//! Who a node is and where others reach it, as containers and several machines need it.
//!
//! - [`default_engine_id`]: unique across machines and PID namespaces (in a container every
//!   node is PID 1, so the pid names nothing), fixed for the process's life.
//! - [`Addresses`]: the host each thing the node publishes is advertised under (its HTTP API, its
//!   KV side channel, which `kv_transfer_params.remote_host` names). `--advertise-host` sets it
//!   for all; a node bound to a specific address advertises that one; a node bound to a
//!   wildcard address without one registers the wildcard, and the gateway lists it under the
//!   address its registration came from (and tells the node, which then names that host in its
//!   params). Never `0.0.0.0`.
//! - [`ucx_net_device`]: the network interface holding an address, so UCX publishes the same
//!   interface the node advertises (`UCX_NET_DEVICES`).

use std::net::{IpAddr, SocketAddr};

use tokio::sync::watch;

/// A default engine id: `<hostname>-<12 hex digits>` drawn at random per process (the hostname
/// is the pod's name under Kubernetes, so logs still say which machine), or `pd-node-<hex>`
/// when the hostname is not usable.
pub fn default_engine_id() -> String {
    let suffix = rand::random::<u64>() & 0xffff_ffff_ffff;
    match hostname().filter(|h| usable_name(h)) {
        Some(host) => format!("{host}-{suffix:012x}"),
        None => format!("pd-node-{suffix:012x}"),
    }
}

/// This machine's (this UTS namespace's) hostname.
fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
}

/// Letters, digits, `-`, `.` and `_`, 1 to 200 of them.
fn usable_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 200
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
}

/// The hosts a node advertises.
#[derive(Debug, Clone)]
pub struct Addresses {
    /// Host of the HTTP API and (unless `--kv-host`) the KV side channel; `None`: bound to a
    /// wildcard address with nothing advertised (the gateway fills it in).
    pub host: Option<String>,
    /// Host of the KV side channel: `--kv-host`, else `host`.
    pub kv_host: Option<String>,
}

impl Addresses {
    /// From `--advertise-host` (`advertise`), `--kv-host` (`kv_host`) and the address bound.
    pub fn new(advertise: Option<&str>, kv_host: Option<&str>, bound: IpAddr) -> Self {
        let host = advertise
            .map(bare)
            .filter(|h| !h.is_empty())
            .map(str::to_owned)
            .or_else(|| (!bound.is_unspecified()).then(|| bound.to_string()));
        let kv_host = kv_host.map(bare).map(str::to_owned).or(host.clone());
        Self { host, kv_host }
    }

    /// `host:port` of the HTTP API bound at `local`, as registered (a wildcard host when
    /// nothing is advertised).
    pub fn http(&self, local: SocketAddr) -> String {
        join(self.host.as_deref(), local)
    }

    /// `host:port` of the KV side channel bound at `local`, as registered.
    pub fn kv(&self, local: SocketAddr) -> String {
        join(self.kv_host.as_deref(), local)
    }

    /// The host put in `kv_transfer_params.remote_host`, kept current: the advertised one, else
    /// `127.0.0.1` (one machine, no gateway) until the gateway says where it saw the node
    /// (`observed`, followed on a task of the current runtime).
    pub fn remote_host(
        &self,
        observed: Option<watch::Receiver<Option<String>>>,
    ) -> watch::Receiver<String> {
        let (tx, rx) = watch::channel(
            self.kv_host
                .clone()
                .unwrap_or_else(|| "127.0.0.1".to_owned()),
        );
        if let (None, Some(mut observed)) = (&self.kv_host, observed) {
            tokio::spawn(async move {
                loop {
                    if let Some(h) = observed.borrow_and_update().clone() {
                        if *tx.borrow() != h {
                            tracing::info!(host = %h, "the gateway reaches this node at this address: KV handoffs name it");
                        }
                        tx.send_replace(h);
                    }
                    if observed.changed().await.is_err() {
                        return;
                    }
                }
            });
        }
        rx
    }
}

/// `host` without IPv6 brackets.
fn bare(host: &str) -> &str {
    host.trim().trim_start_matches('[').trim_end_matches(']')
}

/// `host:port` (IPv6 in brackets), `local`'s IP when `host` is `None`.
fn join(host: Option<&str>, local: SocketAddr) -> String {
    match host {
        Some(h) if h.contains(':') => format!("[{h}]:{}", local.port()),
        Some(h) => format!("{h}:{}", local.port()),
        None => local.to_string(),
    }
}

/// The network interface that holds `host` (for UCX's `NET_DEVICES`): the loopback interface
/// for a loopback address; `None` for wildcard addresses, names, or an address no interface has.
pub fn ucx_net_device(host: &str) -> Option<String> {
    let ip: IpAddr = bare(host).parse().ok()?;
    if ip.is_unspecified() {
        return None;
    }
    interfaces()
        .into_iter()
        .find(|(_, a)| *a == ip || (ip.is_loopback() && a.is_loopback()))
        .map(|(n, _)| n)
}

/// Every (interface, address) pair of this network namespace.
fn interfaces() -> Vec<(String, IpAddr)> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we own until freeifaddrs; every pointer read
    // below comes from that list and is checked for null first.
    unsafe {
        if libc::getifaddrs(&mut head) != 0 {
            return out;
        }
        let mut cur = head;
        while !cur.is_null() {
            let ifa = &*cur;
            cur = ifa.ifa_next;
            if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
                continue;
            }
            let name = std::ffi::CStr::from_ptr(ifa.ifa_name)
                .to_string_lossy()
                .into_owned();
            let ip = match i32::from((*ifa.ifa_addr).sa_family) {
                libc::AF_INET => {
                    let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    IpAddr::from(u32::from_be(sin.sin_addr.s_addr).to_be_bytes())
                }
                libc::AF_INET6 => {
                    let sin6 = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    IpAddr::from(sin6.sin6_addr.s6_addr)
                }
                _ => continue,
            };
            out.push((name, ip));
        }
        libc::freeifaddrs(head);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_ids_differ_per_process_and_name_the_machine() {
        let a = default_engine_id();
        let b = default_engine_id();
        assert_ne!(a, b);
        assert!(usable_name(&a), "{a}");
        if let Some(h) = hostname().filter(|h| usable_name(h)) {
            assert!(a.starts_with(&format!("{h}-")), "{a}");
        }
        assert!(!usable_name("") && !usable_name("a b") && !usable_name("a/b"));
    }

    #[test]
    fn a_wildcard_bind_advertises_nothing_until_told() {
        let any: IpAddr = "0.0.0.0".parse().unwrap();
        let local: SocketAddr = "0.0.0.0:8000".parse().unwrap();
        let a = Addresses::new(None, None, any);
        assert_eq!(a.host, None);
        assert_eq!(a.http(local), "0.0.0.0:8000");
        let a = Addresses::new(Some("10.0.0.5"), None, any);
        assert_eq!(a.http(local), "10.0.0.5:8000");
        assert_eq!(a.kv("0.0.0.0:9000".parse().unwrap()), "10.0.0.5:9000");
        let a = Addresses::new(Some("[fd00::5]"), Some("kv.example"), any);
        assert_eq!(a.http(local), "[fd00::5]:8000");
        assert_eq!(a.kv("0.0.0.0:9000".parse().unwrap()), "kv.example:9000");
        let bound: IpAddr = "10.0.0.6".parse().unwrap();
        let a = Addresses::new(None, None, bound);
        assert_eq!(a.http("10.0.0.6:1".parse().unwrap()), "10.0.0.6:1");
        assert_eq!(a.kv_host.as_deref(), Some("10.0.0.6"));
    }

    #[tokio::test]
    async fn params_name_the_address_the_gateway_saw() {
        let a = Addresses::new(None, None, "0.0.0.0".parse().unwrap());
        let (tx, rx) = watch::channel(None);
        let mut host = a.remote_host(Some(rx));
        assert_eq!(*host.borrow_and_update(), "127.0.0.1");
        tx.send_replace(Some("10.0.0.7".into()));
        host.changed().await.unwrap();
        assert_eq!(*host.borrow(), "10.0.0.7");
        // An advertised host is never replaced.
        let a = Addresses::new(Some("10.0.0.5"), None, "0.0.0.0".parse().unwrap());
        let (tx, rx) = watch::channel(None);
        let host = a.remote_host(Some(rx));
        tx.send_replace(Some("10.0.0.7".into()));
        tokio::task::yield_now().await;
        assert_eq!(*host.borrow(), "10.0.0.5");
    }

    #[test]
    fn loopback_is_offered_on_the_loopback_interface_and_wildcards_on_none() {
        // A node bound to loopback has only same-machine peers: UCX offers `lo` and never lists
        // the machine's other interfaces, which come and go under containers.
        assert_eq!(ucx_net_device("127.0.0.1").as_deref(), Some("lo"));
        assert_eq!(ucx_net_device("[::1]").as_deref(), Some("lo"));
        assert_eq!(ucx_net_device("0.0.0.0"), None);
        assert_eq!(ucx_net_device("some.name"), None);
        // Every non-loopback address of this machine maps to its interface.
        for (name, ip) in interfaces() {
            if !ip.is_loopback() && !matches!(ip, IpAddr::V6(v6) if v6.segments()[0] == 0xfe80) {
                assert!(ucx_net_device(&ip.to_string()).is_some(), "{name} {ip}");
            }
        }
    }
}
