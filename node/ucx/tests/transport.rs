//! The transport report names the real transports of a loopback endpoint.

use crate::common::wait_both;
use pd_ucx::{Context, EndpointOptions, Worker, is_tcp_emulated_rma};

#[test]
fn report_names_transports() {
    let ctx = Context::new().unwrap();
    let a = Worker::new(&ctx).unwrap();
    let b = Worker::new(&ctx).unwrap();
    let ep = b.connect(&a.address().unwrap()).unwrap();
    wait_both(ep.flush().unwrap(), &a).unwrap();
    let report = ep.transport_report().unwrap();
    eprintln!(
        "default: {:?} (rma lanes {:?})",
        report.transports(),
        report.rma_transports()
    );
    assert!(
        !report.lanes.is_empty(),
        "no lanes parsed from:\n{}",
        report.raw
    );
    assert!(
        report
            .transports()
            .iter()
            .all(|t| t.split('/').count() == 2)
    );
    if std::env::var_os("UCX_TLS").is_none() {
        // Default transports on one host are shared memory and cma, never tcp alone.
        assert!(
            !is_tcp_emulated_rma(&report),
            "fell back to tcp: {}",
            report.raw
        );
    }
    wait_both(ep.close().unwrap(), &a).unwrap();
}

/// UCX 1.13 quirk: peer-failure handling excludes shm/cma, so such an endpoint lands on tcp.
#[test]
fn peer_error_mode_report() {
    let ctx = Context::new().unwrap();
    let a = Worker::new(&ctx).unwrap();
    let b = Worker::new(&ctx).unwrap();
    let opts = EndpointOptions {
        peer_error_handling: true,
        ..EndpointOptions::default()
    };
    let ep = b.connect_with(&a.address().unwrap(), opts).unwrap();
    wait_both(ep.flush().unwrap(), &a).unwrap();
    let report = ep.transport_report().unwrap();
    eprintln!(
        "peer-error mode: {:?} (tcp-emulated rma: {})",
        report.transports(),
        is_tcp_emulated_rma(&report)
    );
    assert!(!report.lanes.is_empty());
    wait_both(ep.close().unwrap(), &a).unwrap();
}

/// Asking for `UCP_FEATURE_WAKEUP` (event-driven progress) must not move KV reads off shared
/// memory: the transports and the RMA lane are the same as without it.
#[test]
fn wakeup_feature_keeps_the_transports() {
    let report = |features: pd_ucx::Features| {
        let ctx = Context::with_features(features).unwrap();
        let a = Worker::new(&ctx).unwrap();
        let b = Worker::new(&ctx).unwrap();
        let ep = b.connect(&a.address().unwrap()).unwrap();
        wait_both(ep.flush().unwrap(), &a).unwrap();
        let r = ep.transport_report().unwrap();
        wait_both(ep.close().unwrap(), &a).unwrap();
        r
    };
    let plain = report(pd_ucx::Features::default());
    let wakeup = report(pd_ucx::Features {
        wakeup: true,
        ..pd_ucx::Features::default()
    });
    eprintln!(
        "without wakeup: {:?} rma {:?}\nwith wakeup: {:?} rma {:?}",
        plain.transports(),
        plain.rma_transports(),
        wakeup.transports(),
        wakeup.rma_transports()
    );
    assert_eq!(plain.rma_transports(), wakeup.rma_transports());
}

/// The context says which memory it can register: host memory always; CUDA memory only where
/// UCX was built with CUDA support and a GPU driver is present (never on Debian's UCX, which
/// this machine and CI run: the GPU path then stages KV through host memory).
#[test]
fn the_context_says_which_memory_it_registers() {
    let ctx = Context::new().unwrap();
    let types = ctx.memory_types().unwrap();
    assert_eq!(types & 1, 1, "host memory: {types:#b}");
    let cuda = ctx.registers_cuda_memory().unwrap();
    assert_eq!(cuda, types & 2 == 2);
    if !std::path::Path::new("/dev/nvidia0").exists() {
        assert!(!cuda, "no GPU here, yet UCX claims CUDA memory: {types:#b}");
    }
}
