//! A gateway and its nodes as separate processes, every port `:0`.
//!
//! [`TestCluster::start`] generates the tiny model, starts `pd-gateway serve` and reads its
//! addresses from stdout, starts the nodes with `--gateway <registry> --cluster-token <token>`
//! (prefill nodes first, then the others), reads each node's address, polls `GET /admin/nodes`
//! until every engine id is listed with its role, and waits until every decode node has the
//! gateway's peer list naming every prefill node.
//! Engine ids: `p0, p1, ...` (prefill, `kv_producer`), `d0, ...` (decode, `kv_consumer` with
//! `--kv-recompute-threshold 0`), `s0, ...` (standalone). Dropping the cluster kills everything.
//!
//! With [`ClusterSpec::hosts`] every process runs on a host of its own ([`crate::hosts`]): the
//! gateway on `gw`, each node on a host named after its engine id, each bound to its host's
//! address — or, as containers start them ([`Hosting::containers`]), as PID 1 bound to
//! `0.0.0.0` with no `--engine-id`, finding the gateway by a DNS name; the gateway names them
//! and [`Node::engine_id`] is read back from `/admin/nodes`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::bins;
use crate::hosts::{Capture, Host, Net, Place};
use crate::metrics::{Metrics, scrape};
use crate::process::{Proc, WorkDir};

mod admin;
mod restart;
mod several;
mod tls;

pub use several::{SeveralGateways, SeveralSpec};
pub use tls::Certs;

/// The admin bearer token of every test gateway.
pub const ADMIN_TOKEN: &str = "test-admin-token";
/// The cluster secret of every test gateway and its nodes.
pub const CLUSTER_TOKEN: &str = "test-cluster-token";
/// Blocks in each node's KV pool (small: many processes share two cores and little memory).
pub const NUM_BLOCKS: u32 = 512;

/// How long a process may take to print its address.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the gateway may take to list every node.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// A node's role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// `--kv-role kv_producer`.
    Prefill,
    /// `--kv-role kv_consumer`.
    Decode,
    /// No role.
    Standalone,
}

impl Role {
    /// The label `/admin/nodes` uses.
    pub fn label(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Standalone => "standalone",
        }
    }

    fn id_prefix(self) -> &'static str {
        match self {
            Role::Prefill => "p",
            Role::Decode => "d",
            Role::Standalone => "s",
        }
    }
}

/// What to start.
#[derive(Debug, Clone, Default)]
pub struct ClusterSpec {
    /// Prefill nodes.
    pub prefill: usize,
    /// Decode nodes.
    pub decode: usize,
    /// Standalone nodes (registered with the gateway, no KV role).
    pub standalone: usize,
    /// Extra `pd-gateway serve` flags (`--policy`, `--node-timeout-ms`, ...).
    pub gateway_args: Vec<String>,
    /// Extra flags for every node.
    pub node_args: Vec<String>,
    /// Extra flags for prefill nodes.
    pub prefill_args: Vec<String>,
    /// Extra flags for decode nodes.
    pub decode_args: Vec<String>,
    /// Each process on a host of its own (network namespaces on a bridge) instead of loopback.
    pub hosts: Option<Hosting>,
    /// Extra environment variables of every node it starts (`NAME`, `value`; not of one
    /// [`TestCluster::restart`] starts).
    pub node_env: Vec<(String, String)>,
    /// Mutual TLS on every cluster hop: a CA minted for the cluster, a certificate per process
    /// naming its host's address ([`TestCluster::certs`]); the gateway's OpenAI and admin
    /// ports over TLS too, and the test's client holds a certificate and trusts the CA.
    pub tls: bool,
    /// With hosts: capture the traffic between them into this file from before the first
    /// process starts ([`TestCluster::capture`]).
    pub capture: Option<PathBuf>,
}

/// How processes run across hosts.
#[derive(Debug, Clone, Copy, Default)]
pub struct Hosting {
    /// Nodes as container runtimes start them: PID 1 of their own PID namespace, bound to
    /// `0.0.0.0`, no `--engine-id`, the gateway's registry by the name [`REGISTRY_NAME`].
    pub containers: bool,
}

/// The DNS name of the gateway's registry on the hosts (as a headless Service gives it).
pub const REGISTRY_NAME: &str = "pd-gateway-registry";

/// Turns `&["a", "b"]` into owned arguments.
pub fn args(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| (*s).to_owned()).collect()
}

/// A running `pd-node`.
#[derive(Debug)]
pub struct Node {
    /// Its engine id.
    pub engine_id: String,
    /// Its role.
    pub role: Role,
    /// `http://host:port` of its OpenAI API.
    pub http: String,
    /// The process.
    pub proc: Proc,
    /// The host it runs on, if not here (after `proc`: dropped after it).
    pub host: Option<Host>,
}

/// What [`Node::spawn`] starts.
#[derive(Debug, Clone, Copy)]
struct NodeStart<'a> {
    dir: &'a Path,
    model: &'a Path,
    /// Its `--engine-id` (none: the node's default) and log name.
    engine_id: &'a str,
    named: bool,
    role: Role,
    gateway: Option<&'a str>,
    /// Extra environment variables.
    env: &'a [(String, String)],
}

impl Node {
    /// Spawns `pd-node serve` on `model` (without waiting for it to listen).
    fn spawn(start: NodeStart<'_>, place: Place<'_>, extra: &[String]) -> Proc {
        let NodeStart {
            dir,
            model,
            engine_id,
            named,
            role,
            gateway,
            env,
        } = start;
        let (mut cmd, contained) = place.command(&bins::pd_node());
        cmd.envs(env.iter().map(|(k, v)| (k, v)));
        cmd.arg("serve")
            .arg("--model")
            .arg(model)
            .args(["--served-model-name", crate::openai::MODEL, "--port", "0"])
            .args(["--num-gpu-blocks", &NUM_BLOCKS.to_string()]);
        if named {
            cmd.args(["--engine-id", engine_id]);
        }
        if let Some(host) = place
            .bind()
            .filter(|_| !extra.iter().any(|a| a == "--host"))
        {
            cmd.args(["--host", &host]);
        }
        match role {
            Role::Prefill => {
                cmd.args(["--kv-role", "kv_producer", "--kv-port", "0"]);
            }
            Role::Decode => {
                cmd.args([
                    "--kv-role",
                    "kv_consumer",
                    "--kv-port",
                    "0",
                    "--kv-recompute-threshold",
                    "0",
                ]);
            }
            Role::Standalone => {}
        }
        if let Some(g) = gateway {
            cmd.args(["--gateway", g, "--cluster-token", CLUSTER_TOKEN]);
        }
        cmd.args(extra);
        match contained {
            true => Proc::spawn_contained(engine_id, cmd, dir),
            false => Proc::spawn(engine_id, cmd, dir),
        }
    }

    fn listening(engine_id: &str, role: Role, mut proc: Proc, place: Place<'_>) -> Self {
        let http = place.url(&proc.wait_line("pd-node listening on ", START_TIMEOUT));
        Self {
            engine_id: engine_id.to_owned(),
            role,
            http,
            proc,
            host: None,
        }
    }

    /// A node on this machine, registered with `gateway` if given.
    fn local(start: NodeStart<'_>, extra: &[String]) -> Self {
        let proc = Self::spawn(start, Place::Local, extra);
        Self::listening(start.engine_id, start.role, proc, Place::Local)
    }

    /// A standalone node that knows no gateway: the reference the P/D answers are compared to.
    pub fn reference(dir: &WorkDir, model: &Path) -> Self {
        Self::reference_with(dir, model, &[])
    }

    /// [`Node::reference`] with extra flags (those a cluster's nodes get, where they change
    /// answers: `--tool-call-parser`).
    pub fn reference_with(dir: &WorkDir, model: &Path, extra: &[String]) -> Self {
        let start = NodeStart {
            dir: dir.path(),
            model,
            engine_id: "reference",
            named: true,
            role: Role::Standalone,
            gateway: None,
            env: &[],
        };
        Self::local(start, extra)
    }

    /// The TCP port of its OpenAI API.
    pub fn port(&self) -> u16 {
        port_of(&self.http)
    }

    /// Request bytes sent to its OpenAI port that it has not read (see
    /// [`crate::process::unread_tcp_bytes`]): with the node stopped, proof that a request
    /// reached it.
    pub fn unread_bytes(&self) -> u64 {
        crate::process::unread_tcp_bytes(self.port())
    }

    /// Its metrics.
    pub async fn metrics(&self, client: &reqwest::Client) -> Metrics {
        scrape(client, &self.http).await
    }
}

/// `SIGSTOP`s a node; `SIGCONT`s it when dropped, whatever happens in between.
#[derive(Debug)]
pub struct Stopped<'a>(&'a Node);

impl<'a> Stopped<'a> {
    /// Stops `node` now.
    pub fn new(node: &'a Node) -> Self {
        node.proc.signal(libc::SIGSTOP);
        Self(node)
    }
}

impl Drop for Stopped<'_> {
    fn drop(&mut self) {
        self.0.proc.signal(libc::SIGCONT);
    }
}

/// The port of `url` (`http://host:port`, or `host:port`).
pub(crate) fn port_of(url: &str) -> u16 {
    url.rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches('/').parse().ok())
        .unwrap_or_else(|| panic!("no port in {url}"))
}

/// Generates the tiny random model (`pd-node gen-tiny-model --seed 1`) into `<dir>/model`.
pub fn tiny_model(dir: &WorkDir) -> PathBuf {
    let out = dir.path().join("model");
    let status = Command::new(bins::pd_node())
        .args(["gen-tiny-model", "--seed", "1", "--out"])
        .arg(&out)
        .stdout(std::process::Stdio::null())
        .status()
        .expect("running pd-node gen-tiny-model");
    assert!(status.success(), "pd-node gen-tiny-model failed: {status}");
    out
}

/// The ports a gateway listens on (0: any free one).
#[derive(Debug, Clone, Copy, Default)]
pub struct GatewayPorts {
    /// The OpenAI API's.
    pub http: u16,
    /// The node registry's.
    pub registry: u16,
    /// The admin API's.
    pub admin: u16,
}

/// A running `pd-gateway`.
#[derive(Debug)]
pub struct Gateway {
    /// `http://host:port` of its OpenAI API.
    pub http: String,
    /// `http://host:port` of its admin API.
    pub admin: String,
    /// `host:port` of its node registry.
    pub registry: String,
    /// The process.
    pub proc: Proc,
    /// The host it runs on, if not here (after `proc`: dropped after it).
    pub host: Option<Host>,
}

impl Gateway {
    /// Starts `pd-gateway serve` on `:0` ports with the test tokens plus `extra` flags and
    /// waits for its addresses.
    pub fn start(dir: &WorkDir, extra: &[String]) -> Self {
        Self::start_on(dir, extra, None)
    }

    /// [`Gateway::start`] on `host`: every port on every interface there (the admin API too,
    /// for the test), its addresses as the test process reaches them.
    pub fn start_on(dir: &WorkDir, extra: &[String], host: Option<Host>) -> Self {
        Self::start_at(dir, extra, host, GatewayPorts::default())
    }

    /// [`Gateway::start_on`] on these ports (a restarted gateway takes its predecessor's).
    pub fn start_at(
        dir: &WorkDir,
        extra: &[String],
        host: Option<Host>,
        ports: GatewayPorts,
    ) -> Self {
        let place = host.as_ref().map_or(Place::Local, Place::On);
        let (mut cmd, _) = place.command(&bins::pd_gateway());
        let [http, registry, admin] =
            [ports.http, ports.registry, ports.admin].map(|p| p.to_string());
        cmd.args([
            "serve",
            "--port",
            &http,
            "--registry-port",
            &registry,
            "--admin-port",
            &admin,
        ])
        .args([
            "--admin-token",
            ADMIN_TOKEN,
            "--cluster-token",
            CLUSTER_TOKEN,
        ])
        .args(extra);
        if host.is_some() {
            cmd.args(["--host", "0.0.0.0", "--registry-host", "0.0.0.0"])
                .args(["--admin-host", "0.0.0.0"]);
        }
        let mut proc = Proc::spawn("gateway", cmd, dir.path());
        let registry = proc.wait_line("pd-gateway registry on ", START_TIMEOUT);
        let admin = place.url(&proc.wait_line("pd-gateway admin on ", START_TIMEOUT));
        let http = place.url(&proc.wait_line("pd-gateway listening on ", START_TIMEOUT));
        let registry = match &host {
            Some(h) => h.url(&registry).trim_start_matches("http://").to_owned(),
            None => registry,
        };
        Self {
            http,
            admin,
            registry,
            proc,
            host,
        }
    }
}

/// A gateway and its nodes.
#[derive(Debug)]
pub struct TestCluster {
    /// The gateway.
    pub gateway: Gateway,
    /// The nodes, prefill first, then decode, then standalone.
    pub nodes: Vec<Node>,
    /// The model directory.
    pub model: PathBuf,
    /// A client for tests to share (keep-alive).
    pub client: reqwest::Client,
    /// The cluster CA and its certificates, under [`ClusterSpec::tls`].
    pub certs: Option<Certs>,
    /// The capture of [`ClusterSpec::capture`], running.
    pub capture: Option<Capture>,
    /// The hosts' bridge, when the processes run on hosts (dropped after them).
    pub net: Option<Net>,
    // Last: dropped after the processes, so their logs are still there to print.
    dir: WorkDir,
}

impl TestCluster {
    /// Starts the gateway and the nodes of `spec`, and waits until the gateway lists them all.
    /// Blocks the thread while processes start (call it first in a multi-thread tokio test).
    pub async fn start(name: &str, spec: ClusterSpec) -> Self {
        let dir = WorkDir::new(name);
        let model = tiny_model(&dir);
        let net = spec.hosts.map(|_| Net::new(dir.path()));
        let capture = net.as_ref().zip(spec.capture.as_ref());
        let capture = capture.map(|(net, file)| net.capture(file));
        let gateway_host = net.as_ref().map(|n| n.host("gw"));
        if let (Some(net), Some(h)) = (&net, &gateway_host) {
            net.alias(REGISTRY_NAME, h);
        }
        let certs = spec.tls.then(|| Certs::new(&dir.path().join("certs")));
        let mut gateway_args = spec.gateway_args.clone();
        if let Some(c) = &certs {
            let at = gateway_host.as_ref().map(|h| h.addr.to_string());
            let sans = [format!("DNS:{REGISTRY_NAME}"), "DNS:gw".into()];
            c.mint("gw", &Certs::names(at.as_deref(), &sans));
            gateway_args.extend(c.flags("gw"));
            gateway_args.extend(c.client_flags("gw"));
        }
        let gateway = Gateway::start_on(&dir, &gateway_args, gateway_host);
        let containers = spec.hosts.is_some_and(|h| h.containers);
        let registry = match containers {
            true => {
                let port = gateway.registry.rsplit(':').next().unwrap_or_default();
                format!("{REGISTRY_NAME}:{port}")
            }
            false => gateway.registry.clone(),
        };
        let mut cluster = Self {
            gateway,
            nodes: Vec::new(),
            model,
            client: certs
                .as_ref()
                .map_or_else(reqwest::Client::new, Certs::client),
            certs,
            capture,
            net,
            dir,
        };
        // Producers first, listed before any decode node starts: a decode node then gets the
        // whole peer list when it registers. (A producer that joins after the decode nodes is
        // routed to at once, and a decode node that has not yet received the new peer list
        // refuses its params with a 400; see `wait_peers_known`.)
        let no_args = Vec::new();
        for stage in [
            vec![(Role::Prefill, spec.prefill, &spec.prefill_args)],
            vec![
                (Role::Decode, spec.decode, &spec.decode_args),
                (Role::Standalone, spec.standalone, &no_args),
            ],
        ] {
            let mut pending = Vec::new();
            for (role, count, extra) in stage {
                for i in 0..count {
                    let id = format!("{}{i}", role.id_prefix());
                    let mut all = spec.node_args.clone();
                    all.extend(extra.iter().cloned());
                    let host = cluster.net.as_ref().map(|n| n.host(&id));
                    if let Some(c) = &cluster.certs {
                        let at = host.as_ref().map(|h| h.addr.to_string());
                        c.mint(&id, &Certs::names(at.as_deref(), &[format!("DNS:{id}")]));
                        all.extend(c.flags(&id));
                    }
                    let place = match &host {
                        None => Place::Local,
                        Some(h) if containers => Place::Container(h),
                        Some(h) => Place::On(h),
                    };
                    let start = NodeStart {
                        dir: cluster.dir.path(),
                        model: &cluster.model,
                        engine_id: &id,
                        named: !containers,
                        role,
                        gateway: Some(&registry),
                        env: &spec.node_env,
                    };
                    let proc = Node::spawn(start, place, &all);
                    pending.push((id, role, proc, host));
                }
            }
            for (id, role, proc, host) in pending {
                let place = match &host {
                    None => Place::Local,
                    Some(h) => Place::On(h),
                };
                let mut node = Node::listening(&id, role, proc, place);
                node.host = host;
                cluster.nodes.push(node);
            }
            if containers {
                cluster.name_nodes(READY_TIMEOUT).await;
            }
            let ids: Vec<String> = cluster.nodes.iter().map(|n| n.engine_id.clone()).collect();
            let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
            cluster.wait_listed(&ids, READY_TIMEOUT).await;
        }
        cluster.wait_peers_known(READY_TIMEOUT).await;
        cluster
    }

    /// [`TestCluster::start`] with nodes that never register: each `pd-node` starts without
    /// `--gateway` (it speaks only vLLM's HTTP API and metrics, as a vLLM server does), and the
    /// gateway, started after them, is given each one with `--static-node`. Every node has the
    /// cluster token (P's side channel requires it; the gateway sends it), and the decode nodes
    /// allow exactly the producers' side channels (`--kv-allowed-peers`), since no gateway
    /// pushes them a peer list. Waits until the gateway lists them all.
    pub async fn start_static(name: &str, spec: ClusterSpec) -> Self {
        let dir = WorkDir::new(name);
        let model = tiny_model(&dir);
        let mut nodes = Vec::new();
        let mut producers = Vec::new();
        let alone = |id: &str, role: Role, extra: &[String]| {
            let mut all = args(&["--cluster-token", CLUSTER_TOKEN]);
            all.extend(spec.node_args.iter().cloned());
            all.extend(extra.iter().cloned());
            let start = NodeStart {
                dir: dir.path(),
                model: &model,
                engine_id: id,
                named: true,
                role,
                gateway: None,
                env: &spec.node_env,
            };
            Node::spawn(start, Place::Local, &all)
        };
        for i in 0..spec.prefill {
            let id = format!("{}{i}", Role::Prefill.id_prefix());
            let mut proc = alone(&id, Role::Prefill, &spec.prefill_args);
            let kv = proc.wait_line("pd-node kv side channel on ", START_TIMEOUT);
            producers.push(kv.trim_start_matches("http://").to_owned());
            nodes.push(Node::listening(&id, Role::Prefill, proc, Place::Local));
        }
        let mut decode_args = args(&["--kv-allowed-peers", &producers.join(",")]);
        decode_args.extend(spec.decode_args.iter().cloned());
        for (role, count, extra) in [
            (Role::Decode, spec.decode, &decode_args),
            (Role::Standalone, spec.standalone, &Vec::new()),
        ] {
            for i in 0..count {
                let id = format!("{}{i}", role.id_prefix());
                let proc = alone(&id, role, extra);
                nodes.push(Node::listening(&id, role, proc, Place::Local));
            }
        }
        let mut gateway_args = spec.gateway_args.clone();
        for n in &nodes {
            gateway_args.push("--static-node".into());
            gateway_args.push(format!(
                "role={},url={},tokenizer={},engine-id={}",
                n.role.label(),
                n.http,
                model.display(),
                n.engine_id
            ));
        }
        let gateway = Gateway::start(&dir, &gateway_args);
        let cluster = Self {
            gateway,
            nodes,
            model,
            client: reqwest::Client::new(),
            certs: None,
            capture: None,
            net: None,
            dir,
        };
        let ids: Vec<String> = cluster.nodes.iter().map(|n| n.engine_id.clone()).collect();
        let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
        cluster.wait_listed(&ids, READY_TIMEOUT).await;
        cluster
    }

    /// Waits until every decode node has logged a peer list from the gateway that names every
    /// prefill node's KV side channel (as `/admin/nodes` gives it): until then a decode node
    /// refuses params naming that producer.
    pub async fn wait_peers_known(&self, timeout: Duration) {
        let producers: Vec<String> = self
            .admin_nodes()
            .await
            .iter()
            .filter(|n| n["role"] == Role::Prefill.label())
            .filter_map(|n| n["kv_side_channel_addr"].as_str().map(str::to_owned))
            .collect();
        wait_decoders_know(&producers, self.role(Role::Decode), timeout).await;
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

    /// The node `engine_id`, mutably (to signal or kill it).
    pub fn node_mut(&mut self, engine_id: &str) -> &mut Node {
        self.nodes
            .iter_mut()
            .find(|n| n.engine_id == engine_id)
            .unwrap_or_else(|| panic!("no node {engine_id}"))
    }

    /// The nodes of `role`.
    pub fn role(&self, role: Role) -> impl Iterator<Item = &Node> {
        self.nodes.iter().filter(move |n| n.role == role)
    }

    /// `GET` an admin path with the admin token; returns the status and the JSON body.
    pub async fn admin_get(&self, path: &str) -> (u16, Value) {
        let url = format!("{}{path}", self.gateway.admin);
        let resp = self
            .client
            .get(&url)
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {url}: {e}"));
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    /// Kills node `engine_id` and starts it again under the same id (a new process: a new epoch,
    /// an empty pool) with `extra` flags; waits until the gateway lists the new process.
    pub async fn restart(&mut self, engine_id: &str, extra: &[String]) {
        assert!(
            self.net.is_none(),
            "restart runs nodes on this machine only"
        );
        let role = self.node(engine_id).role;
        let model = self.model.clone();
        let registry = self.gateway.registry.clone();
        let _ = self.node_mut(engine_id).proc.kill_and_wait();
        self.wait_unlisted(engine_id, READY_TIMEOUT).await;
        let start = NodeStart {
            dir: self.dir.path(),
            model: &model,
            engine_id,
            named: true,
            role,
            gateway: Some(&registry),
            env: &[],
        };
        let fresh = Node::local(start, extra);
        *self.node_mut(engine_id) = fresh;
        self.wait_listed(&[engine_id], READY_TIMEOUT).await;
        self.wait_peers_known(READY_TIMEOUT).await;
    }

    /// Starts one more `pd-node` of `role` on a new host named `name`, registered with this
    /// cluster's gateway, with `extra` flags (its `--engine-id` among them, or none), bound to
    /// its host's address (or to `0.0.0.0` as PID 1, `container`); does not wait for it. Its
    /// host is the node's. Needs a cluster on hosts.
    pub fn spawn_on_new_host(
        &self,
        name: &str,
        role: Role,
        container: bool,
        extra: &[String],
    ) -> Node {
        let net = self.net.as_ref().expect("a cluster on hosts");
        let host = net.host(name);
        let place = match container {
            true => Place::Container(&host),
            false => Place::On(&host),
        };
        let start = NodeStart {
            dir: self.dir.path(),
            model: &self.model,
            engine_id: name,
            named: false,
            role,
            gateway: Some(&self.gateway.registry),
            env: &[],
        };
        let proc = Node::spawn(start, place, extra);
        Node {
            engine_id: name.to_owned(),
            role,
            http: String::new(),
            proc,
            host: Some(host),
        }
    }

    /// Reads back the engine ids the gateway lists for nodes started without one: waits until
    /// a routable node is listed at each node's HTTP address, then names the node after it.
    async fn name_nodes(&mut self, timeout: Duration) {
        let start = Instant::now();
        loop {
            let listed = self.admin_nodes().await;
            let id_at = |http: &str| {
                listed
                    .iter()
                    .find(|n| {
                        n["routable"] == true
                            && n["http_addr"].as_str().is_some_and(|a| {
                                http.trim_start_matches("http://").trim_end_matches('/') == a
                            })
                    })
                    .and_then(|n| n["engine_id"].as_str().map(str::to_owned))
            };
            let ids: Vec<Option<String>> = self.nodes.iter().map(|n| id_at(&n.http)).collect();
            if ids.iter().all(Option::is_some) {
                for (n, id) in self.nodes.iter_mut().zip(ids) {
                    n.engine_id = id.unwrap_or_default();
                }
                return;
            }
            assert!(
                start.elapsed() < timeout,
                "the gateway did not list a node at every address within {timeout:?}: {listed:?}\n\
                 gateway log:\n{}",
                self.gateway.proc.log_tail(30)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Waits until every decode node of `decoders` has logged a peer list (from its gateway, or
/// the union of its gateways') naming every one of `producers`.
pub(crate) async fn wait_decoders_know<'a>(
    producers: &[String],
    decoders: impl Iterator<Item = &'a Node>,
    timeout: Duration,
) {
    for d in decoders {
        let known = || {
            d.proc
                .log()
                .lines()
                .rev()
                .find(|l| l.contains("KV peers registered with the gateway"))
                .is_some_and(|l| producers.iter().all(|p| l.contains(p.as_str())))
        };
        let start = Instant::now();
        while !known() {
            assert!(
                start.elapsed() < timeout,
                "{} logged no peer list naming every producer {producers:?} within {timeout:?}; its log:\n{}",
                d.engine_id,
                d.proc.log_tail(30)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
