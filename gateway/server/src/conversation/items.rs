//! Responses API items as the gateway stores and lists them: a turn's input and output items,
//! `input_items` pages, the response object as retrieved.

use serde_json::{Value, json};

/// The response object as `GET /v1/responses/{id}` returns it: a node's retained-turn
/// `kv_transfer_params` removed (a lease is nobody's business later), and the two fields the
/// gateway answered for the node: `previous_response_id` (the nodes never see it) and `store`.
pub fn as_retrieved(response: &Value, parent: Option<&str>) -> Value {
    let mut kept = response.clone();
    if let Some(o) = kept.as_object_mut() {
        o.remove("kv_transfer_params");
        o.insert("previous_response_id".into(), json!(parent));
        o.insert("store".into(), Value::Bool(true));
    }
    kept
}

/// A bad query parameter of `GET /v1/responses/{id}/input_items`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueryError {
    /// The parameter.
    pub param: &'static str,
    /// What is wrong with it.
    pub message: String,
}

/// `GET /v1/responses/{id}/input_items`' query: `limit` (1–100, default 20), `order` (`asc` or
/// `desc`, the default, as OpenAI's), `after` (an item id: the page after it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ItemsQuery {
    /// Items per page.
    pub limit: usize,
    /// Newest first.
    pub desc: bool,
    /// The page starts after this item.
    pub after: Option<String>,
}

impl ItemsQuery {
    /// Reads `limit`, `order` and `after` from a query string; other parameters are ignored.
    ///
    /// # Errors
    /// A limit out of 1–100 or not a number, an order other than `asc` / `desc`.
    pub fn parse(query: &str) -> Result<Self, QueryError> {
        let mut q = Self {
            limit: 20,
            desc: true,
            after: None,
        };
        for (key, value) in query
            .split('&')
            .filter(|kv| !kv.is_empty())
            .map(|kv| kv.split_once('=').unwrap_or((kv, "")))
        {
            match key {
                "limit" => {
                    q.limit = value
                        .parse()
                        .ok()
                        .filter(|n| (1..=100).contains(n))
                        .ok_or_else(|| QueryError {
                            param: "limit",
                            message: format!("limit must be a number from 1 to 100, got `{value}`"),
                        })?;
                }
                "order" => {
                    q.desc = match value {
                        "asc" => false,
                        "desc" => true,
                        _ => {
                            return Err(QueryError {
                                param: "order",
                                message: format!("order must be `asc` or `desc`, got `{value}`"),
                            });
                        }
                    };
                }
                "after" => q.after = Some(value.to_owned()),
                _ => {}
            }
        }
        Ok(q)
    }
}

/// The `list` object of `GET /v1/responses/{id}/input_items`: response `id`'s input items as
/// OpenAI items (each with an `id` and a `type`; a `{role, content}` message becomes a
/// `message` item whose text is an `input_text` part, `output_text` for an assistant's), one
/// page of them.
pub fn item_list(id: &str, items: Vec<Value>, q: &ItemsQuery) -> Value {
    let mut items: Vec<Value> = items
        .into_iter()
        .enumerate()
        .map(|(i, item)| as_item(id, i, item))
        .collect();
    if q.desc {
        items.reverse();
    }
    let start = q
        .after
        .as_deref()
        .and_then(|after| items.iter().position(|it| it["id"] == after))
        .map_or(0, |i| i + 1);
    let page: Vec<Value> = items.iter().skip(start).take(q.limit).cloned().collect();
    let has_more = start + page.len() < items.len();
    json!({
        "object": "list",
        "data": page,
        "first_id": page.first().map(|it| it["id"].clone()),
        "last_id": page.last().map(|it| it["id"].clone()),
        "has_more": has_more,
    })
}

/// Input item `i` of response `id` as an OpenAI item.
fn as_item(id: &str, i: usize, item: Value) -> Value {
    let Value::Object(mut o) = item else {
        return json!({"id": format!("item_{id}_{i}"), "type": "unknown", "value": item});
    };
    if !o.contains_key("type") && o.contains_key("role") {
        o.insert("type".into(), json!("message"));
    }
    if o.get("type").and_then(Value::as_str) == Some("message") {
        let part = if o.get("role").and_then(Value::as_str) == Some("assistant") {
            "output_text"
        } else {
            "input_text"
        };
        if let Some(Value::String(text)) = o.get("content") {
            let content = json!([{"type": part, "text": text}]);
            o.insert("content".into(), content);
        }
        o.entry("status").or_insert(json!("completed"));
    }
    if !o.get("id").is_some_and(Value::is_string) {
        let prefix = if o.get("type").and_then(Value::as_str) == Some("message") {
            "msg"
        } else {
            "item"
        };
        o.insert("id".into(), json!(format!("{prefix}_{id}_{i}")));
    }
    Value::Object(o)
}

/// A `/v1/responses` `input` as a list of items (a string is one user message).
pub fn input_items(input: &Value) -> Vec<Value> {
    match input {
        Value::String(s) => vec![json!({"role": "user", "content": s})],
        Value::Array(items) => items.clone(),
        other => vec![other.clone()],
    }
}

/// The output items of a response object, as input items of the next turn: each `message`
/// item becomes `{"role": "assistant", "content": <its text>}`; each `function_call` item (a
/// tool the model called) is kept as it is, the next turn's `function_call_output` answering it.
pub fn output_items(response: &Value) -> Vec<Value> {
    let Some(output) = response.get("output").and_then(Value::as_array) else {
        return Vec::new();
    };
    output
        .iter()
        .filter_map(|item| match item.get("type").and_then(Value::as_str) {
            Some("message") => {
                let text: String = item
                    .get("content")
                    .and_then(Value::as_array)
                    .map(|parts| {
                        parts
                            .iter()
                            .filter_map(|p| p.get("text").and_then(Value::as_str))
                            .collect()
                    })
                    .unwrap_or_default();
                let role = item
                    .get("role")
                    .and_then(Value::as_str)
                    .unwrap_or("assistant");
                Some(json!({"role": role, "content": text}))
            }
            Some("function_call") => Some(item.clone()),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    fn msg(role: &str, text: &str) -> Value {
        json!({"role": role, "content": text})
    }

    #[test]
    fn input_items_are_listed_as_openai_items_page_by_page() {
        let items = vec![
            msg("system", "be brief"),
            msg("user", "hi"),
            json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]}),
            json!({"type": "function_call_output", "call_id": "c1", "output": "rain"}),
        ];
        let all = ItemsQuery::parse("order=asc").unwrap();
        let list = item_list("resp_1", items.clone(), &all);
        assert_eq!(list["object"], "list");
        assert_eq!(list["has_more"], false);
        let data = list["data"].as_array().unwrap();
        assert_eq!(data.len(), 4);
        assert_eq!(
            data[1],
            json!({"id": "msg_resp_1_1", "type": "message", "role": "user", "status": "completed",
                   "content": [{"type": "input_text", "text": "hi"}]})
        );
        assert_eq!(data[2]["content"][0]["text"], "x");
        assert_eq!(data[3]["id"], "item_resp_1_3");
        assert_eq!(data[3]["call_id"], "c1");
        assert_eq!(list["first_id"], "msg_resp_1_0");
        // OpenAI's default order is newest first; pages follow `after`.
        let q = ItemsQuery::parse("limit=3").unwrap();
        let page = item_list("resp_1", items.clone(), &q);
        assert_eq!(page["first_id"], "item_resp_1_3");
        assert_eq!(page["has_more"], true);
        let q = ItemsQuery::parse(&format!(
            "limit=3&after={}",
            page["last_id"].as_str().unwrap()
        ))
        .unwrap();
        let next = item_list("resp_1", items, &q);
        assert_eq!(next["data"].as_array().unwrap().len(), 1);
        assert_eq!(next["first_id"], "msg_resp_1_0");
        assert_eq!(next["has_more"], false);
        for bad in ["limit=0", "limit=101", "limit=x", "order=up"] {
            assert!(ItemsQuery::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_retrieved_response_hides_the_lease_and_names_its_parent() {
        let r = json!({"id": "r2", "object": "response", "previous_response_id": null,
            "kv_transfer_params": {"do_remote_decode": true}, "output": []});
        let kept = as_retrieved(&r, Some("r1"));
        assert!(kept.get("kv_transfer_params").is_none());
        assert_eq!(kept["previous_response_id"], "r1");
        assert_eq!(kept["store"], true);
        assert_eq!(as_retrieved(&r, None)["previous_response_id"], Value::Null);
    }

    #[test]
    fn output_items_become_assistant_messages() {
        let resp = json!({"id": "r", "output": [
            {"type": "message", "id": "m", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": "Par"}, {"type": "output_text", "text": "is"}]},
            {"type": "reasoning", "summary": []},
            {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "weather",
             "arguments": "{}", "status": "completed"}
        ]});
        assert_eq!(
            output_items(&resp),
            vec![msg("assistant", "Paris"), resp["output"][2].clone()]
        );
        assert_eq!(input_items(&json!("q")), vec![msg("user", "q")]);
    }
}
