//! A [`TestCluster`]'s questions to the gateway: the admin API's node list and policy,
//! waiting for the view to change, and metrics scrapes.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{ADMIN_TOKEN, Role, TestCluster};
use crate::metrics::{Metrics, scrape};

impl TestCluster {
    /// `GET /admin/nodes`' node list.
    pub async fn admin_nodes(&self) -> Vec<Value> {
        let (status, v) = self.admin_get("/admin/nodes").await;
        assert_eq!(status, 200, "GET /admin/nodes: {v}");
        v["nodes"].as_array().cloned().unwrap_or_default()
    }

    /// The engine ids `/admin/nodes` lists.
    pub async fn listed(&self) -> Vec<String> {
        let mut ids: Vec<String> = self
            .admin_nodes()
            .await
            .iter()
            .filter_map(|n| n["engine_id"].as_str().map(str::to_owned))
            .collect();
        ids.sort();
        ids
    }

    /// Waits until `/admin/nodes` lists every id of `ids` as routable (a new KV node settles
    /// for a moment first), each with the role it was started with.
    pub async fn wait_listed(&self, ids: &[&str], timeout: Duration) {
        let start = Instant::now();
        loop {
            let nodes = self.admin_nodes().await;
            let missing: Vec<&str> = ids
                .iter()
                .copied()
                .filter(|id| {
                    !nodes
                        .iter()
                        .any(|n| n["engine_id"] == *id && n["routable"] == true)
                })
                .collect();
            if missing.is_empty() {
                for n in &nodes {
                    let id = n["engine_id"].as_str().unwrap_or("");
                    if let Some(node) = self.nodes.iter().find(|x| x.engine_id == id) {
                        assert_eq!(
                            n["role"],
                            node.role.label(),
                            "the gateway's role for {id}: {n}"
                        );
                    }
                }
                return;
            }
            if start.elapsed() > timeout {
                let logs: String = self
                    .nodes
                    .iter()
                    .filter(|n| missing.contains(&n.engine_id.as_str()))
                    .map(|n| format!("--- {}:\n{}\n", n.engine_id, n.proc.log_tail(30)))
                    .collect();
                panic!(
                    "the gateway did not list {missing:?} within {timeout:?}; it lists {nodes:?}\n\
                     gateway log:\n{}\n{logs}",
                    self.gateway.proc.log_tail(30)
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until the gateway's view shows no request queued, running or parked on any node,
    /// and none open or reserved there by the gateway (a node may report a finished request
    /// after the gateway saw its answer's last byte: until its next report the view counts it,
    /// up to 100 ms). Policies
    /// that weigh load (the keep rule) then decide on an idle cluster.
    pub async fn wait_view_idle(&self, timeout: Duration) {
        let start = Instant::now();
        loop {
            let nodes = self.admin_nodes().await;
            let busy = |n: &Value| {
                [
                    "waiting",
                    "running",
                    "waiting_remote_kv",
                    "gateway_open_requests",
                    "gateway_reserved_requests",
                ]
                .iter()
                .any(|f| n[*f].as_u64().unwrap_or(0) > 0)
            };
            if !nodes.iter().any(busy) {
                return;
            }
            assert!(
                start.elapsed() < timeout,
                "the view did not go idle within {timeout:?}: {nodes:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Waits until `/admin/nodes` no longer lists `engine_id`; returns how long that took.
    pub async fn wait_unlisted(&self, engine_id: &str, timeout: Duration) -> Duration {
        crate::eventually(
            &format!("{engine_id} to leave /admin/nodes"),
            timeout,
            async || !self.listed().await.iter().any(|id| id == engine_id),
        )
        .await
    }

    /// The gateway's metrics.
    pub async fn gateway_metrics(&self) -> Metrics {
        scrape(&self.client, &self.gateway.http).await
    }

    /// A node's metrics.
    pub async fn node_metrics(&self, engine_id: &str) -> Metrics {
        self.node(engine_id).metrics(&self.client).await
    }

    /// Sum of `name{filter}` over every node of `role`.
    pub async fn sum_over(&self, role: Role, name: &str, filter: &[(&str, &str)]) -> f64 {
        let mut total = 0.0;
        for n in self.role(role) {
            total += n.metrics(&self.client).await.sum(name, filter);
        }
        total
    }

    /// `PUT /admin/policy` with `query` and `body`; returns the status and the JSON answer.
    pub async fn put_policy(&self, query: &[(&str, &str)], body: Vec<u8>) -> (u16, Value) {
        let url = format!("{}/admin/policy", self.gateway.admin);
        let resp = self
            .client
            .put(&url)
            .query(query)
            .bearer_auth(ADMIN_TOKEN)
            .body(body)
            .send()
            .await
            .unwrap_or_else(|e| panic!("PUT {url}: {e}"));
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    /// Pushes the guest policy file `wasm` under `name`, with extra `query` pairs.
    pub async fn push_policy(
        &self,
        wasm: &Path,
        name: &str,
        query: &[(&str, &str)],
    ) -> (u16, Value) {
        let bytes =
            std::fs::read(wasm).unwrap_or_else(|e| panic!("reading {}: {e}", wasm.display()));
        let mut q = vec![("name", name)];
        q.extend_from_slice(query);
        self.put_policy(&q, bytes).await
    }

    /// `GET /admin/policy`.
    pub async fn policy(&self) -> Value {
        let (status, v) = self.admin_get("/admin/policy").await;
        assert_eq!(status, 200, "GET /admin/policy: {v}");
        v
    }
}
