//! Fields of the OpenAI API this node does not implement and whose silent omission would
//! change the answer (a deprecated function call never made, a suffix never joined): each is
//! refused with a 400 naming it. (Structured output is `structured`, tool calling `tools`.)
//! Fields whose omission changes nothing a client relies on (`user`, `metadata`, `store`...) are accepted and
//! ignored, as the request structs' doc says.

use serde::Deserialize;
use serde_json::Value;

use crate::error::ApiError;

/// The refused fields' slots, flattened into each request body (all optional; `null` is absent).
#[derive(Debug, Default, Deserialize)]
pub(crate) struct UnsupportedFields {
    /// The deprecated form of `tools`.
    #[serde(default)]
    functions: Option<Value>,
    /// Completions: text after the insertion point.
    #[serde(default)]
    suffix: Option<Value>,
    /// Completions: sample this many and return the `n` most likely.
    #[serde(default)]
    best_of: Option<Value>,
}

impl UnsupportedFields {
    /// A 400 naming the first field set to something this node would not honour.
    pub(crate) fn refuse(&self) -> Result<(), ApiError> {
        if let Some(f) = present(&self.functions)
            && f.as_array().is_none_or(|a| !a.is_empty())
        {
            return Err(ApiError::invalid(
                "functions",
                "function calling is not supported by this server",
            ));
        }
        if let Some(suffix) = present(&self.suffix)
            && suffix.as_str() != Some("")
        {
            return Err(ApiError::invalid(
                "suffix",
                "suffix is not supported by this server",
            ));
        }
        if let Some(best_of) = present(&self.best_of)
            && best_of.as_u64() != Some(1)
        {
            return Err(ApiError::invalid(
                "best_of",
                format!(
                    "best_of must be 1 on this server (ask for n completions instead), got {best_of}"
                ),
            ));
        }
        Ok(())
    }
}

/// The field's value unless absent or `null`.
fn present(v: &Option<Value>) -> Option<&Value> {
    v.as_ref().filter(|v| !v.is_null())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(body: Value) -> Result<(), Option<String>> {
        let fields: UnsupportedFields = serde_json::from_value(body).unwrap();
        fields.refuse().map_err(|e| e.param().map(str::to_owned))
    }

    #[test]
    fn honourable_values_pass() {
        for body in [
            serde_json::json!({}),
            serde_json::json!({"suffix": "", "best_of": 1}),
            serde_json::json!({"functions": []}),
        ] {
            assert_eq!(check(body.clone()), Ok(()), "{body}");
        }
    }

    #[test]
    fn what_would_be_silently_dropped_is_refused_by_name() {
        for (body, param) in [
            (
                serde_json::json!({"functions": [{"name": "f"}]}),
                "functions",
            ),
            (serde_json::json!({"suffix": "end"}), "suffix"),
            (serde_json::json!({"best_of": 3}), "best_of"),
        ] {
            assert_eq!(check(body.clone()), Err(Some(param.to_owned())), "{body}");
        }
    }
}
