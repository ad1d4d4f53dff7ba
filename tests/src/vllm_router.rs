//! vLLM's own router (`vllm-router`, PyPI's wheel, `scripts/vllm-router.sh`) in P/D mode
//! (`--vllm-pd-disaggregation`) in front of our prefill and decode nodes, as a vLLM operator
//! would run it.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::bins::installed_tool;
use crate::envoy::free_port;
use crate::process::Proc;

/// The binary: `PD_TEST_VLLM_ROUTER` when set (`scripts/test.sh` sets it), else what
/// `scripts/vllm-router.sh` installs (not under `CI=true`, which must set it).
pub fn binary() -> PathBuf {
    installed_tool("PD_TEST_VLLM_ROUTER", "vllm-router.sh")
}

/// A running `vllm-router`.
#[derive(Debug)]
pub struct VllmRouter {
    /// `http://127.0.0.1:PORT`.
    pub http: String,
    /// The process.
    pub proc: Proc,
}

impl VllmRouter {
    /// Starts it in `dir` over `prefill` and `decode` (`http://host:port` each, round robin,
    /// vLLM's NIXL connector protocol) and waits until `/health` answers.
    pub async fn start(dir: &std::path::Path, prefill: &[String], decode: &[String]) -> Self {
        let (port, metrics) = (free_port(), free_port());
        let mut cmd = Command::new(binary());
        cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--vllm-pd-disaggregation", "--kv-connector", "nixl"])
            .args(["--policy", "round_robin", "--log-level", "warning"])
            .args(["--prometheus-port", &metrics.to_string()]);
        for p in prefill {
            cmd.args(["--prefill", p]);
        }
        for d in decode {
            cmd.args(["--decode", d]);
        }
        let proc = Proc::spawn("vllm-router", cmd, dir);
        let http = format!("http://127.0.0.1:{port}");
        let client = reqwest::Client::new();
        let start = Instant::now();
        loop {
            let up = client.get(format!("{http}/health")).send().await;
            if up.is_ok_and(|r| r.status().is_success()) {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "vllm-router did not come up: {}",
                proc.log_tail(30)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Self { http, proc }
    }
}
