//! Tool calls a model writes on its own (`tool_choice: "auto"`), read out of its text by the
//! parser the node serves with (`--tool-call-parser`), as vLLM's tool parsers do.
//!
//! One reader ([`CallReader`]) serves both a whole answer and a stream: a streamed answer is
//! the same text pushed in pieces, so the content and calls a client assembles from the deltas
//! equal the ones a non-streaming request gets, whatever the split (tested below).

use std::sync::Arc;

use serde::Deserialize;
use serde_json::value::RawValue;

/// A model family's way of writing tool calls in its text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolCallParser {
    /// Hermes / Qwen2.5 / Qwen3: each call is `<tool_call>{"name": ..., "arguments": {...}}
    /// </tool_call>`, after any text (vLLM's `hermes` parser).
    Hermes,
}

impl ToolCallParser {
    /// The parser a tokenizer's files call for: Hermes when its chat template or vocabulary
    /// knows `<tool_call>`, else none (`tool_choice: "auto"` is then refused by name).
    pub fn detect(tokenizer: &pd_tokenize::Tokenizer) -> Option<Self> {
        let knows = tokenizer.token_to_id(HERMES_START).is_some()
            || tokenizer
                .files()
                .values()
                .any(|text| text.contains(HERMES_START));
        knows.then_some(ToolCallParser::Hermes)
    }

    /// The name `--tool-call-parser` takes (vLLM's).
    pub fn name(self) -> &'static str {
        match self {
            ToolCallParser::Hermes => "hermes",
        }
    }
}

const HERMES_START: &str = "<tool_call>";
const HERMES_END: &str = "</tool_call>";

/// What a piece of the answer turned out to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Piece {
    /// Text for `content`.
    Content(String),
    /// One whole call to a declared tool; `arguments` is the JSON object as the model wrote it.
    Call { name: String, arguments: String },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Plain text; a call may start.
    Text,
    /// Inside `<tool_call>`, waiting for its end.
    Call,
    /// Just after a call: whitespace is dropped, anything else is text again.
    AfterCall,
}

/// Reads one answer's calls as its text arrives.
///
/// - Text outside calls is content, as written. What could be the start of a marker is held
///   until the next piece says whether it is one.
/// - A call whose body is `{"name": <a declared tool>, "arguments": <an object>}` becomes a
///   [`Piece::Call`]; anything else between the markers (broken JSON, an undeclared tool) is
///   returned as content, markers and all, so nothing the model wrote is lost.
/// - Whitespace between and after calls is dropped (the model's separators, not an answer).
/// - A call the answer ends inside (no closing marker) is a call if its body is whole, else
///   content.
#[derive(Debug, Clone)]
pub(crate) struct CallReader {
    /// The declared tools' names: a call to anything else is not a call.
    names: Arc<[String]>,
    mode: Mode,
    /// Text not yet returned.
    pending: String,
}

impl CallReader {
    pub(crate) fn new(parser: ToolCallParser, names: Arc<[String]>) -> Self {
        match parser {
            ToolCallParser::Hermes => Self {
                names,
                mode: Mode::Text,
                pending: String::new(),
            },
        }
    }

    /// Reads `text`, the answer's next piece, adding what is now known to `out`.
    pub(crate) fn push(&mut self, text: &str, out: &mut Vec<Piece>) {
        self.pending.push_str(text);
        loop {
            match self.mode {
                Mode::AfterCall => {
                    let rest = self.pending.trim_start();
                    if rest.is_empty() {
                        self.pending.clear();
                        return;
                    }
                    let dropped = self.pending.len() - rest.len();
                    self.pending.drain(..dropped);
                    self.mode = Mode::Text;
                }
                Mode::Text => {
                    if let Some(at) = self.pending.find(HERMES_START) {
                        content(out, &self.pending[..at]);
                        self.pending.drain(..at + HERMES_START.len());
                        self.mode = Mode::Call;
                    } else {
                        let upto = self.pending.len() - partial_marker(&self.pending);
                        content(out, &self.pending[..upto]);
                        self.pending.drain(..upto);
                        return;
                    }
                }
                Mode::Call => {
                    let Some(at) = self.pending.find(HERMES_END) else {
                        return;
                    };
                    let body: String = self.pending.drain(..at + HERMES_END.len()).collect();
                    let body = &body[..at];
                    match self.call(body) {
                        Some(call) => {
                            out.push(call);
                            self.mode = Mode::AfterCall;
                        }
                        None => {
                            content(out, &format!("{HERMES_START}{body}{HERMES_END}"));
                            self.mode = Mode::Text;
                        }
                    }
                }
            }
        }
    }

    /// The answer ended: returns what was held.
    pub(crate) fn finish(&mut self, out: &mut Vec<Piece>) {
        let rest = std::mem::take(&mut self.pending);
        match self.mode {
            Mode::Text => content(out, &rest),
            Mode::AfterCall => {}
            Mode::Call => match self.call(&rest) {
                Some(call) => out.push(call),
                None => content(out, &format!("{HERMES_START}{rest}")),
            },
        }
        self.mode = Mode::Text;
    }

    /// `body` as a call to a declared tool, if it is one. `arguments` may also be a string
    /// holding the object (some models write it so); it is returned as that object's text.
    fn call(&self, body: &str) -> Option<Piece> {
        #[derive(Deserialize)]
        struct Written<'a> {
            name: String,
            #[serde(borrow, alias = "parameters")]
            arguments: &'a RawValue,
        }
        let written: Written<'_> = serde_json::from_str(body.trim()).ok()?;
        if !self.names.contains(&written.name) {
            return None;
        }
        let raw = written.arguments.get();
        let arguments = if raw.starts_with('"') {
            let inner: String = serde_json::from_str(raw).ok()?;
            inner
        } else {
            raw.to_owned()
        };
        let is_object = matches!(
            serde_json::from_str::<serde_json::Value>(&arguments),
            Ok(serde_json::Value::Object(_))
        );
        is_object.then_some(Piece::Call {
            name: written.name,
            arguments,
        })
    }
}

/// Adds `text` to `out` as content, joined with content just before it.
fn content(out: &mut Vec<Piece>, text: &str) {
    if text.is_empty() {
        return;
    }
    match out.last_mut() {
        Some(Piece::Content(before)) => before.push_str(text),
        _ => out.push(Piece::Content(text.to_owned())),
    }
}

/// How many bytes at the end of `text` could begin the start marker (held until the next piece
/// says). The marker is ASCII, so the cut is on a character boundary.
fn partial_marker(text: &str) -> usize {
    (1..HERMES_START.len())
        .rev()
        .find(|&k| text.ends_with(&HERMES_START[..k]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reader() -> CallReader {
        CallReader::new(
            ToolCallParser::Hermes,
            vec!["get_weather".to_owned(), "get_time".to_owned()].into(),
        )
    }

    fn whole(text: &str) -> Vec<Piece> {
        let mut r = reader();
        let mut out = Vec::new();
        r.push(text, &mut out);
        r.finish(&mut out);
        out
    }

    fn call(name: &str, arguments: &str) -> Piece {
        Piece::Call {
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    fn text(t: &str) -> Piece {
        Piece::Content(t.into())
    }

    /// Adjacent content pieces joined, as a client appending deltas sees them.
    fn joined(pieces: Vec<Piece>) -> Vec<Piece> {
        let mut out = Vec::new();
        for p in pieces {
            match p {
                Piece::Content(t) => content(&mut out, &t),
                call => out.push(call),
            }
        }
        out
    }

    const ANSWERS: &[&str] = &[
        "Paris is the capital of France.",
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
        "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>\n",
        "<tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call> and then <tool_call>{\"name\": \"get_time\", \"arguments\": \"{\\\"tz\\\": \\\"CET\\\"}\"}</tool_call> done",
        "a < b, <tool and <tool_ca",
        "<tool_call>{\"name\": \"get_time\", \"arguments\": {\"tz\": \"é\"}}",
        "<tool_call>{\"name\": \"get_time\", \"argu",
        "déjà <tool_call>{\"name\":\"get_weather\",\"arguments\":[1]}</tool_call>",
    ];

    #[test]
    fn hermes_answers_read_as_text_and_calls() {
        assert_eq!(whole(ANSWERS[0]), vec![text(ANSWERS[0])]);
        assert_eq!(
            whole(ANSWERS[1]),
            vec![call("get_weather", r#"{"city": "Paris"}"#)]
        );
        assert_eq!(
            whole(ANSWERS[2]),
            vec![
                text("Let me check.\n"),
                call("get_weather", r#"{"city": "Paris"}"#),
                call("get_time", "{}"),
            ]
        );
        // An undeclared tool is text, markers and all; arguments given as a string are read.
        assert_eq!(
            whole(ANSWERS[3]),
            vec![
                text("<tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call> and then "),
                call("get_time", r#"{"tz": "CET"}"#),
                text("done"),
            ]
        );
        // Something like a marker that is not one stays text, to the last byte.
        assert_eq!(whole(ANSWERS[4]), vec![text(ANSWERS[4])]);
        // An answer that ends inside a call: a call if its body is whole, else text.
        assert_eq!(whole(ANSWERS[5]), vec![call("get_time", r#"{"tz": "é"}"#)]);
        assert_eq!(whole(ANSWERS[6]), vec![text(ANSWERS[6])]);
        // Arguments that are not an object are no call.
        assert_eq!(whole(ANSWERS[7]), vec![text(ANSWERS[7])]);
    }

    #[test]
    fn a_stream_split_anywhere_reads_as_the_whole_answer() {
        for answer in ANSWERS {
            let expected = whole(answer);
            let cuts: Vec<usize> = (0..=answer.len())
                .filter(|&i| answer.is_char_boundary(i))
                .collect();
            // Every single cut, and every piece one character long.
            for &cut in &cuts {
                let mut r = reader();
                let mut out = Vec::new();
                r.push(&answer[..cut], &mut out);
                r.push(&answer[cut..], &mut out);
                r.finish(&mut out);
                assert_eq!(joined(out), expected, "{answer:?} cut at {cut}");
            }
            let mut r = reader();
            let mut out = Vec::new();
            for w in cuts.windows(2) {
                r.push(&answer[w[0]..w[1]], &mut out);
            }
            r.finish(&mut out);
            assert_eq!(joined(out), expected, "{answer:?} char by char");
        }
    }

    #[test]
    fn text_is_not_held_longer_than_a_marker_could_need() {
        let mut r = reader();
        let mut out = Vec::new();
        r.push("Hello <tool", &mut out);
        assert_eq!(out, vec![text("Hello ")]);
        r.push("s>", &mut out);
        assert_eq!(out, vec![text("Hello <tools>")]);
    }
}
