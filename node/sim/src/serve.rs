//! A simulated node's HTTP server: the generation APIs, `/health`, `/v1/models` and
//! `/metrics`, with axum, one router per node.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use pd_wire::request::Api;
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::answer::{self, Frame, Usage};
use crate::node::{Job, SimNode, Work};
use crate::text;

/// The node's routes.
pub fn router(node: Arc<SimNode>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/responses", post(responses))
        .route("/health", get(|| async { "ok" }))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .with_state(node)
}

async fn chat(State(node): State<Arc<SimNode>>, body: Bytes) -> Response {
    generate(node, Api::ChatCompletions, &body).await
}

async fn completions(State(node): State<Arc<SimNode>>, body: Bytes) -> Response {
    generate(node, Api::Completions, &body).await
}

async fn responses(State(node): State<Arc<SimNode>>, body: Bytes) -> Response {
    generate(node, Api::Responses, &body).await
}

async fn models(State(node): State<Arc<SimNode>>) -> Response {
    axum::Json(json!({"object": "list", "data": [
        {"id": node.id.model, "object": "model", "owned_by": "pd-node-sim"}]}))
    .into_response()
}

async fn metrics(State(node): State<Arc<SimNode>>) -> Response {
    let s = &node.served;
    let text = format!(
        "pd_sim_requests_total{{work=\"handoff\"}} {}\n\
         pd_sim_requests_total{{work=\"pull\"}} {}\n\
         pd_sim_requests_total{{work=\"whole\"}} {}\n\
         pd_sim_requests_total{{work=\"refused\"}} {}\n\
         pd_sim_generated_tokens_total {}\n\
         pd_sim_leases_live {}\n\
         pd_sim_running {}\n",
        s.handoffs.load(Ordering::Relaxed),
        s.pulls.load(Ordering::Relaxed),
        s.wholes.load(Ordering::Relaxed),
        s.refused.load(Ordering::Relaxed),
        s.tokens.load(Ordering::Relaxed),
        node.load.live_leases(),
        node.load.running(),
    );
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

fn refuse(node: &SimNode, message: &str, param: Option<&str>) -> Response {
    node.served.refused.fetch_add(1, Ordering::Relaxed);
    let body = answer::error("invalid_request_error", message, param);
    (StatusCode::BAD_REQUEST, axum::Json(body)).into_response()
}

async fn generate(node: Arc<SimNode>, api: Api, body: &[u8]) -> Response {
    let map: Map<String, Value> = match serde_json::from_slice(body) {
        Ok(m) => m,
        Err(e) => return refuse(&node, &format!("the body is not a JSON object: {e}"), None),
    };
    let job = match node.job(api, &map) {
        Ok(j) => j,
        Err(r) => return refuse(&node, &r.message, r.param.as_deref()),
    };
    let running = node.load.start();
    sleep(node.before_first_token(&job)).await;
    let id = node.answer_id(api);
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    match &job.work {
        Work::Handoff { consumers } => {
            node.cache_prompt(&job.prompt);
            node.served.handoffs.fetch_add(1, Ordering::Relaxed);
            node.served.tokens.fetch_add(1, Ordering::Relaxed);
            let params = node.hand_off(&job, &id, *consumers);
            let kv = match params.as_slice() {
                [one] => one.to_value(),
                many => Value::Array(many.iter().map(|p| p.to_value()).collect()),
            };
            let frame = Frame {
                api,
                id: &id,
                model: &job.model,
                created,
            };
            let texts = vec![text::word(job.prompt.digest, 0, 0).to_owned()];
            let usage = Usage {
                prompt: job.prompt.tokens,
                completion: 1,
            };
            drop(running);
            axum::Json(frame.whole(&texts, usage, Some(kv))).into_response()
        }
        Work::Pull(params) => {
            node.release_pulled(params);
            node.served.pulls.fetch_add(1, Ordering::Relaxed);
            decode(node, job, id, created, running).await
        }
        Work::Whole => {
            node.cache_prompt(&job.prompt);
            node.served.wholes.fetch_add(1, Ordering::Relaxed);
            decode(node, job, id, created, running).await
        }
    }
}

/// Decodes `job.max_tokens` tokens per completion, streamed or answered whole.
async fn decode(
    node: Arc<SimNode>,
    job: Job,
    id: String,
    created: u64,
    running: crate::state::Running,
) -> Response {
    let generated = job.max_tokens * job.n as usize;
    node.served
        .tokens
        .fetch_add(generated as u64, Ordering::Relaxed);
    let usage = Usage {
        prompt: job.prompt.tokens,
        completion: generated,
    };
    if !job.stream {
        for k in 1..job.max_tokens {
            sleep(node.before_token(k)).await;
        }
        drop(running);
        let frame = Frame {
            api: job.api,
            id: &id,
            model: &job.model,
            created,
        };
        let texts: Vec<String> = (0..job.n)
            .map(|c| text::completion(job.prompt.digest, c, job.max_tokens))
            .collect();
        return axum::Json(frame.whole(&texts, usage, None)).into_response();
    }
    let (tx, rx) = mpsc::channel::<Result<Bytes, Infallible>>(8);
    tokio::spawn(async move {
        let _running = running;
        let frame = Frame {
            api: job.api,
            id: &id,
            model: &job.model,
            created,
        };
        for k in 0..job.max_tokens {
            sleep(node.before_token(k)).await;
            for c in 0..job.n {
                let word = text::word(job.prompt.digest, c, k);
                if tx.send(Ok(event(&frame.token(c, word)))).await.is_err() {
                    return; // the client left
                }
            }
        }
        let mut tail: Vec<Value> = (0..job.n).map(|c| frame.finish(c)).collect();
        if job.include_usage {
            tail.push(frame.usage(usage));
        }
        for v in tail {
            if tx.send(Ok(event(&v))).await.is_err() {
                return;
            }
        }
        let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(ReceiverStream::new(rx)))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

fn event(v: &Value) -> Bytes {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(b"data: ");
    // A `Value` always serializes.
    let _ = serde_json::to_writer(&mut out, v);
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

async fn sleep(d: std::time::Duration) {
    if !d.is_zero() {
        tokio::time::sleep(d).await;
    }
}
