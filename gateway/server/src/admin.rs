//! The operator's API (its own port, bearer token on every call):
//!
//! - `GET /admin/policy`: the policy serving now and the one a rollback would restore.
//! - `PUT /admin/policy?name=N&deadline_ms=D&memory_mib=M&fuel=F&spares=S&config.KEY=VALUE`:
//!   body = a policy component. Compiled and smoke-tested off the request path; swapped in only
//!   if it passes.
//!   `?native=least-loaded|round-robin|prefix-aware` installs a built-in policy instead.
//! - `POST /admin/policy/rollback`: back to the previous policy.
//! - `POST /admin/policy/dry-run?model=M&prompt_tokens=N&n=K`: body = a component; runs it on the
//!   live view with a sample request and answers its decision and latency, installing nothing.
//! - `GET /admin/nodes`: the view as policies see it, with ids and addresses.
//! - `POST /admin/nodes/{engine_id}/drain?on=true|false`.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router as Axum;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use pd_policy::{Api, Decision, Installed, PolicyEngine, PolicySpec, Request, Route};
use serde_json::{Value, json};
use tracing::{info, warn};

use crate::cluster::{Cluster, role_label};
use crate::route::Router;

/// What the admin handlers share.
#[derive(Debug, Clone)]
pub struct Admin {
    /// The bearer token every call must carry.
    pub token: Arc<str>,
    /// Compiles policies.
    pub engine: Arc<PolicyEngine>,
    /// The policy slot.
    pub router: Arc<Router>,
    /// The cluster.
    pub cluster: Arc<Cluster>,
    /// Defaults for pushed policies.
    pub defaults: PolicySpec,
    /// Saves the policy slot at every change (`--state-dir`); none: memory only.
    pub keeper: Option<crate::state::policy::PolicyKeeper>,
    /// Records drains (`--state-dir`); none: memory only.
    pub state: Option<crate::state::State>,
}

impl Admin {
    /// Installs `p`, saved first when there is a state store (`component`: its bytes).
    ///
    /// # Errors
    /// The store's error: nothing was installed.
    async fn install(
        &self,
        p: Installed,
        component: Option<Vec<u8>>,
    ) -> Result<(), crate::state::StateError> {
        let slot = self.router.slot();
        let _held = match &self.keeper {
            Some(k) => {
                let held = k.lock().await;
                k.save(&p, Some(&slot.current_arc()), component).await?;
                Some(held)
            }
            None => None,
        };
        slot.install(p);
        self.router.publish_info();
        Ok(())
    }
}

fn error(status: StatusCode, message: impl std::fmt::Display) -> Response {
    let body = pd_wire::ErrorBody::new("admin_error", message.to_string());
    (status, axum::Json(body)).into_response()
}

fn unix(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// A policy's description in the admin API.
pub fn describe(p: &Installed) -> Value {
    let mut v = json!({
        "name": p.name(),
        "version": p.version(),
        "sha256": p.sha256(),
        "loaded_at": unix(p.loaded_at()),
        "kind": match p { Installed::Wasm(_) => "wasm", Installed::Native { .. } => "native" },
    });
    if let Installed::Wasm(w) = p {
        v["contract"] = json!(format!("pd:policy@{}", w.contract()));
        v["deadline_ms"] = json!(w.spec().deadline.as_secs_f64() * 1000.0);
        v["memory_limit"] = json!(w.spec().memory_limit);
        v["fuel"] = json!(w.spec().fuel);
        v["spares"] = json!(w.spec().spares);
        v["spares_ready"] = json!(w.spares_ready());
        v["reuses_instances"] = json!(w.reuses_instances());
        v["config"] = json!(w.spec().config);
        let (from, took) = w.compiled();
        v["compiled"] = json!({
            "from": match from {
                pd_policy::CompiledFrom::Compiled => "compiled",
                pd_policy::CompiledFrom::Memory => "memory",
                pd_policy::CompiledFrom::Disk => "disk",
            },
            "ms": took.as_secs_f64() * 1000.0,
        });
    }
    v
}

/// A decision in JSON, node indices resolved to engine ids.
pub fn decision_json(d: &Decision, names: &[Arc<str>]) -> Value {
    let name = |i: u32| names.get(i as usize).map_or("?", |n| &**n).to_owned();
    let route = match &d.route {
        Route::Split(s) => json!({"split": {
            "prefill": s.prefill.iter().map(|&i| name(i)).collect::<Vec<_>>(),
            "decode": s.decode.iter().map(|t| json!({"node": name(t.node), "children": t.children})).collect::<Vec<_>>(),
        }}),
        Route::Whole(c) => json!({"whole": c.iter().map(|&i| name(i)).collect::<Vec<_>>()}),
        Route::Reject(r) => json!({"reject": {"status": r.status, "message": r.message}}),
    };
    json!({"route": route, "reverse_pull": d.reverse_pull.as_ref().map(|r| json!({"from": name(r.from), "min_tokens": r.min_tokens}))})
}

impl Admin {
    fn authorized(&self, headers: &HeaderMap) -> bool {
        let header = headers.get("authorization").and_then(|v| v.to_str().ok());
        crate::secret::bearer(header).is_some_and(|t| crate::secret::same_secret(t, &self.token))
    }

    fn spec(&self, q: &HashMap<String, String>) -> Result<PolicySpec, BadSpec> {
        let mut spec = self.defaults.clone();
        if let Some(name) = q.get("name") {
            spec.name = name.clone();
        }
        if let Some(ms) = q.get("deadline_ms") {
            let ms: f64 = ms.parse().map_err(|_| BadSpec::NotANumber {
                field: "deadline_ms",
                value: ms.clone(),
            })?;
            if !(ms > 0.0 && ms <= MAX_DEADLINE_MS) {
                return Err(BadSpec::Deadline);
            }
            spec.deadline = Duration::from_secs_f64(ms / 1000.0);
        }
        if let Some(mib) = q.get("memory_mib") {
            let mib: usize = mib
                .parse()
                .ok()
                .filter(|m| (1..=pd_policy::MAX_MEMORY_LIMIT >> 20).contains(m))
                .ok_or_else(|| BadSpec::Memory(mib.clone()))?;
            spec.memory_limit = mib << 20;
        }
        if let Some(fuel) = q.get("fuel") {
            spec.fuel = fuel
                .parse()
                .ok()
                .filter(|f| (1..=MAX_FUEL).contains(f))
                .ok_or_else(|| BadSpec::Fuel(fuel.clone()))?;
        }
        if let Some(n) = q.get("spares") {
            spec.spares = n
                .parse()
                .ok()
                .filter(|&n: &usize| n <= pd_policy::MAX_SPARES)
                .ok_or_else(|| BadSpec::Spares(n.clone()))?;
        }
        spec.config = q
            .iter()
            .filter_map(|(k, v)| k.strip_prefix("config.").map(|k| (k.to_owned(), v.clone())))
            .collect::<BTreeMap<_, _>>();
        Ok(spec)
    }

    async fn compile(&self, wasm: Bytes, spec: PolicySpec) -> Result<Installed, Refused> {
        let engine = self.engine.clone();
        let loaded = tokio::task::spawn_blocking(move || engine.load(&wasm, spec)).await?;
        Ok(Installed::Wasm(loaded?))
    }
}

/// A push's or dry run's query that does not make a policy's settings.
#[derive(Debug, thiserror::Error)]
enum BadSpec {
    #[error("{field}: not a number: {value}")]
    NotANumber { field: &'static str, value: String },
    #[error("deadline_ms must be in (0, {MAX_DEADLINE_MS}]")]
    Deadline,
    #[error("fuel: not an integer in 1..={MAX_FUEL}: {0}")]
    Fuel(String),
    #[error("memory_mib: not an integer in 1..={max}: {0}", max = pd_policy::MAX_MEMORY_LIMIT >> 20)]
    Memory(String),
    #[error("spares: not an integer in 0..={max}: {0}", max = pd_policy::MAX_SPARES)]
    Spares(String),
}

/// Why a pushed component was not installed.
#[derive(Debug, thiserror::Error)]
enum Refused {
    /// It failed to compile, instantiate or pass its smoke test.
    #[error("{}", crate::error::chain(.0))]
    Policy(#[from] pd_policy::PolicyError),
    /// The compiling task panicked.
    #[error("compiling: {0}")]
    Task(#[from] tokio::task::JoinError),
}

/// The longest deadline a push may give a policy's call, in milliseconds: a decision sits on
/// every request's path (interpreted guests need tens of milliseconds, not seconds).
pub const MAX_DEADLINE_MS: f64 = 1000.0;

/// The most fuel a push may give a policy's call (about one unit per wasm instruction: seconds
/// of computing, past any deadline a push may ask for).
pub const MAX_FUEL: u64 = 10_000_000_000;

/// Largest policy component a push or dry-run accepts.
pub const MAX_POLICY_BYTES: usize = 64 << 20;

/// The admin routes.
pub fn routes(admin: Admin) -> Axum {
    Axum::new()
        .route("/admin/policy", get(show).put(push))
        .route("/admin/policy/rollback", post(rollback))
        .route("/admin/policy/dry-run", post(dry_run))
        .route("/admin/decisions", get(decisions))
        .route("/admin/nodes", get(nodes))
        .route("/admin/nodes/{engine_id}/drain", post(drain))
        // A Python or JavaScript policy carries its interpreter: ~12–18 MB.
        // Every route asks for the token before its handler runs, so a caller without it is
        // refused before a byte of its body is read.
        .route_layer(axum::middleware::from_fn_with_state(
            admin.clone(),
            require_token,
        ))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_POLICY_BYTES))
        .with_state(admin)
}

/// Refuses a call without the admin token, its body unread.
async fn require_token(
    State(a): State<Admin>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if !a.authorized(request.headers()) {
        return error(StatusCode::UNAUTHORIZED, "missing or wrong admin token");
    }
    next.run(request).await
}

/// The decision log's last records (`?limit=N`, default 1000), as JSONL.
async fn decisions(State(a): State<Admin>, Query(q): Query<HashMap<String, String>>) -> Response {
    let limit = match q.get("limit").map(|l| l.parse::<usize>()) {
        None => 1000,
        Some(Ok(l)) => l,
        Some(Err(_)) => return error(StatusCode::BAD_REQUEST, "limit: not a number"),
    };
    (
        [(axum::http::header::CONTENT_TYPE, "application/x-ndjson")],
        a.router.log().recent(limit),
    )
        .into_response()
}

async fn show(State(a): State<Admin>) -> Response {
    let slot = a.router.slot();
    let previous = slot.previous().map(|p| describe(&p));
    axum::Json(json!({"current": describe(&slot.current()), "previous": previous})).into_response()
}

async fn push(
    State(a): State<Admin>,
    Query(q): Query<HashMap<String, String>>,
    body: Bytes,
) -> Response {
    let installed = if let Some(native) = q.get("native") {
        if !["least-loaded", "round-robin", "prefix-aware"].contains(&native.as_str()) {
            return error(
                StatusCode::BAD_REQUEST,
                format!("no native policy `{native}`"),
            );
        }
        Installed::Native {
            name: native.clone(),
        }
    } else {
        let spec = match a.spec(&q) {
            Ok(s) => s,
            Err(e) => return error(StatusCode::BAD_REQUEST, e),
        };
        match a.compile(body.clone(), spec).await {
            Ok(p) => p,
            Err(e) => {
                warn!("policy push refused: {e}");
                return error(StatusCode::BAD_REQUEST, format!("policy refused: {e}"));
            }
        }
    };
    let described = describe(&installed);
    let component = installed.sha256().map(|_| body.to_vec());
    if let Err(e) = a.install(installed, component).await {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("policy not installed: the state store did not save it: {e}"),
        );
    }
    info!(policy = %described, "policy installed");
    axum::Json(json!({"current": described})).into_response()
}

async fn rollback(State(a): State<Admin>) -> Response {
    let slot = a.router.slot();
    let _held = match &a.keeper {
        Some(k) => {
            let held = k.lock().await;
            if let Some(previous) = slot.previous()
                && let Err(e) = k.save(&previous, Some(&slot.current_arc()), None).await
            {
                return error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("policy not rolled back: the state store did not save it: {e}"),
                );
            }
            Some(held)
        }
        None => None,
    };
    match slot.rollback() {
        Ok(()) => {
            a.router.publish_info();
            let current = describe(&a.router.slot().current());
            info!(policy = %current, "policy rolled back");
            axum::Json(json!({"current": current})).into_response()
        }
        Err(e) => error(StatusCode::CONFLICT, e),
    }
}

async fn dry_run(
    State(a): State<Admin>,
    Query(q): Query<HashMap<String, String>>,
    body: Bytes,
) -> Response {
    let spec = match a.spec(&q) {
        Ok(s) => s,
        Err(e) => return error(StatusCode::BAD_REQUEST, e),
    };
    let policy = match a.compile(body, spec).await {
        Ok(p) => p,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("policy refused: {e}")),
    };
    let model = q
        .get("model")
        .cloned()
        .or_else(|| a.cluster.live_models().into_iter().next());
    let Some(model) = model else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "no live node: nothing to decide over",
        );
    };
    let num = |k: &str, d: u32| q.get(k).and_then(|v| v.parse().ok()).unwrap_or(d);
    let prompt_tokens = num("prompt_tokens", 64);
    let snapshot = a.cluster.snapshot(&model, &[]);
    let block_size = a.cluster.model(&model).map_or(16, |(_, b)| b);
    let request = Request {
        seq: 0,
        api: Api::ChatCompletions,
        prompt_tokens,
        block_size,
        block_hashes: Vec::new(),
        prefix_blocks: snapshot.prefix_blocks.clone(),
        n: num("n", 1),
        max_tokens: Some(num("max_tokens", 16)),
        stream: false,
        conversation_key: None,
    };
    let names = snapshot.names.clone();
    let result = tokio::task::spawn_blocking(move || {
        let mut took = Vec::with_capacity(101);
        let mut last = None;
        for _ in 0..101 {
            let t = Instant::now();
            last = Some(policy.decide(&request, &snapshot.view, &snapshot.measured, &names));
            took.push(t.elapsed());
        }
        took.sort();
        (last, took[took.len() / 2], names)
    })
    .await;
    match result {
        Ok((Some(Ok(d)), p50, names)) => axum::Json(json!({
            "model": model,
            "decision": decision_json(&d, &names),
            "latency_us_p50": p50.as_secs_f64() * 1e6,
        }))
        .into_response(),
        Ok((Some(Err(e)), _, _)) => error(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("the policy failed: {e}"),
        ),
        Ok((None, _, _)) | Err(_) => error(StatusCode::INTERNAL_SERVER_ERROR, "dry run failed"),
    }
}

async fn nodes(State(a): State<Admin>) -> Response {
    let state = a.cluster.read();
    let nodes: Vec<Value> = state
        .nodes
        .values()
        .map(|n| {
            let s = &n.state;
            json!({
                "engine_id": &*n.engine_id,
                "source": n.source,
                "epoch": n.epoch,
                "model": &*n.model,
                "role": role_label(n.role),
                "http_addr": &*n.http_addr,
                "kv_side_channel_addr": &*n.kv_addr,
                "block_size": n.block_size,
                "max_model_len": n.max_model_len,
                "kv_bytes_per_token": n.kv_bytes_per_token,
                "free_blocks": s.free_blocks,
                "total_blocks": s.total_blocks,
                "leased_blocks": s.leased_blocks,
                "waiting": s.waiting,
                "running": s.running,
                "gateway_open_requests": n.open.now(),
                "gateway_reserved_requests": n.open.reserved(),
                "waiting_remote_kv": s.waiting_remote_kv,
                "prefill_tokens_per_s": s.prefill_tokens_per_s,
                "pull_mb_per_s": s.pull_mb_per_s,
                "draining": n.is_draining(),
                "shutting_down": n.state.draining,
                "routable": n.visible_from <= Instant::now(),
                "cached_block_hashes": n.hashes.len(),
                "registered_at": unix(n.registered_at),
                "last_seen_ms_ago": n.last_seen.elapsed().as_millis() as u64,
            })
        })
        .collect();
    let models: Vec<Value> = state
        .models
        .iter()
        .map(|(m, e)| json!({"model": &**m, "tokenizer_fingerprint": format!("{:016x}", e.fingerprint), "block_size": e.block_size}))
        .collect();
    axum::Json(json!({"nodes": nodes, "models": models})).into_response()
}

async fn drain(
    State(a): State<Admin>,
    Path(engine_id): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let on = q.get("on").is_none_or(|v| v != "false");
    if a.cluster.set_draining(&engine_id, on) {
        if let Some(state) = &a.state
            && let Err(e) = state.set_drain(&engine_id, on).await
        {
            // Applied here, but a restart would not remember it: say so.
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("drain applied but not saved: the state store did not answer: {e}"),
            );
        }
        axum::Json(json!({"engine_id": engine_id, "draining": on})).into_response()
    } else {
        error(StatusCode::NOT_FOUND, format!("no live node `{engine_id}`"))
    }
}

/// Reloads the policy file whenever it changes (polled every second). A file that does not
/// compile or fails the smoke test is refused and the current policy stays.
pub async fn watch_policy_file(admin: Admin, path: PathBuf, spec: PolicySpec) {
    let modified = |p: &PathBuf| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let mut seen = modified(&path);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let now = modified(&path);
        if now == seen {
            continue;
        }
        seen = now;
        let Ok(bytes) = std::fs::read(&path) else {
            warn!(path = %path.display(), "policy file unreadable; keeping the current policy");
            continue;
        };
        match admin.compile(bytes.clone().into(), spec.clone()).await {
            Ok(p) => {
                let d = describe(&p);
                if let Err(e) = admin.install(p, Some(bytes)).await {
                    warn!(path = %path.display(), "policy file changed but was not installed: {e}");
                    continue;
                }
                info!(path = %path.display(), policy = %d, "policy file changed: installed");
            }
            Err(e) => {
                warn!(path = %path.display(), "policy file changed but was refused: {e}");
            }
        }
    }
}
