//! Several gateways and nodes that report to all of them at once (`pd-node --gateway g1,g2`):
//! active-active gateways, on this machine.
//!
//! [`SeveralGateways::start`] generates the tiny model, starts every `pd-gateway serve` (each in
//! a scratch directory of its own, for its log), then the prefill nodes and then the decode
//! nodes, each given every gateway's registry, and waits until every gateway lists every node
//! and every decode node knows every producer. Engine ids as [`super::TestCluster`]'s: `p0, ...`,
//! `d0, ...`.
//!
//! [`SeveralGateways::start_on_hosts`] puts every process on a host of its own
//! ([`crate::hosts`]); the gateways serve their registry on one port, and the nodes are given
//! one name, [`REGISTRY_NAME`], which every host's `/etc/hosts` resolves to every gateway (as a
//! headless Service's DNS name does); [`SeveralGateways::add_gateway`] starts one more behind
//! the name.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{
    ADMIN_TOKEN, Gateway, GatewayPorts, Node, NodeStart, READY_TIMEOUT, REGISTRY_NAME, Role,
    port_of, tiny_model,
};
use crate::hosts::{Host, Net, Place};
use crate::metrics::{Metrics, scrape};
use crate::process::WorkDir;

/// What to start.
#[derive(Debug, Clone, Default)]
pub struct SeveralSpec {
    /// `pd-gateway serve` processes (all with the test cluster token).
    pub gateways: usize,
    /// Prefill nodes.
    pub prefill: usize,
    /// Decode nodes.
    pub decode: usize,
    /// Extra flags for every gateway.
    pub gateway_args: Vec<String>,
    /// Extra flags for prefill nodes.
    pub prefill_args: Vec<String>,
    /// Extra flags for decode nodes.
    pub decode_args: Vec<String>,
    /// Extra flags for every node.
    pub node_args: Vec<String>,
}

/// Gateways and the nodes reporting to all of them.
#[derive(Debug)]
pub struct SeveralGateways {
    /// The gateways, in the order given to the nodes.
    pub gateways: Vec<Gateway>,
    /// The nodes, prefill first.
    pub nodes: Vec<Node>,
    /// The model directory.
    pub model: PathBuf,
    /// A client for tests to share.
    pub client: reqwest::Client,
    /// The hosts' bridge, on hosts (dropped after the processes).
    pub net: Option<Net>,
    /// The registry port of every gateway, on hosts.
    pub registry_port: Option<u16>,
    gateway_args: Vec<String>,
    /// Every prefill node's flags, then every decode node's (for restarts).
    node_args: Vec<Vec<String>>,
    // Last: dropped after the processes, so their logs are still there to print.
    gateway_dirs: Vec<WorkDir>,
    dir: WorkDir,
}

impl SeveralGateways {
    /// Starts `spec`; returns once every gateway lists every node as routable and every
    /// decode node has a peer list naming every producer.
    pub async fn start(name: &str, spec: SeveralSpec) -> Self {
        let dir = WorkDir::new(name);
        let model = tiny_model(&dir);
        let gateway_dirs: Vec<WorkDir> = (0..spec.gateways)
            .map(|i| WorkDir::new(&format!("{name}-g{}", i + 1)))
            .collect();
        let gateways: Vec<Gateway> = gateway_dirs
            .iter()
            .map(|d| Gateway::start(d, &spec.gateway_args))
            .collect();
        let registries: Vec<String> = gateways.iter().map(|g| g.registry.clone()).collect();
        let registries = registries.join(",");
        let mut c = Self {
            gateways,
            nodes: Vec::new(),
            model,
            client: reqwest::Client::new(),
            net: None,
            registry_port: None,
            gateway_args: spec.gateway_args.clone(),
            node_args: Vec::new(),
            gateway_dirs,
            dir,
        };
        c.start_nodes(&spec, &registries).await;
        c
    }

    /// [`SeveralGateways::start`] with every process on a host of its own, the nodes given
    /// `REGISTRY_NAME:PORT`, the name resolving to every gateway.
    pub async fn start_on_hosts(name: &str, spec: SeveralSpec) -> Self {
        let mut c = Self::hosts(name, &spec);
        c.start_on_net(&spec).await;
        c
    }

    /// The hosts' net and the model for [`SeveralGateways::start_on_net`], nothing started yet
    /// (for what the gateways need first: a state store on the net).
    pub fn hosts(name: &str, spec: &SeveralSpec) -> Self {
        let dir = WorkDir::new(name);
        let model = tiny_model(&dir);
        let net = Net::new(dir.path());
        Self {
            gateways: Vec::new(),
            nodes: Vec::new(),
            model,
            client: reqwest::Client::new(),
            net: Some(net),
            registry_port: None,
            gateway_args: spec.gateway_args.clone(),
            node_args: Vec::new(),
            gateway_dirs: Vec::new(),
            dir,
        }
    }

    /// Starts `spec`'s gateways and then its nodes on the net of [`SeveralGateways::hosts`].
    pub async fn start_on_net(&mut self, spec: &SeveralSpec) {
        self.gateway_args = spec.gateway_args.clone();
        for _ in 0..spec.gateways {
            self.add_gateway();
        }
        let port = self.registry_port.unwrap_or_default();
        self.start_nodes(spec, &format!("{REGISTRY_NAME}:{port}"))
            .await;
    }

    /// On hosts: starts one more gateway on a host of its own, serving its registry on the
    /// others' port, and adds its address to [`REGISTRY_NAME`]; returns its index once it
    /// listens (the nodes find it at their next lookup).
    pub fn add_gateway(&mut self) -> usize {
        let g = self.gateways.len();
        let net = self.net.as_ref().expect("a cluster on hosts");
        let host: Host = net.host(&format!("gw{}", g + 1));
        let dir = WorkDir::new(&format!("gw{}", g + 1));
        let ports = GatewayPorts {
            registry: self.registry_port.unwrap_or(0),
            ..GatewayPorts::default()
        };
        let gateway = Gateway::start_at(&dir, &self.gateway_args, Some(host), ports);
        let host = gateway.host.as_ref().expect("on its host");
        net.alias(REGISTRY_NAME, host);
        self.registry_port = self.registry_port.or(Some(port_of(&gateway.registry)));
        self.gateways.push(gateway);
        self.gateway_dirs.push(dir);
        g
    }

    /// On hosts: kills gateway `g` (`SIGKILL`) and starts another on its host and ports, with
    /// the gateways' flags; waits until it lists every node as routable.
    pub async fn restart_gateway(&mut self, g: usize, timeout: Duration) {
        let old = &mut self.gateways[g];
        old.proc.kill_and_wait();
        let ports = GatewayPorts {
            http: port_of(&old.http),
            registry: port_of(&old.registry),
            admin: port_of(&old.admin),
        };
        let host = old.host.take().expect("a gateway on a host");
        let fresh = Gateway::start_at(&self.gateway_dirs[g], &self.gateway_args, Some(host), ports);
        self.gateways[g] = fresh;
        let ids: Vec<String> = self.nodes.iter().map(|n| n.engine_id.clone()).collect();
        let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
        self.wait_listed(g, &ids, timeout).await;
    }

    /// Kills node `engine_id` with `SIGKILL` (start it again with
    /// [`SeveralGateways::restart_node`]).
    pub fn kill_node(&mut self, engine_id: &str) {
        let i = self.index_of(engine_id);
        let _ = self.nodes[i].proc.kill_and_wait();
    }

    /// Stops node `engine_id` as an operator does (`SIGTERM`: it drains, then exits); waits
    /// for its exit, at most `timeout` (then kills it). Start it again with
    /// [`SeveralGateways::restart_node`].
    pub fn stop_node(&mut self, engine_id: &str, timeout: Duration) {
        let i = self.index_of(engine_id);
        let proc = &mut self.nodes[i].proc;
        proc.signal(libc::SIGTERM);
        if proc.wait_exit(timeout).is_none() {
            let _ = proc.kill_and_wait();
        }
    }

    fn index_of(&self, engine_id: &str) -> usize {
        self.nodes
            .iter()
            .position(|n| n.engine_id == engine_id)
            .unwrap_or_else(|| panic!("no node {engine_id}"))
    }

    /// The engine id of the `i`-th node of `role` (ids change when a node restarts as another).
    pub fn id_of(&self, role: Role, i: usize) -> String {
        let n = self.nodes.iter().filter(|n| n.role == role).nth(i);
        n.unwrap_or_else(|| panic!("no {role:?} node {i}"))
            .engine_id
            .clone()
    }

    /// On hosts: kills node `engine_id` (`SIGKILL`) and starts it again on its host as
    /// `new_id` (the same id, or a new one), with `env` added; waits until every gateway lists
    /// it and every decode node knows every producer.
    pub async fn restart_node(&mut self, engine_id: &str, new_id: &str, env: &[(String, String)]) {
        let i = self.index_of(engine_id);
        let _ = self.nodes[i].proc.kill_and_wait();
        let host = self.nodes[i].host.take().expect("a node on a host");
        let role = self.nodes[i].role;
        let port = self.registry_port.unwrap_or_default();
        let gateways = format!("{REGISTRY_NAME}:{port}");
        let start = NodeStart {
            dir: self.dir.path(),
            model: &self.model,
            engine_id: new_id,
            named: true,
            role,
            gateway: Some(&gateways),
            env,
        };
        let place = Place::On(&host);
        let proc = Node::spawn(start, place, &self.node_args[role_index(role)]);
        let mut node = Node::listening(new_id, role, proc, place);
        node.host = Some(host);
        self.nodes[i] = node;
        for g in 0..self.gateways.len() {
            self.wait_listed(g, &[new_id], READY_TIMEOUT).await;
        }
        self.wait_peers_known(READY_TIMEOUT).await;
    }

    /// Starts the prefill nodes, then the decode nodes, each given `gateways`; waits until
    /// every gateway lists them and every decode node knows every producer.
    async fn start_nodes(&mut self, spec: &SeveralSpec, gateways: &str) {
        self.node_args = [&spec.prefill_args, &spec.decode_args]
            .map(|extra| [&spec.node_args[..], &extra[..]].concat())
            .to_vec();
        for (role, count) in [(Role::Prefill, spec.prefill), (Role::Decode, spec.decode)] {
            let mut ids = Vec::new();
            for i in 0..count {
                let id = format!("{}{i}", role.id_prefix());
                let all = self.node_args[role_index(role)].clone();
                let host = self.net.as_ref().map(|n| n.host(&id));
                let place = host.as_ref().map_or(Place::Local, Place::On);
                let start = NodeStart {
                    dir: self.dir.path(),
                    model: &self.model,
                    engine_id: &id,
                    named: true,
                    role,
                    gateway: Some(gateways),
                    env: &[],
                };
                let proc = Node::spawn(start, place, &all);
                let mut node = Node::listening(&id, role, proc, place);
                node.host = host;
                self.nodes.push(node);
                ids.push(id);
            }
            let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
            for g in 0..self.gateways.len() {
                self.wait_listed(g, &ids, READY_TIMEOUT).await;
            }
        }
        self.wait_peers_known(READY_TIMEOUT).await;
    }

    /// Every gateway's OpenAI port as `host:port`, for a balancer in front of them.
    pub fn upstreams(&self) -> Vec<String> {
        self.gateways
            .iter()
            .map(|g| g.http.trim_start_matches("http://").to_owned())
            .collect()
    }

    /// The scratch directory (logs, model).
    pub fn dir(&self) -> &WorkDir {
        &self.dir
    }

    /// The node `engine_id`.
    pub fn node(&self, engine_id: &str) -> &Node {
        self.nodes
            .iter()
            .find(|n| n.engine_id == engine_id)
            .unwrap_or_else(|| panic!("no node {engine_id}"))
    }

    /// Gateway `g`'s `GET /admin/nodes` list.
    pub async fn admin_nodes(&self, g: usize) -> Vec<Value> {
        let url = format!("{}/admin/nodes", self.gateways[g].admin);
        let resp = self
            .client
            .get(&url)
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {url}: {e}"));
        assert_eq!(resp.status(), 200, "GET {url}");
        let v: Value = resp.json().await.unwrap_or(Value::Null);
        v["nodes"].as_array().cloned().unwrap_or_default()
    }

    /// Waits until gateway `g` lists every id of `ids` as routable, with its role.
    pub async fn wait_listed(&self, g: usize, ids: &[&str], timeout: Duration) {
        let start = Instant::now();
        loop {
            let nodes = self.admin_nodes(g).await;
            let listed = |id: &str| {
                nodes.iter().any(|n| {
                    n["engine_id"] == id
                        && n["routable"] == true
                        && n["role"] == self.node(id).role.label()
                })
            };
            if ids.iter().all(|id| listed(id)) {
                return;
            }
            assert!(
                start.elapsed() < timeout,
                "gateway {} did not list {ids:?} within {timeout:?}; it lists {nodes:?}\n\
                 its log:\n{}",
                g + 1,
                self.gateways[g].proc.log_tail(30)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until every decode node logged a merged peer list naming every producer's KV side
    /// channel (as gateway 1 lists it).
    pub async fn wait_peers_known(&self, timeout: Duration) {
        let producers: Vec<String> = self
            .admin_nodes(0)
            .await
            .iter()
            .filter(|n| n["role"] == Role::Prefill.label() && n["routable"] == true)
            .filter_map(|n| n["kv_side_channel_addr"].as_str().map(str::to_owned))
            .collect();
        let decoders = self.nodes.iter().filter(|n| n.role == Role::Decode);
        super::wait_decoders_know(&producers, decoders, timeout).await;
    }

    /// A node's metrics.
    pub async fn node_metrics(&self, engine_id: &str) -> Metrics {
        scrape(&self.client, &self.node(engine_id).http).await
    }

    /// Gateway `g`'s scratch directory.
    pub fn gateway_dir(&self, g: usize) -> &WorkDir {
        &self.gateway_dirs[g]
    }
}

/// Where a role's flags are in `SeveralGateways::node_args`.
fn role_index(role: Role) -> usize {
    match role {
        Role::Prefill => 0,
        _ => 1,
    }
}
