//! Traces for both binaries, exported over OTLP/gRPC, and the process's log subscriber.
//!
//! Owns: the `--otlp-*` flags ([`OtlpArgs`]); the subscriber every binary installs first
//! ([`install`]: logs to stderr under `RUST_LOG`, plus the OpenTelemetry layer when an endpoint
//! is configured); the exporter, on a runtime of its own, and its flush at exit ([`shutdown`]);
//! the W3C trace context read from and written to HTTP headers ([`set_parent`],
//! [`inject_current`]); [`server_span!`] and [`phase!`], the spans a request's path creates,
//! which exist only while traces are exported.
//!
//! Off by default: without an endpoint no OpenTelemetry layer is installed, [`enabled`] is
//! false, and a request's path creates no span of its own and adds no header (a load of one
//! flag, then a branch).
//!
//! Exported: spans that carry a `request_id` field (those [`server_span!`] and [`phase!`] make),
//! and warnings and errors of the `pd_*` crates as events of the span they happen in. Nothing
//! else, so a span some dependency opens never becomes a trace of its own.
//!
//! Must not: know requests, routes, nodes or the engine; read or write anything but the
//! headers it is handed.
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue};
use opentelemetry::KeyValue;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::Metadata;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

#[doc(hidden)]
pub mod __private {
    pub use tracing;
}

/// The field every exported span carries: the request's id (`x-request-id`).
pub const REQUEST_ID_FIELD: &str = "request_id";

/// How long one export may take before it is abandoned.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long [`shutdown`] waits for the last spans to leave.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

static ENABLED: AtomicBool = AtomicBool::new(false);
static EXPORTER: OnceLock<Exporter> = OnceLock::new();

/// Whether spans are exported: [`install`] found an endpoint, and [`shutdown`] has not run.
#[inline]
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// The flags of both binaries.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct OtlpArgs {
    /// Export traces over OTLP/gRPC to this collector (`http://HOST:4317`, plain gRPC): a span
    /// per request and per phase, each with the request id; a client's W3C `traceparent` is
    /// honoured and passed on to the nodes. Without it no span is kept or sent. The batch
    /// exporter's `OTEL_BSP_*` variables apply. Default: `$OTEL_EXPORTER_OTLP_ENDPOINT`.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT", value_name = "URL")]
    pub otlp_endpoint: Option<String>,
    /// The `service.name` spans are exported under. Default: `$OTEL_SERVICE_NAME`, else the
    /// process's own (`pd-gateway`; `pd-node-prefill`, `pd-node-decode` or `pd-node` by role).
    #[arg(long, env = "OTEL_SERVICE_NAME", value_name = "NAME")]
    pub otlp_service_name: Option<String>,
}

impl OtlpArgs {
    /// The collector to export to, if one is configured (an empty value is none).
    pub fn endpoint(&self) -> Option<&str> {
        self.otlp_endpoint
            .as_deref()
            .map(str::trim)
            .filter(|e| !e.is_empty())
    }
}

/// Who exports: the `service.name` used when `--otlp-service-name` is not given, and the
/// `service.instance.id` when the process has one (a node's engine id).
#[derive(Debug, Clone)]
pub struct Service<'a> {
    /// The default `service.name`.
    pub name: &'a str,
    /// `service.instance.id`.
    pub instance: Option<&'a str>,
}

impl<'a> Service<'a> {
    /// `name`, no instance id.
    pub fn named(name: &'a str) -> Self {
        Self {
            name,
            instance: None,
        }
    }
}

/// Why the subscriber or the exporter could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The exporter refused its configuration (an endpoint that is no URL, an `https` one).
    #[error("--otlp-endpoint {endpoint}: {source}")]
    Exporter {
        /// The endpoint configured.
        endpoint: String,
        /// What the exporter said.
        source: opentelemetry_otlp::ExporterBuildError,
    },
    /// The exporter's runtime did not start.
    #[error("starting the OTLP exporter's runtime: {0}")]
    Runtime(std::io::Error),
    /// A subscriber was installed already.
    #[error("installing the log subscriber: {0}")]
    Subscriber(String),
}

/// The exporter and the runtime its gRPC channel runs on (the batch processor's own thread
/// hands it each batch).
struct Exporter {
    provider: SdkTracerProvider,
    _runtime: tokio::runtime::Runtime,
}

impl std::fmt::Debug for Exporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exporter").finish_non_exhaustive()
    }
}

/// Installs the process's subscriber: logs to stderr under `RUST_LOG` (else `default_filter`),
/// coloured only on a terminal; with `traces` naming an endpoint, also the OpenTelemetry layer
/// exporting as `service`, and [`enabled`] from then on. Call once, first thing.
///
/// # Errors
/// [`TelemetryError`]: the exporter could not be built, or a subscriber is installed already.
pub fn install(
    default_filter: &str,
    traces: Option<(&OtlpArgs, Service<'_>)>,
) -> Result<(), TelemetryError> {
    let env = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let Some((args, service, endpoint)) =
        traces.and_then(|(args, service)| Some((args, service, args.endpoint()?)))
    else {
        // Off: the subscriber as it always was, nothing else in the process's path.
        return tracing_subscriber::fmt()
            .with_env_filter(env)
            .with_writer(std::io::stderr)
            .with_ansi(ansi)
            .try_init()
            .map_err(|e| TelemetryError::Subscriber(e.to_string()));
    };
    let name = args.otlp_service_name.as_deref().unwrap_or(service.name);
    let exporter = start(endpoint, name, service.instance)?;
    let otel = tracing_opentelemetry::layer()
        .with_tracer(exporter.provider.tracer("pd-serve"))
        .with_location(false)
        .with_threads(false)
        .with_tracked_inactivity(false)
        .with_filter(tracing_subscriber::filter::filter_fn(exported));
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .with_filter(env);
    tracing_subscriber::registry()
        .with(logs)
        .with(otel)
        .try_init()
        .map_err(|e| TelemetryError::Subscriber(e.to_string()))?;
    let _ = EXPORTER.set(exporter);
    ENABLED.store(true, Ordering::Relaxed);
    tracing::info!(endpoint, service = name, "exporting traces over OTLP/gRPC");
    Ok(())
}

/// What the OpenTelemetry layer sees: spans with a request id, and the `pd_*` crates'
/// warnings and errors.
fn exported(meta: &Metadata<'_>) -> bool {
    if meta.is_span() {
        return meta.fields().field(REQUEST_ID_FIELD).is_some();
    }
    *meta.level() <= tracing::Level::WARN && meta.target().starts_with("pd_")
}

/// The exporter to `endpoint`, its channel on a one-thread runtime of its own.
fn start(endpoint: &str, name: &str, instance: Option<&str>) -> Result<Exporter, TelemetryError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("pd-otlp")
        .enable_all()
        .build()
        .map_err(TelemetryError::Runtime)?;
    let exporter = {
        // The channel's worker is spawned on the runtime entered here.
        let _in = runtime.enter();
        opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint)
            .with_timeout(EXPORT_TIMEOUT)
            .build()
    }
    .map_err(|source| TelemetryError::Exporter {
        endpoint: endpoint.to_owned(),
        source,
    })?;
    let mut resource = Resource::builder().with_service_name(name.to_owned());
    if let Some(id) = instance {
        resource = resource.with_attribute(KeyValue::new("service.instance.id", id.to_owned()));
    }
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build();
    Ok(Exporter {
        provider,
        _runtime: runtime,
    })
}

/// Sends the spans still queued and stops exporting (waiting at most 5 s); nothing when no
/// exporter runs. Call on the way out (a `SIGTERM`'s exit), off the exporter's runtime.
pub fn shutdown() {
    let Some(exporter) = EXPORTER.get() else {
        return;
    };
    if !ENABLED.swap(false, Ordering::Relaxed) {
        return;
    }
    if let Err(e) = exporter.provider.shutdown_with_timeout(SHUTDOWN_TIMEOUT) {
        tracing::warn!(error = %e, "the last spans may not have been exported");
    }
}

/// Headers as the propagator reads them.
struct Headers<'a>(&'a HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}

/// Headers as the propagator writes them.
struct HeadersMut<'a>(&'a mut HeaderMap);

impl Injector for HeadersMut<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(key.as_bytes()),
            HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, value);
        }
    }
}

/// Makes `span` a child of the trace context `headers` carry (W3C `traceparent` and
/// `tracestate`); with none there (or a malformed one), `span` starts a trace of its own. Call
/// before the span is first entered.
pub fn set_parent(span: &tracing::Span, headers: &HeaderMap) {
    let cx = TraceContextPropagator::new().extract(&Headers(headers));
    let _ = span.set_parent(cx);
}

/// Writes the current span's trace context into `headers` (`traceparent`, and `tracestate`
/// when it has one), for a request made within that span; nothing when no span is exported.
pub fn inject_current(headers: &mut HeaderMap) {
    let cx = tracing::Span::current().context();
    TraceContextPropagator::new().inject_context(&cx, &mut HeadersMut(headers));
}

/// The span of one request a server received, `request`, with its `request_id`: a child of the
/// trace context the request's headers carry ([`set_parent`]). Only where [`enabled`].
///
/// `server_span!(id, &headers)`
#[macro_export]
macro_rules! server_span {
    ($request_id:expr, $headers:expr) => {{
        let span = $crate::__private::tracing::info_span!(
            "request",
            request_id = %$request_id,
            otel.kind = "server"
        );
        $crate::set_parent(&span, $headers);
        span
    }};
}

/// A phase of a request, a span named `$name` with the request's id, as a child of the current
/// span; further fields may follow (`phase!("prefill", id, otel.kind = "client")`). While
/// traces are off: `Span::none()`, and `$request_id` is not evaluated.
#[macro_export]
macro_rules! phase {
    ($name:literal, $request_id:expr $(, $($fields:tt)+)?) => {
        if $crate::enabled() {
            $crate::__private::tracing::info_span!(
                $name,
                request_id = %$request_id
                $(, $($fields)+)?
            )
        } else {
            $crate::__private::tracing::Span::none()
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::TraceContextExt;
    use tracing_subscriber::layer::SubscriberExt;

    const CLIENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    /// A client's `traceparent` becomes the parent of the server's span; what the server sends
    /// on carries the same trace, with a span of its own as the parent.
    #[test]
    fn the_trace_context_goes_from_the_incoming_headers_to_the_outgoing_ones() {
        let provider = SdkTracerProvider::builder().build();
        let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("test"));
        let subscriber = tracing_subscriber::registry().with(layer);
        tracing::subscriber::with_default(subscriber, || {
            let mut incoming = HeaderMap::new();
            incoming.insert("traceparent", HeaderValue::from_static(CLIENT));
            incoming.insert("tracestate", HeaderValue::from_static("vendor=1"));
            let span = server_span!("req-1", &incoming);
            let cx = span.context();
            let ours = cx.span().span_context().clone();
            assert_eq!(
                ours.trace_id().to_string(),
                "4bf92f3577b34da6a3ce929d0e0e4736"
            );
            assert_ne!(ours.span_id().to_string(), "00f067aa0ba902b7");
            let mut outgoing = HeaderMap::new();
            span.in_scope(|| inject_current(&mut outgoing));
            let sent = outgoing["traceparent"].to_str().unwrap();
            assert_eq!(
                sent,
                format!("00-4bf92f3577b34da6a3ce929d0e0e4736-{}-01", ours.span_id())
            );
            assert_eq!(outgoing["tracestate"], "vendor=1");
        });
    }

    /// Without a `traceparent` the server's span starts a trace; outside any span nothing is
    /// written.
    #[test]
    fn no_incoming_context_starts_a_trace_and_no_span_writes_nothing() {
        let provider = SdkTracerProvider::builder().build();
        let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("test"));
        let subscriber = tracing_subscriber::registry().with(layer);
        tracing::subscriber::with_default(subscriber, || {
            let span = server_span!("req-2", &HeaderMap::new());
            let mut outgoing = HeaderMap::new();
            span.in_scope(|| inject_current(&mut outgoing));
            assert!(outgoing["traceparent"].to_str().unwrap().starts_with("00-"));
            let mut none = HeaderMap::new();
            inject_current(&mut none);
            assert!(none.is_empty(), "{none:?}");
        });
    }

    /// Off (no [`install`] with an endpoint): a phase is no span, and its id is not evaluated.
    #[test]
    fn phases_are_nothing_while_off() {
        assert!(!enabled());
        let mut evaluated = false;
        let span = phase!("prefill", {
            evaluated = true;
            "id"
        });
        assert!(span.is_none());
        assert!(!evaluated);
        assert_eq!(OtlpArgs::default().endpoint(), None);
        let blank = OtlpArgs {
            otlp_endpoint: Some(" ".into()),
            otlp_service_name: None,
        };
        assert_eq!(blank.endpoint(), None);
    }

    /// What the OpenTelemetry layer is shown, read from real callsites' metadata.
    #[test]
    fn only_spans_with_a_request_id_and_our_warnings_are_exported() {
        use std::sync::{Arc, Mutex};
        /// (name, level, exported) of every callsite of this test module registered.
        #[derive(Clone, Default)]
        struct Seen(Arc<Mutex<Vec<(String, tracing::Level, bool)>>>);
        impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Seen {
            fn register_callsite(
                &self,
                meta: &'static Metadata<'static>,
            ) -> tracing::subscriber::Interest {
                if meta.target() == module_path!() {
                    let seen = (meta.name().to_owned(), *meta.level(), exported(meta));
                    self.0.lock().unwrap().push(seen);
                }
                tracing::subscriber::Interest::always()
            }
        }
        let seen = Seen::default();
        let subscriber = tracing_subscriber::registry().with(seen.clone());
        tracing::subscriber::with_default(subscriber, || {
            let _a = tracing::info_span!("with_request_id", request_id = "x");
            let _b = tracing::info_span!("with_other_id", id = "x");
            tracing::warn!("a warning");
            tracing::info!("an info");
        });
        let seen = seen.0.lock().unwrap().clone();
        let of = |name: &str| seen.iter().find(|s| s.0 == name).map(|s| s.2);
        assert_eq!(of("with_request_id"), Some(true), "{seen:?}");
        assert_eq!(of("with_other_id"), Some(false), "{seen:?}");
        let event = |level| {
            seen.iter()
                .find(|s| s.0.starts_with("event ") && s.1 == level)
                .map(|s| s.2)
        };
        // This crate's target starts with `pd_`: its warning is exported, its info is not.
        assert_eq!(event(tracing::Level::WARN), Some(true), "{seen:?}");
        assert_eq!(event(tracing::Level::INFO), Some(false), "{seen:?}");
    }
}
