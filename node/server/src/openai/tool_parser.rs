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
    /// Llama 3.1 / 3.2 / 3.3: an answer that is calls is `{"name": ..., "parameters": {...}}`
    /// objects separated by `;`, maybe after `<|python_tag|>`, and nothing else (vLLM's
    /// `llama3_json` parser).
    Llama3Json,
    /// Mistral: calls follow `[TOOL_CALLS]`, after any text, to the end of the answer: a JSON
    /// list of `{"name": ..., "arguments": {...}}` (v0.3 tokenizers), or `name[ARGS]{...}`,
    /// each further call after another `[TOOL_CALLS]` (v11+ tokenizers) (vLLM's `mistral`).
    Mistral,
}

impl ToolCallParser {
    /// The parser a tokenizer's files call for: Hermes when its chat template or vocabulary
    /// knows `<tool_call>` (and its template does not write XML calls inside it); Mistral's
    /// when they know `[TOOL_CALLS]`; Llama 3's JSON when its chat template asks for calls in
    /// that format (Meta's templates say `"parameters": dictionary of argument name and its
    /// value`); else none (`tool_choice: "auto"` is then refused by name).
    pub fn detect(tokenizer: &pd_tokenize::Tokenizer) -> Option<Self> {
        let files = tokenizer.files();
        if tokenizer.token_to_id(HERMES_START).is_some()
            || files.values().any(|text| text.contains(HERMES_START))
        {
            // Templates that wrap XML calls (`<function=name>`: Qwen3-Coder, GLM) in the same
            // marker are another format: no parser rather than every call returned as text.
            let xml = files.values().any(|text| text.contains("<function="));
            return (!xml).then_some(ToolCallParser::Hermes);
        }
        if tokenizer.token_to_id(MISTRAL_START).is_some()
            || files.values().any(|text| text.contains(MISTRAL_START))
        {
            return Some(ToolCallParser::Mistral);
        }
        files
            .values()
            .any(|text| text.contains(LLAMA3_TEMPLATE_ASKS))
            .then_some(ToolCallParser::Llama3Json)
    }

    /// The name `--tool-call-parser` takes (vLLM's).
    pub fn name(self) -> &'static str {
        match self {
            ToolCallParser::Hermes => "hermes",
            ToolCallParser::Llama3Json => "llama3_json",
            ToolCallParser::Mistral => "mistral",
        }
    }

    /// The marker a call starts at (Hermes, Mistral).
    fn start_marker(self) -> &'static str {
        match self {
            ToolCallParser::Mistral => MISTRAL_START,
            _ => HERMES_START,
        }
    }
}

const HERMES_START: &str = "<tool_call>";
const HERMES_END: &str = "</tool_call>";
/// What Llama 3's templates write before a call (a special token: kept in the text for the
/// parser, as `skip_special_tokens` is off under `"auto"`).
const PYTHON_TAG: &str = "<|python_tag|>";
/// Mistral's marker before its calls, and (v11+ tokenizers) between a call's name and its
/// arguments (special tokens: kept in the text under `"auto"`).
const MISTRAL_START: &str = "[TOOL_CALLS]";
const MISTRAL_ARGS: &str = "[ARGS]";
/// The words of Meta's Llama 3.1/3.2/3.3 chat templates that ask for JSON calls.
const LLAMA3_TEMPLATE_ASKS: &str = "dictionary of argument name and its value";

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
    /// Llama 3: nothing but whitespace yet; the first character says text or calls.
    Undecided,
    /// Llama 3: an answer that started as calls, held whole until it ends. Mistral: after
    /// `[TOOL_CALLS]`, held until the answer ends.
    Json,
    /// Plain text; a call may start (Hermes), or the answer is text (Llama 3).
    Text,
    /// Inside `<tool_call>`, waiting for its end.
    Call,
    /// Just after a call: whitespace is dropped, anything else is text again.
    AfterCall,
}

/// Reads one answer's calls as its text arrives.
///
/// Hermes:
/// - Text outside calls is content, as written. What could be the start of a marker is held
///   until the next piece says whether it is one.
/// - A call whose body is `{"name": <a declared tool>, "arguments": <an object>}` becomes a
///   [`Piece::Call`]; anything else between the markers (broken JSON, an undeclared tool) is
///   returned as content, markers and all, so nothing the model wrote is lost.
/// - Whitespace between and after calls, and before the first call where nothing else came
///   before it, is dropped (the model's separators, not an answer).
/// - A call the answer ends inside (no closing marker) is a call if its body is whole, else
///   content.
///
/// Mistral: as Hermes up to `[TOOL_CALLS]`; what follows is held to the answer's end, then read
/// as calls (all of them to declared tools with objects of arguments), else returned as
/// content, marker and all.
///
/// Llama 3 JSON:
/// - An answer whose first non-blank text is `{` or `<|python_tag|>` is held to its end, then
///   read as `;`-separated calls; if any of them is not a call to a declared tool with an
///   object of arguments, the whole answer is content, as written.
/// - Any other answer is content, streamed as it comes.
#[derive(Debug, Clone)]
pub(crate) struct CallReader {
    parser: ToolCallParser,
    /// The declared tools' names: a call to anything else is not a call.
    names: Arc<[String]>,
    /// Whether more than one call may be read (`parallel_tool_calls`); if not, calls after
    /// the first are dropped (OpenAI's "at most one call").
    parallel: bool,
    /// Calls read so far.
    calls: usize,
    /// Hermes: content other than whitespace was returned, or a call read. Until then,
    /// leading whitespace is held: dropped if a call comes first.
    started: bool,
    /// Hermes, inside a call: bytes of `pending` already searched for the end marker.
    scanned: usize,
    mode: Mode,
    /// Text not yet returned.
    pending: String,
}

impl CallReader {
    pub(crate) fn new(parser: ToolCallParser, names: Arc<[String]>, parallel: bool) -> Self {
        Self {
            parser,
            names,
            parallel,
            calls: 0,
            started: false,
            scanned: 0,
            mode: Self::first_mode(parser),
            pending: String::new(),
        }
    }

    fn first_mode(parser: ToolCallParser) -> Mode {
        match parser {
            ToolCallParser::Hermes | ToolCallParser::Mistral => Mode::Text,
            ToolCallParser::Llama3Json => Mode::Undecided,
        }
    }

    /// Reads `text`, the answer's next piece, adding what is now known to `out`.
    pub(crate) fn push(&mut self, text: &str, out: &mut Vec<Piece>) {
        self.pending.push_str(text);
        if self.parser == ToolCallParser::Llama3Json {
            self.push_llama3(out);
            return;
        }
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
                    let marker = self.parser.start_marker();
                    if let Some(at) = self.pending.find(marker) {
                        let before = &self.pending[..at];
                        if self.started || !before.trim().is_empty() {
                            content(out, before);
                        }
                        self.started = true;
                        self.pending.drain(..at + marker.len());
                        self.mode = match self.parser {
                            ToolCallParser::Mistral => Mode::Json,
                            _ => Mode::Call,
                        };
                        self.scanned = 0;
                    } else {
                        let upto = self.pending.len() - partial_marker(&self.pending, marker);
                        let text = &self.pending[..upto];
                        if !self.started {
                            if text.trim().is_empty() {
                                return; // only whitespace yet: a call may follow
                            }
                            self.started = true;
                        }
                        content(out, text);
                        self.pending.drain(..upto);
                        return;
                    }
                }
                Mode::Undecided | Mode::Json => return,
                Mode::Call => {
                    // Only the new bytes (and a marker's length before them) are searched.
                    let mut from = self.scanned.min(self.pending.len());
                    while !self.pending.is_char_boundary(from) {
                        from -= 1;
                    }
                    let Some(at) = self.pending[from..].find(HERMES_END).map(|i| from + i) else {
                        self.scanned = self.pending.len().saturating_sub(HERMES_END.len() - 1);
                        return;
                    };
                    let body: String = self.pending.drain(..at + HERMES_END.len()).collect();
                    let body = &body[..at];
                    match self.call(body) {
                        Some(call) => {
                            self.take(call, out);
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

    /// A call read: returned, unless one was and parallel calls are off (then dropped).
    fn take(&mut self, call: Piece, out: &mut Vec<Piece>) {
        if self.parallel || self.calls == 0 {
            out.push(call);
        }
        self.calls += 1;
    }

    /// Llama 3: decides text or calls at the first non-blank character.
    fn push_llama3(&mut self, out: &mut Vec<Piece>) {
        if self.mode == Mode::Undecided {
            let rest = self.pending.trim_start();
            if rest.is_empty() || (PYTHON_TAG.starts_with(rest) && rest != PYTHON_TAG) {
                return; // blank, or maybe the tag: not known yet
            }
            self.mode = if rest.starts_with('{') || rest.starts_with(PYTHON_TAG) {
                Mode::Json
            } else {
                Mode::Text
            };
        }
        if self.mode == Mode::Text {
            content(out, &std::mem::take(&mut self.pending));
        }
    }

    /// Llama 3: `answer` (held whole) as its calls, or `None` if it is not all calls.
    fn llama3_calls(&self, answer: &str) -> Option<Vec<Piece>> {
        let mut rest = answer.trim_start();
        rest = rest.strip_prefix(PYTHON_TAG).unwrap_or(rest).trim_start();
        let mut calls = Vec::new();
        while !rest.is_empty() {
            let mut values = serde_json::Deserializer::from_str(rest).into_iter::<&RawValue>();
            let value = values.next()?.ok()?;
            calls.push(self.call(value.get())?);
            rest = rest[values.byte_offset()..].trim_start();
            if let Some(after) = rest.strip_prefix(';') {
                rest = after.trim_start();
            } else if !rest.is_empty() {
                return None;
            }
        }
        if !self.parallel {
            calls.truncate(1);
        }
        (!calls.is_empty()).then_some(calls)
    }

    /// Mistral: what followed `[TOOL_CALLS]` (held whole) as its calls, or `None` if it is not
    /// all calls.
    fn mistral_calls(&self, after: &str) -> Option<Vec<Piece>> {
        let body = after.trim();
        let mut calls = Vec::new();
        if body.starts_with('[') {
            // v0.3: one JSON list of calls.
            let items: Vec<&RawValue> = serde_json::from_str(body).ok()?;
            for item in items {
                calls.push(self.call(item.get())?);
            }
        } else {
            // v11+: `name[ARGS]{...}`, further calls each after another marker.
            for segment in body.split(MISTRAL_START) {
                let (name, arguments) = segment.split_once(MISTRAL_ARGS)?;
                let (name, arguments) = (name.trim(), arguments.trim());
                let is_object = matches!(
                    serde_json::from_str::<serde_json::Value>(arguments),
                    Ok(serde_json::Value::Object(_))
                );
                if !is_object || !self.names.iter().any(|n| n == name) {
                    return None;
                }
                calls.push(Piece::Call {
                    name: name.to_owned(),
                    arguments: arguments.to_owned(),
                });
            }
        }
        if !self.parallel {
            calls.truncate(1);
        }
        (!calls.is_empty()).then_some(calls)
    }

    /// The answer ended: returns what was held.
    pub(crate) fn finish(&mut self, out: &mut Vec<Piece>) {
        let rest = std::mem::take(&mut self.pending);
        match self.mode {
            Mode::Undecided => content(out, &rest),
            Mode::Json if self.parser == ToolCallParser::Mistral => {
                match self.mistral_calls(&rest) {
                    Some(calls) => {
                        for call in calls {
                            self.take(call, out);
                        }
                    }
                    None => content(out, &format!("{MISTRAL_START}{rest}")),
                }
            }
            Mode::Json => match self.llama3_calls(&rest) {
                Some(calls) => out.extend(calls),
                None => content(out, &rest),
            },
            Mode::Text => content(out, &rest),
            Mode::AfterCall => {}
            Mode::Call => match self.call(&rest) {
                Some(call) => self.take(call, out),
                None => content(out, &format!("{HERMES_START}{rest}")),
            },
        }
        self.mode = Self::first_mode(self.parser);
        self.scanned = 0;
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

/// How many bytes at the end of `text` could begin `marker` (held until the next piece says).
/// The markers are ASCII, so the cut is on a character boundary.
fn partial_marker(text: &str, marker: &str) -> usize {
    (1..marker.len())
        .rev()
        .find(|&k| text.ends_with(&marker[..k]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reader of `parser`'s calls to `get_weather` and `get_time`.
    fn reader_of(parser: ToolCallParser) -> CallReader {
        CallReader::new(
            parser,
            vec!["get_weather".to_owned(), "get_time".to_owned()].into(),
            true,
        )
    }

    /// `text` read whole by `parser`.
    fn read(parser: ToolCallParser, text: &str) -> Vec<Piece> {
        let mut r = reader_of(parser);
        let mut out = Vec::new();
        r.push(text, &mut out);
        r.finish(&mut out);
        out
    }

    fn whole(text: &str) -> Vec<Piece> {
        read(ToolCallParser::Hermes, text)
    }

    fn llama3(text: &str) -> Vec<Piece> {
        read(ToolCallParser::Llama3Json, text)
    }

    /// Each answer pushed in two pieces, cut anywhere, and one character at a time, reads as
    /// it does whole.
    fn reads_the_same_split_anywhere(parser: ToolCallParser, answers: &[&str]) {
        for answer in answers {
            let expected = read(parser, answer);
            let cuts: Vec<usize> = (0..=answer.len())
                .filter(|&i| answer.is_char_boundary(i))
                .collect();
            for &cut in &cuts {
                let mut r = reader_of(parser);
                let mut out = Vec::new();
                r.push(&answer[..cut], &mut out);
                r.push(&answer[cut..], &mut out);
                r.finish(&mut out);
                assert_eq!(joined(out), expected, "{answer:?} cut at {cut}");
            }
            let mut r = reader_of(parser);
            let mut out = Vec::new();
            for w in cuts.windows(2) {
                r.push(&answer[w[0]..w[1]], &mut out);
            }
            r.finish(&mut out);
            assert_eq!(joined(out), expected, "{answer:?} char by char");
        }
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
        "\n\n<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>",
        "\n\n Hello <tool",
        " \n ",
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
        // Whitespace before a first call is dropped; before text, or alone, it is kept.
        assert_eq!(whole(ANSWERS[8]), vec![call("get_time", "{}")]);
        assert_eq!(whole(ANSWERS[9]), vec![text(ANSWERS[9])]);
        assert_eq!(whole(ANSWERS[10]), vec![text(ANSWERS[10])]);
    }

    #[test]
    fn a_stream_split_anywhere_reads_as_the_whole_answer() {
        reads_the_same_split_anywhere(ToolCallParser::Hermes, ANSWERS);
        reads_the_same_split_anywhere(ToolCallParser::Llama3Json, LLAMA3_ANSWERS);
    }

    const LLAMA3_ANSWERS: &[&str] = &[
        "The capital of France is Paris.",
        "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}",
        "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}; {\"name\": \"get_time\", \"arguments\": {}}",
        "\n {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Par",
        "{\"name\": \"rm\", \"parameters\": {}}",
        "{\"name\": \"get_time\", \"parameters\": {}} and more",
        "  <|python",
        "<|pyth or not",
    ];

    fn mistral(text: &str) -> Vec<Piece> {
        read(ToolCallParser::Mistral, text)
    }

    const MISTRAL_ANSWERS: &[&str] = &[
        "Paris is the capital of France.",
        "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]",
        "Checking.[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"get_time\", \"arguments\": {}}]",
        "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]get_time[ARGS]{}",
        // Not calls: undeclared, cut, followed by text, arguments not an object.
        "[TOOL_CALLS][{\"name\": \"rm\", \"arguments\": {}}]",
        "[TOOL_CALLS][{\"name\": \"get_time\", \"argu",
        "[TOOL_CALLS][{\"name\": \"get_time\", \"arguments\": {}}] and more",
        "[TOOL_CALLS]get_time[ARGS][1]",
        "a [TOOL and [TOOL_CA",
    ];

    #[test]
    fn mistral_answers_read_as_text_then_calls() {
        let paris = call("get_weather", r#"{"city": "Paris"}"#);
        assert_eq!(mistral(MISTRAL_ANSWERS[0]), vec![text(MISTRAL_ANSWERS[0])]);
        assert_eq!(mistral(MISTRAL_ANSWERS[1]), vec![paris.clone()]);
        assert_eq!(
            mistral(MISTRAL_ANSWERS[2]),
            vec![text("Checking."), paris.clone(), call("get_time", "{}")]
        );
        assert_eq!(
            mistral(MISTRAL_ANSWERS[3]),
            vec![paris.clone(), call("get_time", "{}")]
        );
        for answer in &MISTRAL_ANSWERS[4..] {
            assert_eq!(mistral(answer), vec![text(answer)], "{answer:?}");
        }
        reads_the_same_split_anywhere(ToolCallParser::Mistral, MISTRAL_ANSWERS);
        // Text before the marker streams; what follows it is held to the end.
        let mut r = reader_of(ToolCallParser::Mistral);
        let mut out = Vec::new();
        r.push("Checking.[TOOL_CALLS][{", &mut out);
        assert_eq!(out, vec![text("Checking.")]);
        // One call where parallel calls are off.
        let names: Arc<[String]> = vec!["get_weather".to_owned(), "get_time".to_owned()].into();
        let mut r = CallReader::new(ToolCallParser::Mistral, names, false);
        let mut out = Vec::new();
        r.push(MISTRAL_ANSWERS[3], &mut out);
        r.finish(&mut out);
        assert_eq!(out, vec![paris]);
    }

    #[test]
    fn llama3_answers_are_all_calls_or_all_text() {
        assert_eq!(llama3(LLAMA3_ANSWERS[0]), vec![text(LLAMA3_ANSWERS[0])]);
        assert_eq!(
            llama3(LLAMA3_ANSWERS[1]),
            vec![call("get_weather", r#"{"city": "Paris"}"#)]
        );
        assert_eq!(
            llama3(LLAMA3_ANSWERS[2]),
            vec![
                call("get_weather", r#"{"city": "Paris"}"#),
                call("get_time", "{}")
            ]
        );
        // Cut, undeclared, or followed by text: the answer as written.
        for answer in &LLAMA3_ANSWERS[3..] {
            assert_eq!(llama3(answer), vec![text(answer)], "{answer:?}");
        }
        // Text streams at once; a call is held.
        let mut r = CallReader::new(
            ToolCallParser::Llama3Json,
            vec!["get_time".to_owned()].into(),
            true,
        );
        let mut out = Vec::new();
        r.push(" Sure", &mut out);
        assert_eq!(out, vec![text(" Sure")]);
        let mut r = CallReader::new(
            ToolCallParser::Llama3Json,
            vec!["get_time".to_owned()].into(),
            true,
        );
        let mut out = Vec::new();
        r.push(" {\"name\"", &mut out);
        assert!(out.is_empty());
    }

    /// Seeded random answers built from the pieces that matter (markers, whole and broken
    /// calls, undeclared tools, whitespace, text, partial markers, multi-byte characters), each
    /// pushed in random pieces with or without parallel calls: the same as read whole, for
    /// every parser.
    #[test]
    fn random_answers_read_the_same_in_random_pieces() {
        use rand::{Rng, SeedableRng};
        const PIECES: &[&str] = &[
            "<tool_call>",
            "</tool_call>",
            "{\"name\": \"get_time\", \"arguments\": {}}",
            "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}",
            "{\"name\": \"rm\", \"arguments\": {}}",
            "{\"name\": \"get_time\", \"argu",
            "; ",
            "<|python_tag|>",
            "[TOOL_CALLS]",
            "[ARGS]",
            "get_time",
            "[",
            "]",
            "[TOOL_",
            "<tool",
            "<|pyth",
            "\n",
            "  ",
            "Hello",
            "é€",
            "<",
            "}",
        ];
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for _ in 0..3000 {
            let answer: String = (0..rng.random_range(0..8))
                .map(|_| PIECES[rng.random_range(0..PIECES.len())])
                .collect();
            for parser in [
                ToolCallParser::Hermes,
                ToolCallParser::Llama3Json,
                ToolCallParser::Mistral,
            ] {
                for parallel in [true, false] {
                    let names: Arc<[String]> =
                        vec!["get_weather".to_owned(), "get_time".to_owned()].into();
                    let mut whole = CallReader::new(parser, names.clone(), parallel);
                    let mut expected = Vec::new();
                    whole.push(&answer, &mut expected);
                    whole.finish(&mut expected);
                    let mut r = CallReader::new(parser, names, parallel);
                    let mut out = Vec::new();
                    let mut at = 0;
                    while at < answer.len() {
                        let mut next = (at + rng.random_range(1..6)).min(answer.len());
                        while !answer.is_char_boundary(next) {
                            next += 1;
                        }
                        r.push(&answer[at..next], &mut out);
                        at = next;
                    }
                    r.finish(&mut out);
                    assert_eq!(
                        joined(out),
                        joined(expected),
                        "{parser:?} parallel={parallel}: {answer:?}"
                    );
                }
            }
        }
    }

    /// The parser a model's files call for: its chat template's words, or its vocabulary.
    #[test]
    fn the_parser_is_detected_from_the_tokenizers_files() {
        let dir = std::env::temp_dir().join(format!("pd-tool-detect-{}", std::process::id()));
        let with_template = |template: &str| {
            std::fs::create_dir_all(&dir).unwrap();
            pd_tokenize::write_byte_level_tokenizer(&dir, 300).unwrap();
            let config = dir.join("tokenizer_config.json");
            let mut json: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
            json["chat_template"] = serde_json::json!(template);
            std::fs::write(&config, json.to_string()).unwrap();
            ToolCallParser::detect(&pd_tokenize::Tokenizer::from_dir(&dir).unwrap())
        };
        assert_eq!(with_template("{{ messages }}"), None);
        assert_eq!(
            with_template("{% for t in tools %}<tools>{{ t }}</tools>{% endfor %} <tool_call>"),
            Some(ToolCallParser::Hermes)
        );
        assert_eq!(
            with_template("<tool_call>\n<function=get_weather>\n</function>\n</tool_call>"),
            None
        );
        assert_eq!(
            with_template(
                "Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}."
            ),
            Some(ToolCallParser::Llama3Json)
        );
        assert_eq!(
            with_template(
                "{% if tools %}[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]"
            ),
            Some(ToolCallParser::Mistral)
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// `parallel_tool_calls: false`: one call at most; the calls after it are dropped.
    #[test]
    fn one_call_only_where_parallel_calls_are_off() {
        let names: Arc<[String]> = vec!["get_weather".to_owned(), "get_time".to_owned()].into();
        let mut r = CallReader::new(ToolCallParser::Hermes, names.clone(), false);
        let mut out = Vec::new();
        r.push(ANSWERS[2], &mut out);
        r.finish(&mut out);
        assert_eq!(
            out,
            vec![
                text("Let me check.\n"),
                call("get_weather", r#"{"city": "Paris"}"#),
            ]
        );
        let mut r = CallReader::new(ToolCallParser::Llama3Json, names, false);
        let mut out = Vec::new();
        r.push(LLAMA3_ANSWERS[2], &mut out);
        r.finish(&mut out);
        assert_eq!(out, vec![call("get_weather", r#"{"city": "Paris"}"#)]);
    }

    #[test]
    fn text_is_not_held_longer_than_a_marker_could_need() {
        let mut r = reader_of(ToolCallParser::Hermes);
        let mut out = Vec::new();
        r.push("Hello <tool", &mut out);
        assert_eq!(out, vec![text("Hello ")]);
        r.push("s>", &mut out);
        assert_eq!(out, vec![text("Hello <tools>")]);
    }
}
