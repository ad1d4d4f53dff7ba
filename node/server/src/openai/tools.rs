//! Tool calling on `/v1/chat/completions`.
//!
//! - Where the client forces a call (`tool_choice` naming a function, or `"required"`) the
//!   answer is generated under a JSON schema built from the tools (structured output:
//!   `pd_grammar`), so it is always a well-formed call to a declared tool, on any model, with
//!   no model-specific parser: what vLLM does for these two choices.
//! - `"auto"` (the default when tools are sent) lets the model decide, in its own format: the
//!   node's tool-call parser (`--tool-call-parser`, [`super::tool_parser`]) reads the calls out
//!   of its text. Without one, `"auto"` with tools is refused by name.
//! - `"none"` answers in text.
use std::sync::Arc;

use pd_grammar::OutputSpec;
use serde::Deserialize;
use serde_json::{Value, json};

use super::tool_parser::{CallReader, Piece, ToolCallParser};
use crate::error::ApiError;

/// `tools` and `tool_choice`, flattened into each request body.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct ToolFields {
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    tool_choice: Option<Value>,
    /// OpenAI's: `false` allows at most one call per answer (default `true`).
    #[serde(default)]
    parallel_tool_calls: Option<bool>,
}

/// One declared function: its name and the JSON schema of its arguments.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Function {
    pub(crate) name: String,
    pub(crate) parameters: Value,
}

/// How a chat request may use its tools.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ToolCalling {
    /// No tools, or `tool_choice: "none"`: the answer is text.
    Text,
    /// `tool_choice: {"type": "function", "function": {"name": ...}}`: the answer is the
    /// arguments of one call to it.
    Named(Function),
    /// `tool_choice: "required"`: the answer is a list of one or more calls to declared tools
    /// (exactly one unless `parallel`).
    Required {
        tools: Vec<Function>,
        parallel: bool,
    },
    /// `tool_choice: "auto"` with tools: the model answers in text, calls, or both, read by
    /// `parser`; a call names one of `names`; a second call is text unless `parallel`.
    Auto {
        parser: ToolCallParser,
        names: Arc<[String]>,
        parallel: bool,
    },
}

impl ToolFields {
    /// The chat request's tool calling.
    ///
    /// # Errors
    /// A 400 naming `tools` or `tool_choice` for a malformed tool, an unknown function named,
    /// `"required"` without tools, or `"auto"` with tools on a node without a tool-call
    /// parser (`parser`).
    pub(crate) fn for_chat(&self, parser: Option<ToolCallParser>) -> Result<ToolCalling, ApiError> {
        let tools = self.tools()?;
        let parallel = self.parallel_tool_calls.unwrap_or(true);
        let auto = |tools: Vec<Function>| {
            if tools.is_empty() {
                return Ok(ToolCalling::Text);
            }
            let parser = parser.ok_or_else(auto_refused)?;
            Ok(ToolCalling::Auto {
                parser,
                names: tools.into_iter().map(|f| f.name).collect(),
                parallel,
            })
        };
        let choice = present(&self.tool_choice);
        match choice {
            None => auto(tools),
            Some(Value::String(s)) => match s.as_str() {
                "none" => Ok(ToolCalling::Text),
                "auto" => auto(tools),
                "required" if tools.is_empty() => Err(ApiError::invalid(
                    "tool_choice",
                    "tool_choice \"required\" needs at least one tool in tools",
                )),
                "required" => Ok(ToolCalling::Required { tools, parallel }),
                other => Err(ApiError::invalid(
                    "tool_choice",
                    format!(
                        "tool_choice must be \"none\", \"auto\", \"required\" or a named function, got {other:?}"
                    ),
                )),
            },
            Some(named) => {
                let name = named
                    .get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        ApiError::invalid(
                            "tool_choice",
                            format!("a named tool_choice is {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {named}"),
                        )
                    })?;
                tools
                    .into_iter()
                    .find(|f| f.name == name)
                    .map(ToolCalling::Named)
                    .ok_or_else(|| {
                        ApiError::invalid(
                            "tool_choice",
                            format!("tool_choice names function {name:?}, which is not in tools"),
                        )
                    })
            }
        }
    }

    /// The Responses API's tool calling: its function tools (`{"type": "function", "name",
    /// "parameters"}`) and named choice (`{"type": "function", "name"}`) read as their chat
    /// forms are, by [`ToolFields::for_chat`].
    ///
    /// # Errors
    /// As [`ToolFields::for_chat`].
    pub(crate) fn for_responses(
        &self,
        parser: Option<ToolCallParser>,
    ) -> Result<ToolCalling, ApiError> {
        let tools = match present(&self.tools) {
            Some(Value::Array(_)) => pd_tokenize::prompt::responses_tools(self.tools.as_ref()),
            other => other.cloned(),
        };
        let tool_choice = match present(&self.tool_choice) {
            Some(Value::Object(o))
                if o.get("type").and_then(Value::as_str) == Some("function")
                    && !o.contains_key("function") =>
            {
                let name = o.get("name").and_then(Value::as_str).ok_or_else(|| {
                    ApiError::invalid(
                        "tool_choice",
                        "a named tool_choice is {\"type\": \"function\", \"name\": ...}",
                    )
                })?;
                Some(json!({"type": "function", "function": {"name": name}}))
            }
            other => other.cloned(),
        };
        ToolFields {
            tools,
            tool_choice,
            parallel_tool_calls: self.parallel_tool_calls,
        }
        .for_chat(parser)
    }

    /// The Responses API's `tools` for the chat template, in chat form.
    pub(crate) fn listed_for_responses(&self) -> Option<Value> {
        pd_tokenize::prompt::responses_tools(present(&self.tools))
    }

    /// `parallel_tool_calls` as sent (default `true`), echoed in a response object.
    pub(crate) fn parallel(&self) -> bool {
        self.parallel_tool_calls.unwrap_or(true)
    }

    /// The `tools` and `tool_choice` fields as sent, echoed in a response object.
    pub(crate) fn echo(&self) -> (Vec<Value>, Value) {
        let tools = match present(&self.tools) {
            Some(Value::Array(list)) => list.clone(),
            _ => Vec::new(),
        };
        let choice = present(&self.tool_choice)
            .cloned()
            .unwrap_or_else(|| json!("auto"));
        (tools, choice)
    }

    /// The `tools` field as sent (for the chat template: `pd_tokenize::prompt::chat_tools`).
    pub(crate) fn listed(&self) -> Option<&Value> {
        present(&self.tools)
    }

    /// For the APIs without tool calling here (completions, responses): a 400 unless no tool
    /// may be called.
    pub(crate) fn refuse(&self) -> Result<(), ApiError> {
        let has_tools = match present(&self.tools) {
            None => false,
            Some(Value::Array(a)) => !a.is_empty(),
            Some(other) => {
                return Err(ApiError::invalid(
                    "tools",
                    format!("tools must be a list, got {other}"),
                ));
            }
        };
        match present(&self.tool_choice).map(|c| (c, c.as_str())) {
            Some((_, Some("none"))) => Ok(()),
            None | Some((_, Some("auto"))) if !has_tools => Ok(()),
            None | Some((_, Some("auto"))) => Err(ApiError::invalid(
                "tools",
                "tool calling is supported on /v1/chat/completions and /v1/responses: send no tools, or tool_choice \"none\"",
            )),
            Some((choice, _)) => Err(ApiError::invalid(
                "tool_choice",
                format!(
                    "tool_choice {choice} is supported on /v1/chat/completions and /v1/responses: here only \"none\""
                ),
            )),
        }
    }

    /// The declared functions, checked.
    fn tools(&self) -> Result<Vec<Function>, ApiError> {
        let list = match present(&self.tools) {
            None => return Ok(Vec::new()),
            Some(Value::Array(a)) => a,
            Some(other) => {
                return Err(ApiError::invalid(
                    "tools",
                    format!("tools must be a list, got {other}"),
                ));
            }
        };
        let mut out: Vec<Function> = Vec::with_capacity(list.len());
        for (i, tool) in list.iter().enumerate() {
            let bad = |what: &str| ApiError::invalid("tools", format!("tools[{i}]: {what}"));
            if tool.get("type").and_then(Value::as_str) != Some("function") {
                return Err(bad("only {\"type\": \"function\"} tools are supported"));
            }
            let f = tool
                .get("function")
                .ok_or_else(|| bad("needs \"function\""))?;
            let name = f
                .get("name")
                .and_then(Value::as_str)
                .filter(|n| !n.is_empty())
                .ok_or_else(|| bad("function.name must be a non-empty string"))?;
            if out.iter().any(|o| o.name == name) {
                return Err(bad(&format!("function {name:?} is declared twice")));
            }
            let parameters = match f.get("parameters") {
                None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
                Some(p @ (Value::Object(_) | Value::Bool(_))) => p.clone(),
                Some(other) => {
                    return Err(bad(&format!(
                        "function.parameters must be a JSON schema, got {other}"
                    )));
                }
            };
            out.push(Function {
                name: name.to_owned(),
                parameters,
            });
        }
        Ok(out)
    }
}

fn auto_refused() -> ApiError {
    ApiError::invalid(
        "tools",
        "tool_choice \"auto\" (the default with tools) needs a tool-call parser for this model, and this node \
         serves without one (start it with --tool-call-parser hermes if the model writes <tool_call> blocks): \
         force a call with tool_choice \"required\" or a named function, or answer in text with \"none\"",
    )
}

/// The field's value unless absent or `null`.
fn present(v: &Option<Value>) -> Option<&Value> {
    v.as_ref().filter(|v| !v.is_null())
}

impl ToolCalling {
    /// The constraint the answer is generated under, if it is a call.
    ///
    /// For `"required"` each tool's `parameters` sits under the list's schema, so the
    /// definitions its `$ref`s name (`#/$defs/…`, `#/definitions/…`) move up to the list's root
    /// with it, as vLLM does; two tools defining one name differently, or a reference to a
    /// tool's own root (`#`), are a 400 naming `tools`.
    ///
    /// # Errors
    /// As above.
    pub(crate) fn constraint(&self) -> Result<Option<OutputSpec>, ApiError> {
        match self {
            ToolCalling::Text | ToolCalling::Auto { .. } => Ok(None),
            ToolCalling::Named(f) => Ok(Some(OutputSpec::JsonSchema(f.parameters.clone()))),
            ToolCalling::Required { tools, parallel } => {
                let mut defs = serde_json::Map::new();
                let mut calls = Vec::with_capacity(tools.len());
                for f in tools {
                    let mut parameters = f.parameters.clone();
                    if refers_to_root(&parameters) {
                        return Err(ApiError::invalid(
                            "tools",
                            format!(
                                "function {:?}: a $ref to the parameters' own root (\"#\") cannot be kept under tool_choice \"required\"",
                                f.name
                            ),
                        ));
                    }
                    if let Some(own) = parameters.as_object_mut() {
                        for key in ["$defs", "definitions"] {
                            let Some(Value::Object(found)) = own.remove(key) else {
                                continue;
                            };
                            let at = defs
                                .entry(key)
                                .or_insert_with(|| Value::Object(serde_json::Map::new()));
                            let Value::Object(at) = at else { continue };
                            for (name, def) in found {
                                match at.get(&name) {
                                    Some(other) if *other != def => {
                                        return Err(ApiError::invalid(
                                            "tools",
                                            format!(
                                                "{key}/{name} is defined differently by two tools; rename one"
                                            ),
                                        ));
                                    }
                                    _ => {
                                        at.insert(name, def);
                                    }
                                }
                            }
                        }
                    }
                    calls.push(json!({"type": "object",
                        "properties": {"name": {"enum": [f.name]}, "parameters": parameters},
                        "required": ["name", "parameters"], "additionalProperties": false}));
                }
                let mut schema = json!({"type": "array", "minItems": 1, "items": {"anyOf": calls}});
                if !parallel {
                    schema["maxItems"] = json!(1);
                }
                if let Some(root) = schema.as_object_mut() {
                    root.extend(defs);
                }
                Ok(Some(OutputSpec::JsonSchema(schema)))
            }
        }
    }

    /// The `finish_reason` of an answer that became `calls_of`'s calls: `tool_calls` where the
    /// call is whole and ended by itself (OpenAI's reason for a message that calls tools),
    /// else why it was cut (`length`, or `stop` for a stop string inside the arguments).
    pub(crate) fn finish(&self, reason: Option<&'static str>, text: &str) -> Option<&'static str> {
        let whole = match self {
            ToolCalling::Text | ToolCalling::Auto { .. } => false,
            ToolCalling::Named(_) => serde_json::from_str::<serde::de::IgnoredAny>(text).is_ok(),
            ToolCalling::Required { .. } => true,
        };
        match reason {
            Some("stop") if whole => Some("tool_calls"),
            other => other,
        }
    }

    /// Sets what this tool calling asks of the engine on `params` (whose structured output is
    /// already read from the request): a forced call's constraint (errors then name `tools`),
    /// and special tokens kept in the text for a parser (its markers may be special tokens,
    /// as vLLM's Hermes parser says).
    ///
    /// # Errors
    /// A 400 naming `tool_choice` where the request also constrains the answer itself, or the
    /// constraint's own errors ([`ToolCalling::constraint`]).
    pub(crate) fn apply(&self, params: &mut pd_engine::SamplingParams) -> Result<(), ApiError> {
        if self.reader().is_some() {
            params.skip_special_tokens = false;
        }
        let Some(spec) = self.constraint()? else {
            return Ok(());
        };
        if let Some(other) = &params.structured {
            return Err(ApiError::invalid(
                "tool_choice",
                format!(
                    "tool_choice forces a tool call and {} constrains the answer too; send one",
                    other.field
                ),
            ));
        }
        params.structured = Some(pd_engine::StructuredOutput {
            spec,
            field: "tools",
        });
        Ok(())
    }

    /// Whether answers are forced tool calls.
    pub(crate) fn calls(&self) -> bool {
        matches!(self, ToolCalling::Named(_) | ToolCalling::Required { .. })
    }

    /// A reader of one answer's own calls, where the model may write them (`"auto"`).
    pub(crate) fn reader(&self) -> Option<CallReader> {
        match self {
            ToolCalling::Auto {
                parser,
                names,
                parallel,
            } => Some(CallReader::new(*parser, names.clone(), *parallel)),
            _ => None,
        }
    }

    /// The `tool_calls` of a finished answer `text`, with `index` and fresh ids as streamed
    /// deltas carry them. A named call's arguments are the text as generated, cut or not (as
    /// its stream sent them); a list of calls cut by `max_tokens` is no call (`None`: the text
    /// is returned as content).
    pub(crate) fn calls_of(&self, text: &str) -> Option<Vec<Value>> {
        match self {
            ToolCalling::Text | ToolCalling::Auto { .. } => None,
            ToolCalling::Named(f) => Some(vec![call(0, &f.name, text.to_owned())]),
            ToolCalling::Required { .. } => {
                // Each call's arguments as generated (not re-printed: a number past f64's
                // precision keeps its digits).
                #[derive(Deserialize)]
                struct Generated<'a> {
                    name: String,
                    #[serde(borrow)]
                    parameters: &'a serde_json::value::RawValue,
                }
                let list: Vec<Generated<'_>> = serde_json::from_str(text).ok()?;
                Some(
                    list.iter()
                        .enumerate()
                        .map(|(i, c)| call(i, &c.name, c.parameters.get().to_owned()))
                        .collect(),
                )
            }
        }
    }

    /// The named function's first streamed delta: its id and name, arguments to follow.
    pub(crate) fn named_head(&self) -> Option<Value> {
        match self {
            ToolCalling::Named(f) => Some(call(0, &f.name, String::new())),
            _ => None,
        }
    }
}

/// What a [`CallReader`] read, as a message or delta carries it: the content (`None` if there
/// was none) and the calls, numbered from `next_index` on (which moves past them).
pub(crate) fn message_parts(
    pieces: Vec<Piece>,
    next_index: &mut usize,
) -> (Option<String>, Vec<Value>) {
    let mut content: Option<String> = None;
    let mut calls = Vec::new();
    for piece in pieces {
        match piece {
            Piece::Content(text) => content.get_or_insert_with(String::new).push_str(&text),
            Piece::Call { name, arguments } => {
                calls.push(call(*next_index, &name, arguments));
                *next_index += 1;
            }
        }
    }
    (content, calls)
}

/// The `finish_reason` of an answer in which the model called `calls` tools itself: OpenAI's
/// `tool_calls` where it called any and ended by itself, else its own reason.
pub(crate) fn auto_finish(reason: Option<&'static str>, calls: usize) -> Option<&'static str> {
    match reason {
        Some("stop") if calls > 0 => Some("tool_calls"),
        other => other,
    }
}

/// Whether `schema` holds a `$ref` to its own root (`"#"`), which would name another schema
/// once nested.
fn refers_to_root(schema: &Value) -> bool {
    match schema {
        Value::Object(map) => map
            .iter()
            .any(|(k, v)| (k == "$ref" && v.as_str() == Some("#")) || refers_to_root(v)),
        Value::Array(items) => items.iter().any(refers_to_root),
        _ => false,
    }
}

/// One `tool_calls` entry.
pub(crate) fn call(index: usize, name: &str, arguments: String) -> Value {
    json!({"index": index, "id": crate::routes::new_id("call_"), "type": "function",
        "function": {"name": name, "arguments": arguments}})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(body: Value) -> Result<ToolCalling, Option<String>> {
        read_with(body, None)
    }

    fn read_with(
        body: Value,
        parser: Option<ToolCallParser>,
    ) -> Result<ToolCalling, Option<String>> {
        let f: ToolFields = serde_json::from_value(body).unwrap();
        f.for_chat(parser).map_err(|e| e.param().map(str::to_owned))
    }

    fn weather() -> Value {
        json!([{"type": "function", "function": {"name": "weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "time"}}])
    }

    #[test]
    fn forced_calls_are_read_and_auto_is_refused() {
        assert_eq!(read(json!({})), Ok(ToolCalling::Text));
        assert_eq!(
            read(json!({"tools": weather(), "tool_choice": "none"})),
            Ok(ToolCalling::Text)
        );
        assert_eq!(
            read(json!({"tools": [], "tool_choice": "auto"})),
            Ok(ToolCalling::Text)
        );
        let ToolCalling::Named(f) = read(json!({"tools": weather(),
            "tool_choice": {"type": "function", "function": {"name": "time"}}}))
        .unwrap() else {
            panic!("named")
        };
        assert_eq!(f.name, "time");
        assert_eq!(f.parameters, json!({"type": "object", "properties": {}}));
        let ToolCalling::Required {
            tools: all,
            parallel: true,
        } = read(json!({"tools": weather(), "tool_choice": "required"})).unwrap()
        else {
            panic!("required")
        };
        assert_eq!(all.len(), 2);
        for (body, param) in [
            (json!({"tools": weather()}), "tools"),
            (json!({"tools": weather(), "tool_choice": "auto"}), "tools"),
            (json!({"tool_choice": "required"}), "tool_choice"),
            (
                json!({"tools": weather(), "tool_choice": "sometimes"}),
                "tool_choice",
            ),
            (
                json!({"tools": weather(), "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
                "tool_choice",
            ),
            (
                json!({"tools": weather(), "tool_choice": {"type": "function"}}),
                "tool_choice",
            ),
            (json!({"tools": {"a": 1}}), "tools"),
            (
                json!({"tools": [{"type": "retrieval"}], "tool_choice": "required"}),
                "tools",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": ""}}], "tool_choice": "required"}),
                "tools",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "a", "parameters": 3}}], "tool_choice": "required"}),
                "tools",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "a"}}], "tool_choice": "required"}),
                "tools",
            ),
        ] {
            assert_eq!(
                read(body.clone()).err(),
                Some(Some(param.to_owned())),
                "{body}"
            );
        }
    }

    #[test]
    fn auto_is_read_where_the_node_has_a_parser() {
        let hermes = Some(ToolCallParser::Hermes);
        let names: Arc<[String]> = vec!["weather".to_owned(), "time".to_owned()].into();
        for body in [
            json!({"tools": weather()}),
            json!({"tools": weather(), "tool_choice": "auto"}),
        ] {
            assert_eq!(
                read_with(body, hermes),
                Ok(ToolCalling::Auto {
                    parser: ToolCallParser::Hermes,
                    names: names.clone(),
                    parallel: true,
                })
            );
        }
        assert_eq!(
            read_with(json!({"tools": [], "tool_choice": "auto"}), hermes),
            Ok(ToolCalling::Text)
        );
        assert_eq!(
            read_with(json!({"tools": weather(), "tool_choice": "none"}), hermes),
            Ok(ToolCalling::Text)
        );
        // Tools are checked as for a forced call.
        assert_eq!(
            read_with(json!({"tools": [{"type": "retrieval"}]}), hermes),
            Err(Some("tools".to_owned()))
        );
    }

    #[test]
    fn required_lists_keep_each_tools_definitions_at_the_root() {
        let tools = json!([
            {"type": "function", "function": {"name": "a", "parameters": {"type": "object",
                "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}}}}},
            {"type": "function", "function": {"name": "b", "parameters": {"type": "object",
                "properties": {"q": {"$ref": "#/$defs/Q"}, "p": {"$ref": "#/$defs/P"}},
                "$defs": {"Q": {"type": "string"}, "P": {"type": "integer"}}}}}
        ]);
        let calling = read(json!({"tools": tools, "tool_choice": "required"})).unwrap();
        let Some(OutputSpec::JsonSchema(schema)) = calling.constraint().unwrap() else {
            panic!("a schema")
        };
        assert_eq!(
            schema["$defs"],
            json!({"P": {"type": "integer"}, "Q": {"type": "string"}})
        );
        assert!(
            schema["items"]["anyOf"][0]["properties"]["parameters"]
                .get("$defs")
                .is_none()
        );
        assert!(schema.get("maxItems").is_none());
        // One call only: the list holds one.
        let one =
            read(json!({"tools": tools, "tool_choice": "required", "parallel_tool_calls": false}))
                .unwrap();
        let Some(OutputSpec::JsonSchema(schema)) = one.constraint().unwrap() else {
            panic!("a schema")
        };
        assert_eq!(schema["maxItems"], 1);
        // The same name defined two ways, and a root self-reference, cannot be kept.
        let clash = json!([
            {"type": "function", "function": {"name": "a", "parameters": {"$defs": {"P": {"type": "integer"}}}}},
            {"type": "function", "function": {"name": "b", "parameters": {"$defs": {"P": {"type": "string"}}}}}
        ]);
        let recursive = json!([{"type": "function", "function": {"name": "t", "parameters":
            {"type": "object", "properties": {"child": {"$ref": "#"}}}}}]);
        for tools in [clash, recursive] {
            let calling = read(json!({"tools": tools, "tool_choice": "required"})).unwrap();
            let e = calling.constraint().unwrap_err();
            assert_eq!(e.param(), Some("tools"), "{e}");
        }
    }

    #[test]
    fn answers_become_calls_and_a_cut_list_does_not() {
        let named = ToolCalling::Named(Function {
            name: "weather".into(),
            parameters: json!({}),
        });
        let calls = named.calls_of(r#"{"city":"Oslo"}"#).unwrap();
        assert_eq!(
            calls[0]["function"],
            json!({"name": "weather", "arguments": "{\"city\":\"Oslo\"}"})
        );
        assert_eq!(calls[0]["type"], "function");
        assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
        let cut = named.calls_of(r#"{"city":"Os"#).unwrap();
        assert_eq!(cut[0]["function"]["arguments"], r#"{"city":"Os"#);
        let required = ToolCalling::Required {
            tools: vec![],
            parallel: true,
        };
        let calls = required
            .calls_of(r#"[{"name":"weather","parameters":{"city":"Oslo"}},{"name":"time","parameters":{}}]"#)
            .unwrap();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[1]["index"], 1);
        assert_eq!(
            calls[1]["function"],
            json!({"name": "time", "arguments": "{}"})
        );
        assert_eq!(required.calls_of(r#"[{"name":"weather","param"#), None);
        assert_eq!(ToolCalling::Text.calls_of("hi"), None);
        // `tool_calls` only for a whole call that ended by itself.
        assert_eq!(
            named.finish(Some("stop"), r#"{"city":"Oslo"}"#),
            Some("tool_calls")
        );
        assert_eq!(named.finish(Some("stop"), r#"{"city":"Os"#), Some("stop"));
        assert_eq!(
            named.finish(Some("length"), r#"{"city":"Os"#),
            Some("length")
        );
        assert_eq!(required.finish(Some("stop"), "[]"), Some("tool_calls"));
        // Arguments as generated, digits and all.
        let big = required
            .calls_of(r#"[{"name":"n","parameters":{"x":123456789012345678901234567890}}]"#)
            .unwrap();
        assert_eq!(
            big[0]["function"]["arguments"],
            r#"{"x":123456789012345678901234567890}"#
        );
    }
}
