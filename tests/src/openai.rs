//! OpenAI requests over plain HTTP (reqwest), and their answers — JSON or SSE, on any of the
//! three APIs — read into one [`Answer`].

use serde_json::{Value, json};

/// The served model name every test cluster uses.
pub const MODEL: &str = "tiny";

/// The three generation APIs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completions,
    /// `/v1/responses`.
    Responses,
}

impl Api {
    /// All three.
    pub const ALL: [Api; 3] = [Api::Chat, Api::Completions, Api::Responses];

    /// The request path.
    pub fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
            Api::Responses => "/v1/responses",
        }
    }

    /// The `api` label of the gateway's metrics (and the Python client's spec).
    pub fn label(self) -> &'static str {
        match self {
            Api::Chat => "chat",
            Api::Completions => "completions",
            Api::Responses => "responses",
        }
    }

    /// A greedy request for `text`, `max_tokens` long (EOS ignored where the API allows).
    pub fn body(self, text: &str, max_tokens: u32) -> Value {
        match self {
            Api::Chat => json!({"model": MODEL, "messages": [{"role": "user", "content": text}],
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true}),
            Api::Completions => json!({"model": MODEL, "prompt": text,
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true}),
            Api::Responses => json!({"model": MODEL, "input": text,
                "max_output_tokens": max_tokens, "temperature": 0}),
        }
    }

    /// `body`, streamed (with usage in the last chunk where the API has `stream_options`).
    pub fn streaming(self, body: &Value) -> Value {
        let mut b = body.clone();
        b["stream"] = json!(true);
        if self != Api::Responses {
            b["stream_options"] = json!({"include_usage": true});
        }
        b
    }
}

/// What a client saw, the same shape for every API, streamed or not.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Answer {
    /// HTTP status.
    pub status: u16,
    /// Text per choice (one for `/v1/responses`).
    pub texts: Vec<String>,
    /// Finish reason per choice (`status` of the response for `/v1/responses`).
    pub finish: Vec<Option<String>>,
    /// `usage.prompt_tokens` / `usage.input_tokens`.
    pub prompt_tokens: Option<u64>,
    /// `usage.*_tokens_details.cached_tokens`.
    pub cached_tokens: Option<u64>,
    /// `usage.*_tokens_details.kv_pulled_tokens`.
    pub pulled_tokens: Option<u64>,
    /// The answer ended properly: a JSON body, or a stream that reached `[DONE]` /
    /// `response.completed` / `response.incomplete` with no error event.
    pub complete: bool,
    /// The error object (a non-2xx body, or an error event in a stream).
    pub error: Option<Value>,
    /// The body, kept for messages when something went wrong.
    pub body: String,
    /// The `retry-after` header, if any.
    pub retry_after: Option<String>,
    /// A `/v1/responses` answer's `id` (for `previous_response_id`).
    pub response_id: Option<String>,
}

impl Answer {
    /// `error.code` of an error answer.
    pub fn error_code(&self) -> Option<&str> {
        self.error.as_ref()?.get("code")?.as_str()
    }

    /// `error.param` of an error answer.
    pub fn error_param(&self) -> Option<&str> {
        self.error.as_ref()?.get("param")?.as_str()
    }

    /// Panics unless this is a complete 200 answer; returns it.
    #[track_caller]
    pub fn ok(self) -> Self {
        assert!(
            self.status == 200 && self.complete && self.error.is_none(),
            "expected a complete 200 answer, got {}: {}",
            self.status,
            self.body
        );
        self
    }
}

fn slot<T: Default + Clone>(v: &mut Vec<T>, i: usize) -> &mut T {
    if v.len() <= i {
        v.resize(i + 1, T::default());
    }
    &mut v[i]
}

fn read_usage(a: &mut Answer, usage: &Value) {
    a.prompt_tokens = usage
        .get("prompt_tokens")
        .or_else(|| usage.get("input_tokens"))
        .and_then(Value::as_u64);
    let details = usage
        .get("prompt_tokens_details")
        .or_else(|| usage.get("input_tokens_details"));
    a.cached_tokens = details
        .and_then(|d| d.get("cached_tokens"))
        .and_then(Value::as_u64);
    a.pulled_tokens = details
        .and_then(|d| d.get("kv_pulled_tokens"))
        .and_then(Value::as_u64);
}

fn read_response_object(a: &mut Answer, r: &Value) {
    let text: String = r["output"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|item| item["content"].as_array().into_iter().flatten())
        .filter(|c| c["type"] == "output_text")
        .filter_map(|c| c["text"].as_str())
        .collect();
    a.texts = vec![text];
    a.finish = vec![r["status"].as_str().map(str::to_owned)];
    a.response_id = r["id"].as_str().map(str::to_owned);
    if let Some(u) = r.get("usage").filter(|u| !u.is_null()) {
        read_usage(a, u);
    }
}

fn read_json(api: Api, a: &mut Answer, v: &Value) {
    if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
        read_usage(a, u);
    }
    if api == Api::Responses {
        read_response_object(a, v);
        return;
    }
    for c in v["choices"].as_array().into_iter().flatten() {
        let i = c["index"].as_u64().unwrap_or(0) as usize;
        let text = c.get("text").or_else(|| c["message"].get("content"));
        *slot(&mut a.texts, i) = text.and_then(Value::as_str).unwrap_or("").to_owned();
        *slot(&mut a.finish, i) = c["finish_reason"].as_str().map(str::to_owned);
    }
}

fn read_sse(api: Api, a: &mut Answer, body: &str) {
    for line in body.lines() {
        let Some(data) = line.strip_prefix("data:").map(str::trim_start) else {
            continue;
        };
        if data == "[DONE]" {
            a.complete = a.error.is_none();
            continue;
        }
        let Ok(v) = serde_json::from_str::<Value>(data) else {
            a.error = Some(json!({"message": format!("an SSE event is not JSON: {data}")}));
            continue;
        };
        if let Some(e) = v.get("error").filter(|e| !e.is_null()) {
            a.error = Some(e.clone());
            continue;
        }
        if api == Api::Responses {
            match v["type"].as_str() {
                Some("response.completed") | Some("response.incomplete") => {
                    read_response_object(a, &v["response"]);
                    a.complete = a.error.is_none();
                }
                Some("response.failed") | Some("error") => {
                    a.error = Some(v.clone());
                }
                _ => {}
            }
            continue;
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            read_usage(a, u);
        }
        for c in v["choices"].as_array().into_iter().flatten() {
            let i = c["index"].as_u64().unwrap_or(0) as usize;
            let text = c.get("text").or_else(|| c["delta"].get("content"));
            if let Some(t) = text.and_then(Value::as_str) {
                slot(&mut a.texts, i).push_str(t);
            }
            if let Some(f) = c["finish_reason"].as_str() {
                *slot(&mut a.finish, i) = Some(f.to_owned());
            }
        }
    }
    if a.error.is_some() {
        a.complete = false;
    }
}

/// Posts `body` to `<base><api.path()>` (with `Authorization: Bearer <bearer>` when given) and
/// reads the whole answer. Transport errors panic; HTTP errors are in the [`Answer`].
pub async fn send(
    client: &reqwest::Client,
    base: &str,
    api: Api,
    body: &Value,
    bearer: Option<&str>,
) -> Answer {
    send_raw(
        client,
        base,
        api,
        serde_json::to_vec(body).expect("a Value serializes"),
        bearer,
    )
    .await
}

/// [`send`] with a raw body (for malformed JSON).
pub async fn send_raw(
    client: &reqwest::Client,
    base: &str,
    api: Api,
    body: Vec<u8>,
    bearer: Option<&str>,
) -> Answer {
    let url = format!("{base}{}", api.path());
    try_send_raw(client, &url, api, body, bearer)
        .await
        .unwrap_or_else(|e| panic!("POST {url}: {e}"))
}

/// [`send`] that returns a transport failure (refused, reset, a body cut short) instead of
/// panicking: what a client sees when a server dies under it.
pub async fn try_send(
    client: &reqwest::Client,
    base: &str,
    api: Api,
    body: &Value,
) -> Result<Answer, String> {
    let url = format!("{base}{}", api.path());
    let bytes = serde_json::to_vec(body).expect("a Value serializes");
    try_send_raw(client, &url, api, bytes, None).await
}

async fn try_send_raw(
    client: &reqwest::Client,
    url: &str,
    api: Api,
    body: Vec<u8>,
    bearer: Option<&str>,
) -> Result<Answer, String> {
    let mut req = client
        .post(url)
        .header("content-type", "application/json")
        .body(body);
    if let Some(b) = bearer {
        req = req.bearer_auth(b);
    }
    let resp = req.send().await.map_err(|e| format!("sending: {e}"))?;
    let status = resp.status().as_u16();
    let sse = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let retry_after = resp
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let text = resp
        .text()
        .await
        .map_err(|e| format!("reading the body: {e}"))?;
    let mut a = Answer {
        status,
        retry_after,
        ..Answer::default()
    };
    if !(200..300).contains(&status) {
        a.error = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v.get("error").cloned())
            .or_else(|| Some(json!({"message": text.clone()})));
    } else if sse {
        read_sse(api, &mut a, &text);
    } else {
        match serde_json::from_str::<Value>(&text) {
            Ok(v) => {
                read_json(api, &mut a, &v);
                a.complete = true;
            }
            Err(e) => a.error = Some(json!({"message": format!("the body is not JSON: {e}")})),
        }
    }
    a.body = text;
    Ok(a)
}

/// The text of a `/v1/responses` answer's message items, concatenated.
pub fn response_text(response: &Value) -> String {
    response["output"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|i| i["type"] == "message")
        .flat_map(|i| i["content"].as_array().cloned().unwrap_or_default())
        .filter_map(|c| c["text"].as_str().map(str::to_owned))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_chat_streams_with_usage() {
        let body = "data: {\"choices\":[{\"index\":1,\"delta\":{\"content\":\"b\"},\"finish_reason\":null}]}\n\n\
            data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"},\"finish_reason\":\"length\"}]}\n\n\
            data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"prompt_tokens_details\":{\"cached_tokens\":8,\"kv_pulled_tokens\":8}}}\n\n\
            data: [DONE]\n\n";
        let mut a = Answer::default();
        read_sse(Api::Chat, &mut a, body);
        assert!(a.complete);
        assert_eq!(a.texts, ["a", "b"]);
        assert_eq!(a.finish[0].as_deref(), Some("length"));
        assert_eq!(
            (a.prompt_tokens, a.cached_tokens, a.pulled_tokens),
            (Some(9), Some(8), Some(8))
        );
    }

    #[test]
    fn a_stream_without_its_end_is_incomplete() {
        let mut a = Answer::default();
        read_sse(
            Api::Completions,
            &mut a,
            "data: {\"choices\":[{\"index\":0,\"text\":\"x\"}]}\n\n",
        );
        assert!(!a.complete);
        let mut a = Answer::default();
        read_sse(
            Api::Responses,
            &mut a,
            "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"status\":\"completed\",\
             \"output\":[{\"content\":[{\"type\":\"output_text\",\"text\":\"hi\"}]}],\"usage\":{\"input_tokens\":3}}}\n\n",
        );
        assert!(a.complete);
        assert_eq!(a.texts, ["hi"]);
        assert_eq!(a.prompt_tokens, Some(3));
    }
}
