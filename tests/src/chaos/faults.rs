//! Faults on harness hosts: packet filters (nftables) that partition a host from some peers, a
//! bad link (loss, and delay where the kernel has `netem`), and a wall clock off by some
//! seconds (libfaketime). Each is made inside the host's own network namespace, so only the
//! harness's hosts are touched; a [`Filter`] is removed by [`Filter::heal`] (and goes with its
//! host in any case).

use std::net::Ipv4Addr;
use std::process::{Command, Stdio};

use crate::hosts::Host;

/// The nftables table every fault lives in, on its host.
const TABLE: &str = "pdchaos";

/// Rules in force on a host until healed.
#[derive(Debug)]
pub struct Filter<'a> {
    host: &'a Host,
    tc: bool,
}

/// Runs `program args` on `host` with `stdin`; panics with its output when it fails.
fn on(host: &Host, program: &str, args: &[&str], stdin: &str) {
    let mut child = host
        .command(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "{program} on {}: {e} (scripts/setup.sh installs it)",
                host.name
            )
        });
    if let Some(mut i) = child.stdin.take() {
        std::io::Write::write_all(&mut i, stdin.as_bytes()).expect("writing stdin");
    }
    let out = child.wait_with_output().expect("waiting");
    assert!(
        out.status.success(),
        "`{program} {}` on {}: {}\n{stdin}",
        args.join(" "),
        host.name,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `{ a, b }` for nft.
fn set(addrs: &[Ipv4Addr]) -> String {
    let v: Vec<String> = addrs.iter().map(Ipv4Addr::to_string).collect();
    format!("{{ {} }}", v.join(", "))
}

/// Drops every packet between `host` and `peers`, both ways (TCP connections to them hang, as
/// behind a dead switch port); everything else flows.
pub fn partition<'a>(host: &'a Host, peers: &[Ipv4Addr]) -> Filter<'a> {
    let peers = set(peers);
    let rules = format!(
        "table inet {TABLE} {{\n\
           chain input {{ type filter hook input priority 0; ip saddr {peers} drop; }}\n\
           chain output {{ type filter hook output priority 0; ip daddr {peers} drop; }}\n\
         }}\n"
    );
    on(host, "nft", &["-f", "-"], &rules);
    Filter { host, tc: false }
}

/// Whether this kernel has `netem` (many VMs' kernels do not).
pub fn has_netem(host: &Host) -> bool {
    let ok = host
        .command("tc")
        .args(["qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if ok {
        let _ = host
            .command("tc")
            .args(["qdisc", "del", "dev", "lo", "root"])
            .status();
    }
    ok
}

/// A bad link on `host`'s `eth0`: `loss_pct` of packets dropped each way (nftables, random),
/// and with `netem` 50 ms of delay each way; without it the link's rate is capped instead
/// (`tbf`, `rate_mbit`, 50 ms of queue), so that packets wait. Returns the filter and what it
/// did, in words.
pub fn bad_link(host: &Host, loss_pct: u32, rate_mbit: u32) -> (Filter<'_>, String) {
    let rules = format!(
        "table inet {TABLE} {{\n\
           chain input {{ type filter hook input priority 0; iifname \"eth0\" numgen random mod 100 < {loss_pct} drop; }}\n\
           chain output {{ type filter hook output priority 0; oifname \"eth0\" numgen random mod 100 < {loss_pct} drop; }}\n\
         }}\n"
    );
    on(host, "nft", &["-f", "-"], &rules);
    let what = if has_netem(host) {
        on(
            host,
            "tc",
            &[
                "qdisc", "add", "dev", "eth0", "root", "netem", "delay", "50ms",
            ],
            "",
        );
        format!("{loss_pct}% loss, 50 ms delay")
    } else {
        let rate = format!("{rate_mbit}mbit");
        on(
            host,
            "tc",
            &[
                "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", &rate, "burst", "32kb",
                "latency", "50ms",
            ],
            "",
        );
        format!("{loss_pct}% loss, {rate_mbit} Mbit/s (no netem here)")
    };
    (Filter { host, tc: true }, what)
}

impl Filter<'_> {
    /// Removes the rules.
    pub fn heal(self) {
        on(self.host, "nft", &["delete", "table", "inet", TABLE], "");
        if self.tc {
            on(
                self.host,
                "tc",
                &["qdisc", "del", "dev", "eth0", "root"],
                "",
            );
        }
    }
}

/// The environment that sets a process's wall clock `offset` from the machine's (`+30s`,
/// `-30s`) with libfaketime, its monotonic clock untouched (as a host whose NTP is off).
pub fn clock_off(offset: &str) -> Vec<(String, String)> {
    let lib = [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib",
    ]
    .iter()
    .map(|d| format!("{d}/faketime/libfaketime.so.1"))
    .find(|p| std::path::Path::new(p).exists())
    .expect("libfaketime (scripts/setup.sh installs Debian's faketime)");
    vec![
        ("LD_PRELOAD".into(), lib),
        ("FAKETIME".into(), offset.into()),
        ("FAKETIME_DONT_FAKE_MONOTONIC".into(), "1".into()),
        ("FAKETIME_NO_CACHE".into(), "1".into()),
    ]
}

/// Checks that `date` under [`clock_off`] is off by about `seconds` (the library works here).
pub fn clock_is_off(env: &[(String, String)], seconds: i64) -> bool {
    let now = |env: &[(String, String)]| -> Option<i64> {
        let out = Command::new("date")
            .arg("+%s")
            .envs(env.iter().map(|(k, v)| (k, v)))
            .output()
            .ok()?;
        String::from_utf8_lossy(&out.stdout).trim().parse().ok()
    };
    match (now(&[]), now(env)) {
        (Some(real), Some(fake)) => (fake - real - seconds).abs() <= 2,
        _ => false,
    }
}
