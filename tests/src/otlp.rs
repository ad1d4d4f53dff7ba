//! A real OTLP/gRPC trace receiver, as a collector is one: opentelemetry-proto's `TraceService`
//! served by tonic on a free loopback port, in the test process. It keeps every span it is sent,
//! each with its resource's `service.name`, for a test to read back ([`Receiver::spans`]).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};

/// OTLP's `SPAN_KIND_SERVER`.
pub const KIND_SERVER: i32 = 2;
/// OTLP's `SPAN_KIND_CLIENT`.
pub const KIND_CLIENT: i32 = 3;

/// One span as received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Span {
    /// Its resource's `service.name`.
    pub service: String,
    /// The span's name.
    pub name: String,
    /// Hex, 32 digits.
    pub trace_id: String,
    /// Hex, 16 digits.
    pub span_id: String,
    /// Hex, 16 digits; empty for a root.
    pub parent_span_id: String,
    /// OTLP's span kind (1 internal, 2 server, 3 client).
    pub kind: i32,
    /// Its attributes, each value as text.
    pub attributes: BTreeMap<String, String>,
}

impl Span {
    /// The attribute `key`, if the span has it.
    pub fn attribute(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }
}

#[derive(Debug, Clone, Default)]
struct Store(Arc<Mutex<Vec<Span>>>);

#[tonic::async_trait]
impl TraceService for Store {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut kept = self.0.lock().expect("the span store");
        for rs in request.into_inner().resource_spans {
            let resource = rs.resource.map(|r| attributes(&r.attributes));
            let service = resource
                .and_then(|mut r| r.remove("service.name"))
                .unwrap_or_default();
            for span in rs.scope_spans.into_iter().flat_map(|s| s.spans) {
                kept.push(Span {
                    service: service.clone(),
                    name: span.name,
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent_span_id: hex(&span.parent_span_id),
                    kind: span.kind,
                    attributes: attributes(&span.attributes),
                });
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn attributes(kvs: &[KeyValue]) -> BTreeMap<String, String> {
    kvs.iter()
        .map(|kv| {
            (
                kv.key.clone(),
                kv.value.as_ref().map(text).unwrap_or_default(),
            )
        })
        .collect()
}

fn text(v: &AnyValue) -> String {
    match &v.value {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        Some(any_value::Value::IntValue(i)) => i.to_string(),
        Some(any_value::Value::DoubleValue(d)) => d.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

/// The receiver, serving until dropped.
#[derive(Debug)]
pub struct Receiver {
    /// `http://127.0.0.1:PORT`: what `--otlp-endpoint` takes.
    pub endpoint: String,
    store: Store,
    server: tokio::task::JoinHandle<()>,
}

impl Receiver {
    /// Serves on a free loopback port, on the current tokio runtime.
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binding the OTLP receiver");
        let endpoint = format!("http://{}", listener.local_addr().expect("its address"));
        let store = Store::default();
        let service = TraceServiceServer::new(store.clone());
        let server = tokio::spawn(async move {
            let incoming = tonic::transport::server::TcpIncoming::from(listener);
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(incoming)
                .await
                .expect("the OTLP receiver");
        });
        Self {
            endpoint,
            store,
            server,
        }
    }

    /// Every span received so far, in the order they came.
    pub fn spans(&self) -> Vec<Span> {
        self.store.0.lock().expect("the span store").clone()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.server.abort();
    }
}
