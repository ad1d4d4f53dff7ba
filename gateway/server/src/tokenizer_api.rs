//! vLLM's tokenizer endpoints (`POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`)
//! answered by the gateway itself, from the tokenizer and chat template a node of the model
//! registered, through `pd_tokenize::endpoints` — the code the nodes answer them with, and the
//! code that tokenizes prompts for routing. No node is asked.
//!
//! This module does not touch the request's session (`proxy` reads the body and writes the
//! answer) and owns no state.

use pd_tokenize::endpoints::{
    self, DETOKENIZE_PATH, DetokenizeRequest, TOKENIZE_PATH, TOKENIZER_INFO_PATH, TokenizeRequest,
};
use serde::de::DeserializeOwned;

use crate::cluster::Cluster;
use crate::error::GatewayError;

/// One of the endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /tokenize`.
    Tokenize,
    /// `POST /detokenize`.
    Detokenize,
    /// `GET /tokenizer_info` (`?model=` names the model when several are served).
    Info,
}

impl Endpoint {
    /// The endpoint `method` and `path` ask for, if any.
    pub fn of(method: &str, path: &str) -> Option<Self> {
        match (method, path) {
            ("POST", TOKENIZE_PATH) => Some(Self::Tokenize),
            ("POST", DETOKENIZE_PATH) => Some(Self::Detokenize),
            ("GET", TOKENIZER_INFO_PATH) => Some(Self::Info),
            _ => None,
        }
    }
}

/// The JSON answer to `endpoint` with request `body` (`query` for [`Endpoint::Info`]).
/// Blocking work (a chat template, a long text): call it off the reactor.
///
/// # Errors
/// A 400 naming the field (bad JSON, a prompt the tokenizer refuses, several models and none
/// named), a 404 for a model no node registered, a 503 when none of it is live.
pub fn answer(
    cluster: &Cluster,
    endpoint: Endpoint,
    query: Option<&str>,
    body: &[u8],
) -> Result<Vec<u8>, GatewayError> {
    let value = match endpoint {
        Endpoint::Tokenize => {
            let req: TokenizeRequest = parse(body)?;
            let (tokenizer, max_model_len) = model(cluster, req.model.as_deref())?;
            serde_json::to_value(endpoints::tokenize(&tokenizer, &req, max_model_len)?)
        }
        Endpoint::Detokenize => {
            let req: DetokenizeRequest = parse(body)?;
            let (tokenizer, _) = model(cluster, req.model.as_deref())?;
            serde_json::to_value(endpoints::detokenize(&tokenizer, &req)?)
        }
        Endpoint::Info => {
            let named = query.and_then(|q| {
                q.split('&')
                    .find_map(|kv| kv.strip_prefix("model="))
                    .map(percent_decoded)
            });
            let (tokenizer, max_model_len) = model(cluster, named.as_deref())?;
            Ok(endpoints::tokenizer_info(&tokenizer, max_model_len))
        }
    };
    serde_json::to_vec(&value.map_err(|e| internal(&e))?).map_err(|e| internal(&e))
}

/// A query value with `+` and `%XX` decoded (a malformed escape is kept as written).
fn percent_decoded(value: &str) -> String {
    let bytes = value.as_bytes();
    let hex = |b: u8| (b as char).to_digit(16).map(|d| d as u8);
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if let (Some(hi), Some(lo)) = (
                bytes.get(i + 1).copied().and_then(hex),
                bytes.get(i + 2).copied().and_then(hex),
            ) =>
            {
                out.push(hi << 4 | lo);
                i += 2;
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn internal(e: &serde_json::Error) -> GatewayError {
    GatewayError::Internal(crate::error::InternalError::Prompt(format!(
        "encoding a tokenizer answer: {e}"
    )))
}

fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, GatewayError> {
    serde_json::from_slice(body).map_err(|e| GatewayError::InvalidRequest {
        message: format!("the body is not a valid request: {e}"),
        param: None,
    })
}

/// The tokenizer and context length of `named`, or of the only model served when none is
/// named.
fn model(
    cluster: &Cluster,
    named: Option<&str>,
) -> Result<(std::sync::Arc<pd_tokenize::Tokenizer>, usize), GatewayError> {
    let name = match named {
        Some(m) => m.to_owned(),
        None => {
            let live = cluster.live_models();
            match live.as_slice() {
                [one] => one.clone(),
                [] => {
                    return Err(GatewayError::NoCapacity {
                        model: String::new(),
                        why: "no node is live".into(),
                    });
                }
                _ => {
                    return Err(GatewayError::invalid(
                        "model",
                        format!("several models are served ({}): name one", live.join(", ")),
                    ));
                }
            }
        }
    };
    let (tokenizer, _) = cluster
        .model(&name)
        .ok_or_else(|| GatewayError::ModelNotFound(name.clone()))?;
    Ok((tokenizer, cluster.max_model_len(&name) as usize))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_values_are_percent_decoded() {
        assert_eq!(percent_decoded("org%2Fname"), "org/name");
        assert_eq!(percent_decoded("a+b%20c"), "a b c");
        assert_eq!(percent_decoded("100%"), "100%");
        assert_eq!(percent_decoded("%zz%4"), "%zz%4");
        assert_eq!(percent_decoded("%C3%A9"), "é");
    }
}
