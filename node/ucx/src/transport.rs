//! Which transports an endpoint uses, read from `ucp_ep_print_info`.
//!
//! UCX 1.13 has no `ucp_ep_query` for transports, so [`Endpoint::transport_report`] prints the
//! endpoint's configuration into a memstream and [`TransportReport::parse`] reads the lane lines.
//!
//! [`Endpoint::transport_report`]: crate::Endpoint::transport_report

use std::io;

use ucx_sys as sys;

use crate::error::{Error, Result};

/// One UCP lane of an endpoint: a transport on a device, and what UCP uses it for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lane {
    /// Lane index as UCX prints it.
    pub index: usize,
    /// Transport name, e.g. `cma`, `posix`, `sysv`, `tcp`, `rc_mlx5`.
    pub transport: String,
    /// Device name, e.g. `memory`, `lo`, `mlx5_0:1`.
    pub device: String,
    /// What UCP uses the lane for, as printed: `am`, `rma`, `rma_bw`, `amo`, `am_bw`, `rkey_ptr`,
    /// `wireup{...}` and so on (lower-cased, without the bracketed details).
    pub roles: Vec<String>,
}

impl Lane {
    /// `"transport/device"`, e.g. `"cma/memory"`.
    pub fn name(&self) -> String {
        format!("{}/{}", self.transport, self.device)
    }

    /// Whether UCP uses this lane for bulk one-sided operations (`rma`, `rma_bw`, `rkey_ptr`).
    ///
    /// UCX 1.13 prints the zero-copy `rma_bw` lanes but leaves plain `rma` lanes (used for small
    /// bcopy puts/gets, e.g. `posix` and `sysv` on loopback) without a role, so those report
    /// `false` here.
    pub fn is_rma(&self) -> bool {
        self.roles
            .iter()
            .any(|r| r == "rma" || r == "rma_bw" || r == "rkey_ptr")
    }
}

/// The lanes of one endpoint, plus the raw text they were parsed from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransportReport {
    /// Lanes in index order.
    pub lanes: Vec<Lane>,
    /// Full `ucp_ep_print_info` output (for logs).
    pub raw: String,
}

impl TransportReport {
    /// Parses `ucp_ep_print_info` output. Lane lines look like
    /// `#  lane[2]:  5:cma/memory.0 md[4]  -> md[4]/cma/sysdev[255] rma_bw#0`
    /// (UCX 1.13); lines that do not match are ignored.
    pub fn parse(raw: &str) -> Self {
        let mut lanes = Vec::new();
        for line in raw.lines() {
            let line = line.trim_start_matches('#').trim();
            let Some(rest) = line.strip_prefix("lane[") else {
                continue;
            };
            let Some((index, rest)) = rest.split_once("]:") else {
                continue;
            };
            let Ok(index) = index.trim().parse::<usize>() else {
                continue;
            };
            let mut words = rest.split_whitespace();
            // `8:posix/memory.0` -> resource index, transport, device (+ ".path").
            let Some(resource) = words.next() else {
                continue;
            };
            let tl_dev = resource.split_once(':').map_or(resource, |(_, t)| t);
            let Some((transport, device)) = tl_dev.split_once('/') else {
                continue;
            };
            let device = match device.rsplit_once('.') {
                Some((dev, path)) if path.chars().all(|c| c.is_ascii_digit()) => dev,
                _ => device,
            };
            // Roles follow the `-> md[..]/...` destination; words like `rma_bw#0` and `am`.
            let roles = words
                .skip_while(|w| *w != "->")
                .skip(2)
                .map(|w| {
                    let w = w.split(['#', '(', '{']).next().unwrap_or(w);
                    w.to_ascii_lowercase()
                })
                .filter(|w| !w.is_empty())
                .collect();
            lanes.push(Lane {
                index,
                transport: transport.to_string(),
                device: device.to_string(),
                roles,
            });
        }
        TransportReport {
            lanes,
            raw: raw.to_string(),
        }
    }

    /// Distinct `"transport/device"` names over all lanes, in lane order.
    pub fn transports(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for lane in &self.lanes {
            let name = lane.name();
            if !out.contains(&name) {
                out.push(name);
            }
        }
        out
    }

    /// Distinct `"transport/device"` names of the lanes that carry one-sided operations.
    pub fn rma_transports(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for lane in self.lanes.iter().filter(|l| l.is_rma()) {
            let name = lane.name();
            if !out.contains(&name) {
                out.push(name);
            }
        }
        out
    }
}

/// True when one-sided reads go over TCP only: every lane that carries bulk RMA is `tcp`, or
/// there is no RMA lane and every lane is `tcp` (UCP then emulates get/put with active messages
/// on the socket). Measured here: ~0.4 GB/s that way vs 20–50 GB/s with cma/shm for 2.25 MB
/// gets; a transfer layer should warn loudly when this is true.
pub fn is_tcp_emulated_rma(report: &TransportReport) -> bool {
    let rma: Vec<&Lane> = report.lanes.iter().filter(|l| l.is_rma()).collect();
    let lanes: Vec<&Lane> = if rma.is_empty() {
        report.lanes.iter().collect()
    } else {
        rma
    };
    !lanes.is_empty() && lanes.iter().all(|l| l.transport == "tcp")
}

/// Runs `print` against a memstream `FILE*` and returns what it wrote.
pub(crate) fn capture(print: impl FnOnce(*mut sys::FILE)) -> Result<String> {
    let mut buf: *mut libc::c_char = std::ptr::null_mut();
    let mut len: libc::size_t = 0;
    // SAFETY: both out-pointers are valid; open_memstream owns `buf` until fclose.
    let file = unsafe { libc::open_memstream(&mut buf, &mut len) };
    if file.is_null() {
        return Err(Error::Capture(io::Error::last_os_error()));
    }
    print(file.cast::<sys::FILE>());
    // SAFETY: `file` is the open memstream; after fclose `buf`/`len` hold the final contents.
    let rc = unsafe { libc::fclose(file) };
    let text = if buf.is_null() {
        String::new()
    } else {
        // SAFETY: after fclose, `buf` points to `len` initialised bytes (plus a NUL) that we own.
        let bytes = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), len) };
        let text = String::from_utf8_lossy(bytes).into_owned();
        // SAFETY: `buf` was allocated by open_memstream with malloc and is not used again.
        unsafe { libc::free(buf.cast()) };
        text
    };
    if rc != 0 {
        return Err(Error::Capture(io::Error::last_os_error()));
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Verbatim `ucp_ep_print_info` output from UCX 1.13.1 on loopback with default transports.
    const SHM_CMA: &str = "#
# UCP endpoint 
#
#               peer: <no debug data>
#                 lane[0]:  3:sysv/memory.0 md[2]           -> md[2]/sysv/sysdev[255] am am_bw#0
#                 lane[1]:  4:posix/memory.0 md[3]          -> md[3]/posix/sysdev[255]
#                 lane[2]:  5:cma/memory.0 md[4]            -> md[4]/cma/sysdev[255] rma_bw#0
#
#                 am_send: 0..<egr/short>..93..<egr/bcopy>..8256..<rndv>..(inf)
#                  put[0]: 0..<short>..4294967296..<bcopy>..(inf)
#                  get[0]: 0..<bcopy>..(inf)
#
#                  rma_bw: mds rndv_rkey_size 9
#
";

    /// The same with `UCP_ERR_HANDLING_MODE_PEER` (or `UCX_TLS=tcp`): one tcp lane.
    const TCP: &str = "#
#                 lane[0]:  1:tcp/lo.0 md[1]                -> md[1]/tcp/sysdev[255] am am_bw#0 keepalive wireup
#                 am_send: 0..<egr/short>..8185..<egr/zcopy>..20553..<rndv>..(inf)
#                  rma_bw: mds rndv_rkey_size 9
";

    #[test]
    fn parses_ucx_113_lane_lines() {
        let r = TransportReport::parse(SHM_CMA);
        assert_eq!(r.lanes.len(), 3);
        assert_eq!(
            r.transports(),
            ["sysv/memory", "posix/memory", "cma/memory"]
        );
        assert_eq!(r.lanes[0].roles, ["am", "am_bw"]);
        assert!(r.lanes[1].roles.is_empty());
        assert_eq!(r.rma_transports(), ["cma/memory"]);
        assert!(!is_tcp_emulated_rma(&r));
    }

    #[test]
    fn tcp_only_is_emulated() {
        let r = TransportReport::parse(TCP);
        assert_eq!(r.transports(), ["tcp/lo"]);
        assert_eq!(r.lanes[0].roles, ["am", "am_bw", "keepalive", "wireup"]);
        assert!(r.rma_transports().is_empty());
        assert!(is_tcp_emulated_rma(&r));
        assert!(!is_tcp_emulated_rma(&TransportReport::parse("")));
    }
}
