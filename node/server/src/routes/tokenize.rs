//! vLLM's `POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info`, from this node's
//! tokenizer through `pd_tokenize::endpoints` (the gateway answers them through the same code).

use axum::Json;
use axum::extract::State;
use pd_tokenize::endpoints::{
    DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse,
};

use super::{AppState, JsonBody};
use crate::error::ApiError;

pub(super) async fn tokenize(
    State(state): State<AppState>,
    JsonBody(req): JsonBody<TokenizeRequest>,
) -> Result<Json<TokenizeResponse>, ApiError> {
    state.model_name(req.model.as_deref())?;
    let tokenizer = state.engine.tokenizer().clone();
    let max_model_len = state.engine.info().max_model_len;
    // A chat template and a long text are blocking work.
    let out = tokio::task::spawn_blocking(move || {
        pd_tokenize::endpoints::tokenize(&tokenizer, &req, max_model_len)
    })
    .await??;
    Ok(Json(out))
}

pub(super) async fn detokenize(
    State(state): State<AppState>,
    JsonBody(req): JsonBody<DetokenizeRequest>,
) -> Result<Json<DetokenizeResponse>, ApiError> {
    state.model_name(req.model.as_deref())?;
    let tokenizer = state.engine.tokenizer().clone();
    // A body may list millions of ids: blocking work.
    let out =
        tokio::task::spawn_blocking(move || pd_tokenize::endpoints::detokenize(&tokenizer, &req))
            .await??;
    Ok(Json(out))
}

pub(super) async fn tokenizer_info(State(state): State<AppState>) -> Json<serde_json::Value> {
    Json(pd_tokenize::endpoints::tokenizer_info(
        state.engine.tokenizer(),
        state.engine.info().max_model_len,
    ))
}
