//! Chat template rendering with minijinja, configured like `transformers`' jinja2 sandbox.
//!
//! `transformers` renders with `ImmutableSandboxedEnvironment(trim_blocks=True,
//! lstrip_blocks=True, extensions=[AssistantTracker, loopcontrols])`, adds the globals
//! `raise_exception` and `strftime_now`, and overrides `tojson` with `json.dumps(...,
//! ensure_ascii=False)`. This module mirrors each of those: Python string and dict methods come
//! from `minijinja_contrib::pycompat`, `{% generation %}` blocks are rewritten to plain
//! blocks, and `tojson` prints the way Python's `json.dumps` does.

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, ErrorKind};

use crate::error::TokenizeError;
use crate::tokenizer::ChatMessage;

/// Name under which the template is registered in its environment.
const TEMPLATE_NAME: &str = "chat";

/// Deepest nesting `tojson` follows before giving up.
const MAX_JSON_DEPTH: usize = 128;

/// The special tokens `transformers` passes to templates (its `special_tokens_map`).
#[derive(Debug, Clone, Default)]
pub(crate) struct SpecialTokens {
    pub(crate) bos: Option<String>,
    pub(crate) eos: Option<String>,
    pub(crate) unk: Option<String>,
    pub(crate) pad: Option<String>,
}

/// A compiled chat template and the values it is rendered with.
#[derive(Debug)]
pub(crate) struct ChatTemplate {
    env: Environment<'static>,
    special: SpecialTokens,
    /// The template as the model directory has it.
    source: String,
}

/// Marker attached to the error `raise_exception` returns, so that rendering can tell a
/// template's deliberate rejection from a template bug.
#[derive(Debug)]
struct RaisedException(String);

impl fmt::Display for RaisedException {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedException {}

/// Instructions one render of a chat template may run (about a second at most): real templates
/// spend a few hundred per message, so a conversation of thousands of messages fits.
const TEMPLATE_FUEL: u64 = 20_000_000;

impl ChatTemplate {
    /// Compiles `source` (read from `path`, named in errors).
    pub(crate) fn new(
        source: &str,
        special: SpecialTokens,
        path: &Path,
    ) -> Result<Self, TokenizeError> {
        let mut env = Environment::new();
        // A template comes from a model's files (or a node's registration, on the gateway):
        // each render gets at most this many instructions, then fails.
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, rewrite_generation_tags(source))
            .map_err(|source| TokenizeError::TemplateSyntax {
                path: path.to_path_buf(),
                source,
            })?;
        Ok(Self {
            env,
            special,
            source: source.to_owned(),
        })
    }

    /// The template's source, as read.
    pub(crate) fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages`; see [`crate::Tokenizer::apply_chat_template`].
    pub(crate) fn render(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, TokenizeError> {
        let mut ctx: BTreeMap<&str, Value> = BTreeMap::new();
        ctx.insert("messages", Value::from_serialize(messages));
        ctx.insert("add_generation_prompt", Value::from(add_generation_prompt));
        // transformers passes these explicitly as None when not given, so `tools is none`
        // holds.
        ctx.insert(
            "tools",
            tools.map_or(Value::from(()), Value::from_serialize),
        );
        ctx.insert("documents", Value::from(()));
        // Like transformers' special_tokens_map: only tokens that are set are defined.
        let special = [
            ("bos_token", &self.special.bos),
            ("eos_token", &self.special.eos),
            ("unk_token", &self.special.unk),
            ("pad_token", &self.special.pad),
        ];
        for (name, token) in special {
            if let Some(token) = token {
                ctx.insert(name, Value::from(token.as_str()));
            }
        }
        self.env
            .get_template(TEMPLATE_NAME)
            .and_then(|t| t.render(ctx))
            .map_err(|err| {
                let raised = std::error::Error::source(&err)
                    .and_then(|s| s.downcast_ref::<RaisedException>());
                match raised {
                    Some(RaisedException(message)) => TokenizeError::TemplateException {
                        message: message.clone(),
                    },
                    None => TokenizeError::TemplateRender { source: err },
                }
            })
    }
}

/// `raise_exception(message)`: fails rendering with `message`.
fn raise_exception(message: Value) -> Result<Value, minijinja::Error> {
    let message = match message.as_str() {
        Some(s) => s.to_owned(),
        None => message.to_string(),
    };
    Err(
        minijinja::Error::new(ErrorKind::InvalidOperation, message.clone())
            .with_source(RaisedException(message)),
    )
}

/// `strftime_now(format)`: the current UTC time formatted like Python's `strftime`.
fn strftime_now(format: &str) -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    strftime(format, secs)
}

/// Formats `unix_secs` (UTC) with the common `strftime` directives, including glibc's `%-d`
/// style unpadded forms. Unknown directives are copied through, as glibc does.
fn strftime(format: &str, unix_secs: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
    ];
    let days = unix_secs / 86_400;
    let secs_of_day = unix_secs % 86_400;
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs_of_day / 3600, secs_of_day / 60 % 60, secs_of_day % 60);
    let weekday = ((days + 4) % 7) as usize; // 1970-01-01 was a Thursday.
    let yday = days - days_from_civil(year, 1, 1) + 1;
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };
    let month_name = MONTHS.get(month as usize - 1).copied().unwrap_or("");
    let day_name = DAYS.get(weekday).copied().unwrap_or("");

    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut spec = chars.next();
        let unpadded = spec == Some('-');
        if unpadded {
            spec = chars.next();
        }
        let num = |out: &mut String, v: u64, width: usize| {
            // Writing to a String cannot fail.
            let _ = if unpadded {
                write!(out, "{v}")
            } else {
                write!(out, "{v:0width$}")
            };
        };
        match spec {
            Some('Y') => num(&mut out, year, 4),
            Some('y') => num(&mut out, year % 100, 2),
            Some('m') => num(&mut out, month, 2),
            Some('d') => num(&mut out, day, 2),
            Some('e') => {
                let _ = write!(out, "{day:>2}");
            }
            Some('H') => num(&mut out, hour, 2),
            Some('I') => num(&mut out, hour12, 2),
            Some('M') => num(&mut out, minute, 2),
            Some('S') => num(&mut out, second, 2),
            Some('j') => num(&mut out, yday, 3),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(month_name),
            Some('b' | 'h') => out.push_str(month_name.get(..3).unwrap_or("")),
            Some('A') => out.push_str(day_name),
            Some('a') => out.push_str(day_name.get(..3).unwrap_or("")),
            Some('Z') => out.push_str("UTC"),
            Some('z') => out.push_str("+0000"),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if unpadded {
                    out.push('-');
                }
                out.push(other);
            }
            None => {
                out.push('%');
                if unpadded {
                    out.push('-');
                }
            }
        }
    }
    out
}

/// (year, month 1..=12, day 1..=31) of a day count since 1970-01-01 (H. Hinnant's algorithm).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

/// Days since 1970-01-01 of a date on or after it (inverse of [`civil_from_days`]).
fn days_from_civil(year: u64, month: u64, day: u64) -> u64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y / 400;
    let yoe = y - era * 400;
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    (era * 146_097 + doe).saturating_sub(719_468)
}

/// Rewrites `{% generation %}` / `{% endgeneration %}` (transformers' `AssistantTracker`
/// extension, which only marks assistant spans) into `{% if true %}` / `{% endif %}`, keeping
/// whitespace-control markers.
fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        // The closing "%}" is searched after the opening "{%", so "{%}" is not a tag.
        let Some(len) = rest.get(start + 2..).and_then(|r| r.find("%}")) else {
            break;
        };
        let end = start + 2 + len + 2;
        let tag = &rest[start..end];
        let inner = &tag[2..tag.len() - 2];
        let (lead, inner) = split_marker_start(inner);
        let (inner, trail) = split_marker_end(inner);
        let replacement = match inner.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        out.push_str(&rest[..start]);
        match replacement {
            Some(word) => {
                let _ = write!(out, "{{%{lead} {word} {trail}%}}");
            }
            None => out.push_str(tag),
        }
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

fn split_marker_start(s: &str) -> (&str, &str) {
    match s.as_bytes().first() {
        Some(b'-' | b'+') => s.split_at(1),
        _ => ("", s),
    }
}

fn split_marker_end(s: &str) -> (&str, &str) {
    match s.as_bytes().last() {
        Some(b'-' | b'+') => s.split_at(s.len() - 1),
        _ => (s, ""),
    }
}

/// `tojson` as transformers defines it: `json.dumps(value, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)`.
fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let indent = match indent {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(usize::try_from(v)?),
    };
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let separators = kwargs.get::<Option<Vec<String>>>("separators")?;
    kwargs.assert_all_used()?;
    let (item_sep, key_sep) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson separators must be a pair of strings",
            ));
        }
        // Python: (', ', ': ') without indent, (',', ': ') with it.
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let mut json = PyJson {
        out: String::new(),
        indent,
        item_sep,
        key_sep,
        ensure_ascii,
        sort_keys,
    };
    json.value(value, 0)?;
    Ok(Value::from_safe_string(json.out))
}

/// A writer producing Python `json.dumps` output.
struct PyJson {
    out: String,
    indent: Option<usize>,
    item_sep: String,
    key_sep: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

impl PyJson {
    fn value(&mut self, value: &Value, depth: usize) -> Result<(), minijinja::Error> {
        if depth > MAX_JSON_DEPTH {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: value nested too deeply",
            ));
        }
        match value.kind() {
            ValueKind::Undefined | ValueKind::None => self.out.push_str("null"),
            ValueKind::Bool => self
                .out
                .push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => self.number(value),
            ValueKind::String => {
                let s = value.as_str().unwrap_or_default();
                self.string(s);
            }
            ValueKind::Map => {
                let mut entries = Vec::new();
                for key in value.try_iter()? {
                    let item = value.get_item(&key)?;
                    let key = match key.as_str() {
                        Some(s) => s.to_owned(),
                        None => key.to_string(),
                    };
                    entries.push((key, item));
                }
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(&b.0));
                }
                self.container('{', '}', entries.len(), depth, |json, i, depth| {
                    let (key, item) = &entries[i];
                    json.string(key);
                    let sep = json.key_sep.clone();
                    json.out.push_str(&sep);
                    json.value(item, depth)
                })?;
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                self.container('[', ']', items.len(), depth, |json, i, depth| {
                    json.value(&items[i], depth)
                })?;
            }
            // Bytes, plain objects and the like: their string form, as a JSON string.
            _ => {
                let s = value.to_string();
                self.string(&s);
            }
        }
        Ok(())
    }

    fn container(
        &mut self,
        open: char,
        close: char,
        len: usize,
        depth: usize,
        mut item: impl FnMut(&mut Self, usize, usize) -> Result<(), minijinja::Error>,
    ) -> Result<(), minijinja::Error> {
        self.out.push(open);
        if len == 0 {
            self.out.push(close);
            return Ok(());
        }
        for i in 0..len {
            if i > 0 {
                let sep = self.item_sep.clone();
                self.out.push_str(&sep);
            }
            self.newline(depth + 1);
            item(self, i, depth + 1)?;
        }
        self.newline(depth);
        self.out.push(close);
        Ok(())
    }

    fn newline(&mut self, depth: usize) {
        if let Some(indent) = self.indent {
            self.out.push('\n');
            self.out.extend(std::iter::repeat_n(' ', indent * depth));
        }
    }

    fn number(&mut self, value: &Value) {
        if let Ok(i) = i128::try_from(value.clone()) {
            let _ = write!(self.out, "{i}");
            return;
        }
        match f64::try_from(value.clone()) {
            Ok(f) if f.is_nan() => self.out.push_str("NaN"),
            Ok(f) if f.is_infinite() => {
                self.out
                    .push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
            }
            // minijinja prints floats as Python does (`1.0`, `0.5`).
            _ => {
                let _ = write!(self.out, "{value}");
            }
        }
    }

    fn string(&mut self, s: &str) {
        self.out.push('"');
        for c in s.chars() {
            match c {
                '"' => self.out.push_str("\\\""),
                '\\' => self.out.push_str("\\\\"),
                '\n' => self.out.push_str("\\n"),
                '\r' => self.out.push_str("\\r"),
                '\t' => self.out.push_str("\\t"),
                '\u{08}' => self.out.push_str("\\b"),
                '\u{0c}' => self.out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && !c.is_ascii()) => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        let _ = write!(self.out, "\\u{unit:04x}");
                    }
                }
                c => self.out.push(c),
            }
        }
        self.out.push('"');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, messages: &[ChatMessage]) -> Result<String, TokenizeError> {
        let special = SpecialTokens {
            bos: Some("<s>".into()),
            eos: Some("</s>".into()),
            ..SpecialTokens::default()
        };
        ChatTemplate::new(source, special, Path::new("t.jinja"))?.render(messages, None, true)
    }

    /// A template that loops without end in practice (10⁸ iterations) runs out of fuel and
    /// fails fast instead of holding the caller (the gateway renders templates nodes sent).
    #[test]
    fn a_template_that_runs_too_long_runs_out_of_fuel() {
        let hostile =
            "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}x";
        let started = std::time::Instant::now();
        let e = render(hostile, &[]).expect_err("out of fuel");
        let TokenizeError::TemplateRender { source } = &e else {
            panic!("{e:?}")
        };
        assert_eq!(source.kind(), minijinja::ErrorKind::OutOfFuel, "{source}");
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
    }

    #[test]
    fn strftime_known_dates() {
        // 2024-02-29T13:05:09Z, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S", t), "2024-02-29 13:05:09");
        assert_eq!(strftime("%d %b %Y", t), "29 Feb 2024");
        assert_eq!(
            strftime("%A %B %-d, %I%p %j %%", t),
            "Thursday February 29, 01PM 060 %"
        );
        assert_eq!(strftime("%d %b %Y", 0), "01 Jan 1970");
        assert_eq!(strftime("%-m/%-d %Q %", 0), "1/1 %Q %");
    }

    #[test]
    fn generation_tags_are_rewritten() {
        assert_eq!(
            rewrite_generation_tags("a{%- generation -%}b{% endgeneration %}c{% if x %}"),
            "a{%- if true -%}b{% endif %}c{% if x %}"
        );
        assert_eq!(rewrite_generation_tags("{%}{%"), "{%}{%");
        assert_eq!(rewrite_generation_tags("{%%}x"), "{%%}x");
        let out = render(
            "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
            &[ChatMessage::new("assistant", "hi")],
        );
        assert_eq!(out.ok().as_deref(), Some("hi"));
    }

    #[test]
    fn tojson_matches_python() {
        let msgs = [ChatMessage::new("user", "é \"q\" <b>\n")];
        let out = render("{{ messages | tojson }}", &msgs);
        assert_eq!(
            out.ok().as_deref(),
            Some(r#"[{"role": "user", "content": "é \"q\" <b>\n"}]"#)
        );
        let out = render(
            "{{ messages[0] | tojson(indent=2) }}|{{ [] | tojson }}",
            &msgs,
        );
        assert_eq!(
            out.ok().as_deref(),
            Some("{\n  \"role\": \"user\",\n  \"content\": \"é \\\"q\\\" <b>\\n\"\n}|[]")
        );
        let out = render(
            "{{ {'b': 1, 'a': [1.5, none, true]} | tojson(sort_keys=true, ensure_ascii=true) }}{{ 'é' | tojson(ensure_ascii=true) }}",
            &msgs,
        );
        assert_eq!(
            out.ok().as_deref(),
            Some(r#"{"a": [1.5, null, true], "b": 1}"\u00e9""#)
        );
    }

    #[test]
    fn python_methods_and_loop_controls() {
        let msgs = [
            ChatMessage::new("system", "  sys  "),
            ChatMessage::new("user", "hello"),
        ];
        let out = render(
            "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}{{ m.content.upper() }}{% break %}{% endfor %}|{{ messages[0].content.strip() }}|{{ messages[1]['content'].startswith('he') }}|{{ tools is none }}|{{ bos_token }}{{ unk_token is defined }}",
            &msgs,
        );
        assert_eq!(out.ok().as_deref(), Some("HELLO|sys|True|True|<s>False"));
    }

    #[test]
    fn raise_exception_is_typed() {
        let out = render(
            "{% if messages[0].role != 'system' %}{{ raise_exception('roles must alternate') }}{% endif %}",
            &[ChatMessage::new("user", "x")],
        );
        match out {
            Err(TokenizeError::TemplateException { message }) => {
                assert_eq!(message, "roles must alternate");
            }
            other => panic!("expected TemplateException, got {other:?}"),
        }
    }

    #[test]
    fn render_errors_are_typed() {
        let out = render(
            "{{ messages[0].content + 1 }}",
            &[ChatMessage::new("u", "x")],
        );
        assert!(
            matches!(out, Err(TokenizeError::TemplateRender { .. })),
            "{out:?}"
        );
        let err = ChatTemplate::new("{% if %}", SpecialTokens::default(), Path::new("t.jinja"));
        assert!(matches!(err, Err(TokenizeError::TemplateSyntax { .. })));
    }

    #[test]
    fn strftime_now_renders() {
        let out = render("{{ strftime_now('%Y') }}", &[]);
        let year = out.ok().and_then(|y| y.parse::<u32>().ok());
        assert!(year.is_some_and(|y| y >= 2024), "{year:?}");
    }
}
