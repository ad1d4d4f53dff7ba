//! A network interface that vanishes between `ucp_init` and `ucp_worker_create` (a container's
//! veth on a busy machine) fails every later worker of that context with "No such device";
//! a context told which devices to use (`NET_DEVICES`) never lists it. Needs root and
//! iproute2 (as the cluster tests' hosts do); a veth pair of our own, removed after.

use std::process::Command;

use pd_ucx::{Context, Features, Worker};

/// `UCS_ERR_NO_DEVICE`.
const NO_DEVICE: i8 = -14;

/// A veth pair (this kernel may lack the dummy driver), one end with an address, both up;
/// removed on drop.
struct Veth(String);

impl Veth {
    fn add(name: &str, cidr: &str) -> Self {
        let _ = Command::new("ip").args(["link", "del", name]).status();
        let peer = format!("{name}p");
        for args in [
            vec!["link", "add", name, "type", "veth", "peer", "name", &peer],
            vec!["addr", "add", cidr, "dev", name],
            vec!["link", "set", name, "up"],
            vec!["link", "set", &peer, "up"],
        ] {
            let ok = Command::new("ip").args(&args).status().expect("ip");
            assert!(ok.success(), "ip {args:?}");
        }
        Veth(name.to_owned())
    }
}

impl Drop for Veth {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["link", "del", &self.0]).status();
    }
}

#[test]
fn a_vanished_interface_fails_workers_unless_the_context_names_its_devices() {
    let name = format!("pdvanish{}", std::process::id() % 10_000);
    // Listed by the context, gone before the worker: every worker creation fails (the
    // worker's retries cannot help; the context's list is stale for good).
    let veth = Veth::add(&name, "10.253.0.1/32");
    let ctx = Context::new().unwrap();
    drop(veth);
    let err = Worker::new(&ctx).expect_err("a worker over a vanished interface");
    assert_eq!(err.status(), Some(NO_DEVICE), "{err}");

    // The same, with the context told to use loopback only: the interface is never listed.
    let veth = Veth::add(&name, "10.253.0.1/32");
    let ctx = Context::with_config(Features::default(), &[("NET_DEVICES", "lo")]).unwrap();
    drop(veth);
    Worker::new(&ctx).unwrap();
}
