//! [`OutputSpec`]: a request's constraint on its output, as the client wrote it.

use serde_json::Value;

/// What the output must match. Built by the HTTP layer from OpenAI's `response_format`
/// (`json_object`, `json_schema`), the Responses API's `text.format`, and vLLM's
/// `structured_outputs` / `guided_*` fields.
#[derive(Clone, Debug, PartialEq)]
pub enum OutputSpec {
    /// A JSON value valid under this JSON schema (llguidance's supported subset; what it does
    /// not support is refused, not ignored).
    JsonSchema(Value),
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// Text matching this regular expression as a whole (Rust `regex` syntax).
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// Text in the language of this Lark grammar (llguidance's Lark dialect).
    Grammar(String),
}

impl OutputSpec {
    /// xxh3 of the kind and its text (a schema as serialized), never 0. Equal specs give equal
    /// fingerprints; a schema written with its keys in another order may not (a decode node
    /// then computes its first token itself rather than take the prefill node's).
    pub fn fingerprint(&self) -> u64 {
        let mut bytes: Vec<u8> = Vec::new();
        match self {
            OutputSpec::JsonSchema(schema) => {
                bytes.push(b'j');
                bytes.extend_from_slice(schema.to_string().as_bytes());
            }
            OutputSpec::JsonObject => bytes.push(b'o'),
            OutputSpec::Regex(rx) => {
                bytes.push(b'r');
                bytes.extend_from_slice(rx.as_bytes());
            }
            OutputSpec::Choice(choices) => {
                bytes.push(b'c');
                for c in choices {
                    bytes.extend_from_slice(&(c.len() as u64).to_le_bytes());
                    bytes.extend_from_slice(c.as_bytes());
                }
            }
            OutputSpec::Grammar(g) => {
                bytes.push(b'g');
                bytes.extend_from_slice(g.as_bytes());
            }
        }
        xxhash_rust::xxh3::xxh3_64(&bytes).max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn fingerprints_tell_specs_apart() {
        let specs = [
            OutputSpec::JsonObject,
            OutputSpec::JsonSchema(json!({"type": "object"})),
            OutputSpec::JsonSchema(json!({"type": "integer"})),
            OutputSpec::Regex("a+".into()),
            OutputSpec::Grammar("a+".into()),
            OutputSpec::Choice(vec!["ab".into(), "c".into()]),
            OutputSpec::Choice(vec!["a".into(), "bc".into()]),
        ];
        for (i, a) in specs.iter().enumerate() {
            assert_ne!(a.fingerprint(), 0);
            assert_eq!(a.fingerprint(), a.clone().fingerprint());
            for b in &specs[i + 1..] {
                assert_ne!(a.fingerprint(), b.fingerprint(), "{a:?} vs {b:?}");
            }
        }
    }
}
