//! Restarting the gateway of a [`TestCluster`] in place: killed (`SIGKILL`, nothing flushed)
//! and started again on the same ports, so the nodes' reporters find it where they left it.

use std::time::{Duration, Instant};

use super::{Gateway, GatewayPorts, TestCluster, port_of};

impl TestCluster {
    /// Kills the gateway with `SIGKILL` and starts another on its ports with `extra` flags (the
    /// test's own: a restarted gateway remembers only what its flags keep, e.g.
    /// `--state-dir`); waits until the new one lists every node again, drained ones included.
    pub async fn restart_gateway(&mut self, extra: &[String], timeout: Duration) {
        assert!(
            self.net.is_none(),
            "restart_gateway runs the gateway on this machine only"
        );
        let ports = GatewayPorts {
            http: port_of(&self.gateway.http),
            registry: port_of(&self.gateway.registry),
            admin: port_of(&self.gateway.admin),
        };
        self.gateway.proc.kill_and_wait();
        self.gateway = Gateway::start_at(&self.dir, extra, None, ports);
        let ids: Vec<String> = self.nodes.iter().map(|n| n.engine_id.clone()).collect();
        let start = Instant::now();
        loop {
            let nodes = self.admin_nodes().await;
            let listed = ids
                .iter()
                .all(|id| nodes.iter().any(|n| n["engine_id"] == id.as_str()));
            if listed {
                return;
            }
            assert!(
                start.elapsed() < timeout,
                "the restarted gateway lists {nodes:?}, not every one of {ids:?}:\n{}",
                self.gateway.proc.log_tail(30)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
