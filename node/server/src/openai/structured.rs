//! Structured output as clients ask for it: OpenAI's `response_format` (chat, completions), the
//! Responses API's `text.format`, and vLLM's `structured_outputs` and older `guided_*` fields,
//! read into one [`StructuredOutput`] for the engine. At most one of them may constrain a
//! request; a kind this node does not build (`structural_tag`) is refused by name, never
//! ignored.

use pd_engine::StructuredOutput;
use pd_grammar::OutputSpec;
use serde::Deserialize;
use serde_json::Value;

use crate::error::ApiError;

/// The structured-output fields, flattened into each request body (all optional; `null` is
/// absent).
#[derive(Debug, Default, Deserialize)]
pub(crate) struct StructuredFields {
    /// Chat and completions: `{"type": "text" | "json_object" | "json_schema", ...}`.
    #[serde(default)]
    response_format: Option<Value>,
    /// Responses: `text.format` is its `response_format` (the schema inline, no
    /// `json_schema` wrapper).
    #[serde(default)]
    text: Option<Value>,
    /// vLLM: `{"json" | "regex" | "choice" | "grammar" | "json_object": ...}`, one of them.
    #[serde(default)]
    structured_outputs: Option<Value>,
    /// vLLM's older spelling of each kind.
    #[serde(default)]
    guided_json: Option<Value>,
    #[serde(default)]
    guided_regex: Option<Value>,
    #[serde(default)]
    guided_choice: Option<Value>,
    #[serde(default)]
    guided_grammar: Option<Value>,
}

impl StructuredFields {
    /// The request's constraint, if any.
    ///
    /// # Errors
    /// A 400 naming the field when its shape is wrong, its kind unsupported, or two fields
    /// constrain the same request.
    pub(crate) fn to_structured(&self) -> Result<Option<StructuredOutput>, ApiError> {
        let mut found: Vec<StructuredOutput> = Vec::new();
        let mut add = |field: &'static str, spec: Option<OutputSpec>| {
            if let Some(spec) = spec {
                found.push(StructuredOutput { spec, field });
            }
        };
        if let Some(format) = present(&self.response_format) {
            add(
                "response_format",
                response_format(format, "response_format")?,
            );
        }
        if let Some(format) = present(&self.text).and_then(|t| t.get("format"))
            && !format.is_null()
        {
            add("text.format", text_format(format)?);
        }
        if let Some(s) = present(&self.structured_outputs) {
            add("structured_outputs", Some(structured_outputs(s)?));
        }
        if let Some(v) = present(&self.guided_json) {
            add("guided_json", Some(json_schema(v, "guided_json")?));
        }
        if let Some(v) = present(&self.guided_regex) {
            add(
                "guided_regex",
                Some(OutputSpec::Regex(string(v, "guided_regex")?)),
            );
        }
        if let Some(v) = present(&self.guided_choice) {
            add(
                "guided_choice",
                Some(OutputSpec::Choice(choices(v, "guided_choice")?)),
            );
        }
        if let Some(v) = present(&self.guided_grammar) {
            add(
                "guided_grammar",
                Some(OutputSpec::Grammar(string(v, "guided_grammar")?)),
            );
        }
        if found.len() > 1 {
            return Err(ApiError::invalid(
                found[1].field,
                format!(
                    "{} and {} both constrain the output; send one",
                    found[0].field, found[1].field
                ),
            ));
        }
        Ok(found.pop())
    }
}

/// The field's value unless absent or `null`.
fn present(v: &Option<Value>) -> Option<&Value> {
    v.as_ref().filter(|v| !v.is_null())
}

/// Chat/completions `response_format`: `None` for plain text.
fn response_format(format: &Value, field: &'static str) -> Result<Option<OutputSpec>, ApiError> {
    match kind(format, field)? {
        "text" => Ok(None),
        "json_object" => Ok(Some(OutputSpec::JsonObject)),
        "json_schema" => {
            let inner = format.get("json_schema").ok_or_else(|| {
                ApiError::invalid(
                    field,
                    format!("{field} of type json_schema needs json_schema"),
                )
            })?;
            schema_of(inner, field).map(Some)
        }
        other => Err(unsupported_kind(field, other)),
    }
}

/// The Responses API's `text.format`: as `response_format`, the schema's fields inline.
fn text_format(format: &Value) -> Result<Option<OutputSpec>, ApiError> {
    let field = "text.format";
    match kind(format, field)? {
        "text" => Ok(None),
        "json_object" => Ok(Some(OutputSpec::JsonObject)),
        "json_schema" => schema_of(format, field).map(Some),
        other => Err(unsupported_kind(field, other)),
    }
}

fn kind<'a>(format: &'a Value, field: &'static str) -> Result<&'a str, ApiError> {
    format.get("type").and_then(Value::as_str).ok_or_else(|| {
        ApiError::invalid(
            field,
            format!("{field} needs a string \"type\", got {format}"),
        )
    })
}

fn unsupported_kind(field: &'static str, kind: &str) -> ApiError {
    ApiError::invalid(
        field,
        format!(
            "{field} type {kind:?} is not supported by this server; use \"text\", \"json_object\" or \"json_schema\""
        ),
    )
}

/// `{"name": ..., "schema": {...}, "strict": ...}`: the schema (required).
fn schema_of(holder: &Value, field: &'static str) -> Result<OutputSpec, ApiError> {
    match holder.get("schema") {
        Some(schema) if !schema.is_null() => json_schema(schema, field),
        _ => Err(ApiError::invalid(
            field,
            format!("{field}: a json_schema format needs its \"schema\""),
        )),
    }
}

/// A schema given as an object (or `true`/`false`), or as a string holding one (vLLM accepts
/// both).
fn json_schema(v: &Value, field: &'static str) -> Result<OutputSpec, ApiError> {
    let schema = match v {
        Value::String(s) => serde_json::from_str(s).map_err(|e| {
            ApiError::invalid(
                field,
                format!("{field}: the schema string is not JSON: {e}"),
            )
        })?,
        other => other.clone(),
    };
    match schema {
        Value::Object(_) | Value::Bool(_) => Ok(OutputSpec::JsonSchema(schema)),
        other => Err(ApiError::invalid(
            field,
            format!("{field}: a JSON schema is an object, got {other}"),
        )),
    }
}

fn string(v: &Value, field: &'static str) -> Result<String, ApiError> {
    v.as_str()
        .map(str::to_owned)
        .ok_or_else(|| ApiError::invalid(field, format!("{field} must be a string, got {v}")))
}

fn choices(v: &Value, field: &'static str) -> Result<Vec<String>, ApiError> {
    let list = v.as_array().filter(|a| !a.is_empty()).ok_or_else(|| {
        ApiError::invalid(
            field,
            format!("{field} must be a non-empty list of strings"),
        )
    })?;
    list.iter()
        .map(|c| {
            c.as_str().map(str::to_owned).ok_or_else(|| {
                ApiError::invalid(field, format!("{field} must list strings, got {c}"))
            })
        })
        .collect()
}

/// vLLM's `structured_outputs` object: exactly one kind; its options that only shape
/// whitespace or pick a backend are accepted (JSON is always compact here, and the backend is
/// llguidance), `structural_tag` is refused.
fn structured_outputs(v: &Value) -> Result<OutputSpec, ApiError> {
    let field = "structured_outputs";
    let Value::Object(map) = v else {
        return Err(ApiError::invalid(
            field,
            format!("{field} must be an object, got {v}"),
        ));
    };
    let mut kinds = Vec::new();
    for (key, value) in map {
        if value.is_null() {
            continue;
        }
        let spec = match key.as_str() {
            "json" => json_schema(value, field)?,
            "regex" => OutputSpec::Regex(string(value, field)?),
            "choice" => OutputSpec::Choice(choices(value, field)?),
            "grammar" => OutputSpec::Grammar(string(value, field)?),
            "json_object" if value.as_bool() == Some(true) => OutputSpec::JsonObject,
            "json_object" => continue,
            "disable_any_whitespace"
            | "disable_fallback"
            | "whitespace_pattern"
            | "disable_additional_properties"
            | "backend"
            | "_backend" => continue,
            other => {
                return Err(ApiError::invalid(
                    field,
                    format!("{field}.{other} is not supported by this server"),
                ));
            }
        };
        kinds.push((key.as_str(), spec));
    }
    match kinds.len() {
        1 => Ok(kinds
            .pop()
            .map(|(_, s)| s)
            .unwrap_or(OutputSpec::JsonObject)),
        0 => Err(ApiError::invalid(
            field,
            format!("{field} needs one of json, regex, choice, grammar, json_object"),
        )),
        _ => Err(ApiError::invalid(
            field,
            format!("{field} sets {} and {}; send one", kinds[0].0, kinds[1].0),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn read(body: Value) -> Result<Option<(OutputSpec, &'static str)>, Option<String>> {
        let fields: StructuredFields = serde_json::from_value(body).unwrap();
        fields
            .to_structured()
            .map(|s| s.map(|s| (s.spec, s.field)))
            .map_err(|e| e.param().map(str::to_owned))
    }

    #[test]
    fn each_way_of_asking_reads_into_one_constraint() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let s = || OutputSpec::JsonSchema(schema.clone());
        for (body, want) in [
            (json!({}), None),
            (json!({"response_format": null, "guided_json": null}), None),
            (json!({"response_format": {"type": "text"}}), None),
            (json!({"text": {"format": {"type": "text"}}}), None),
            (json!({"text": {"verbosity": "low"}}), None),
            (
                json!({"response_format": {"type": "json_object"}}),
                Some((OutputSpec::JsonObject, "response_format")),
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}}),
                Some((s(), "response_format")),
            ),
            (
                json!({"text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}),
                Some((s(), "text.format")),
            ),
            (
                json!({"structured_outputs": {"json": schema, "disable_any_whitespace": true}}),
                Some((s(), "structured_outputs")),
            ),
            (
                json!({"structured_outputs": {"json": schema.to_string()}}),
                Some((s(), "structured_outputs")),
            ),
            (
                json!({"structured_outputs": {"regex": "a+", "json": null}}),
                Some((OutputSpec::Regex("a+".into()), "structured_outputs")),
            ),
            (
                json!({"structured_outputs": {"choice": ["x", "y"]}}),
                Some((
                    OutputSpec::Choice(vec!["x".into(), "y".into()]),
                    "structured_outputs",
                )),
            ),
            (
                json!({"structured_outputs": {"json_object": true}}),
                Some((OutputSpec::JsonObject, "structured_outputs")),
            ),
            (json!({"guided_json": schema}), Some((s(), "guided_json"))),
            (
                json!({"guided_regex": "[0-9]+"}),
                Some((OutputSpec::Regex("[0-9]+".into()), "guided_regex")),
            ),
            (
                json!({"guided_choice": ["a"]}),
                Some((OutputSpec::Choice(vec!["a".into()]), "guided_choice")),
            ),
            (
                json!({"guided_grammar": "start: \"a\""}),
                Some((OutputSpec::Grammar("start: \"a\"".into()), "guided_grammar")),
            ),
        ] {
            assert_eq!(read(body.clone()), Ok(want), "{body}");
        }
    }

    #[test]
    fn wrong_shapes_unknown_kinds_and_two_constraints_are_refused_by_name() {
        for (body, param) in [
            (
                json!({"response_format": {"type": "structural_tag"}}),
                "response_format",
            ),
            (
                json!({"response_format": {"type": "json_schema"}}),
                "response_format",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
                "response_format",
            ),
            (json!({"response_format": "json"}), "response_format"),
            (
                json!({"text": {"format": {"type": "grammar"}}}),
                "text.format",
            ),
            (json!({"structured_outputs": {}}), "structured_outputs"),
            (
                json!({"structured_outputs": {"regex": "a", "choice": ["b"]}}),
                "structured_outputs",
            ),
            (
                json!({"structured_outputs": {"structural_tag": "{}"}}),
                "structured_outputs",
            ),
            (
                json!({"structured_outputs": {"json": "{not json"}}),
                "structured_outputs",
            ),
            (
                json!({"structured_outputs": {"json": [1]}}),
                "structured_outputs",
            ),
            (json!({"guided_choice": []}), "guided_choice"),
            (json!({"guided_choice": [1, 2]}), "guided_choice"),
            (json!({"guided_regex": 5}), "guided_regex"),
            (
                json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}),
                "guided_regex",
            ),
        ] {
            assert_eq!(read(body.clone()), Err(Some(param.to_owned())), "{body}");
        }
    }
}
