//! Server-sent events (`text/event-stream`), framed and parsed as the HTML standard says: lines
//! end with `\r\n`, `\n` or `\r`; a blank line ends an event; `data` lines of one event join
//! with `\n`; a line starting with `:` is a comment; `field` without a colon has an empty
//! value; one space after the colon is not part of the value.
//!
//! [`Framer`] cuts a byte stream, fed in chunks of any size, into whole events, each with its
//! bytes as they came (a proxy passes untouched events on as the node wrote them);
//! [`Event::parse`] reads one; [`write_event`] writes one.

/// An event's bytes as they came, its blank line included.
pub type RawEvent = Vec<u8>;

/// Cuts a stream into whole events.
#[derive(Debug, Default)]
pub struct Framer {
    buf: Vec<u8>,
    /// Where scanning resumes (bytes before it hold no event end).
    scanned: usize,
    /// Where the line being scanned starts.
    line_start: usize,
}

impl Framer {
    /// An empty framer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a chunk of the stream.
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// Whether no bytes wait (nothing pushed since the last whole event).
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// The next whole event, if the bytes so far hold one.
    pub fn next_event(&mut self) -> Option<RawEvent> {
        let end = self.event_end()?;
        let rest = self.buf.split_off(end);
        self.scanned = 0;
        self.line_start = 0;
        Some(std::mem::replace(&mut self.buf, rest))
    }

    /// The end of the stream: what is left (an event without its blank line), as it came.
    pub fn finish(&mut self) -> Vec<u8> {
        self.scanned = 0;
        self.line_start = 0;
        std::mem::take(&mut self.buf)
    }

    /// Just past the blank line that ends the first event, scanning from where the last call
    /// stopped. A `\r` last in the buffer waits for the next byte (it may be half of `\r\n`).
    fn event_end(&mut self) -> Option<usize> {
        let buf = &self.buf;
        let mut i = self.scanned;
        while i < buf.len() {
            let b = buf[i];
            if b != b'\n' && b != b'\r' {
                i += 1;
                continue;
            }
            let end = if b == b'\r' {
                match buf.get(i + 1) {
                    None => break,
                    Some(b'\n') => i + 2,
                    Some(_) => i + 1,
                }
            } else {
                i + 1
            };
            if i == self.line_start {
                // A blank line: the event ends after it.
                return Some(end);
            }
            self.line_start = end;
            i = end;
        }
        self.scanned = i;
        None
    }
}

/// One event, read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Event {
    /// `event:` (absent: the default type, `message`).
    pub event: Option<String>,
    /// The `data:` lines joined with `\n`; `None` when there was none (a comment or keep-alive).
    pub data: Option<String>,
    /// `id:`, when given.
    pub id: Option<String>,
}

impl Event {
    /// Reads one event's bytes (invalid UTF-8 is replaced, as browsers do).
    pub fn parse(raw: &[u8]) -> Self {
        let text = String::from_utf8_lossy(raw);
        let mut ev = Event::default();
        let mut data: Option<String> = None;
        for line in lines(&text) {
            if line.is_empty() || line.starts_with(':') {
                continue;
            }
            let (field, value) = match line.split_once(':') {
                Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
                None => (line, ""),
            };
            match field {
                "event" => ev.event = Some(value.to_owned()),
                "data" => match &mut data {
                    Some(d) => {
                        d.push('\n');
                        d.push_str(value);
                    }
                    None => data = Some(value.to_owned()),
                },
                "id" if !value.contains('\0') => ev.id = Some(value.to_owned()),
                _ => {}
            }
        }
        ev.data = data;
        ev
    }

    /// The data parsed as JSON, when it is JSON.
    pub fn json(&self) -> Option<serde_json::Value> {
        serde_json::from_str(self.data.as_deref()?).ok()
    }

    /// `data: [DONE]`, the end of an OpenAI chat or completions stream.
    pub fn is_done(&self) -> bool {
        self.data.as_deref() == Some("[DONE]")
    }

    /// This event written back ([`write_event`]).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        if let Some(id) = &self.id {
            out.extend_from_slice(b"id: ");
            out.extend_from_slice(id.as_bytes());
            out.push(b'\n');
        }
        write_event(
            &mut out,
            self.event.as_deref(),
            self.data.as_deref().unwrap_or(""),
        );
        out
    }
}

/// The lines of an event's text, split at `\r\n`, `\n` or `\r`.
fn lines(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let at = rest.find(['\r', '\n']).unwrap_or(rest.len());
        let line = &rest[..at];
        let skip = if rest[at..].starts_with("\r\n") {
            2
        } else {
            usize::from(at < rest.len())
        };
        rest = &rest[at + skip..];
        Some(line)
    })
}

/// Appends one event: `event: <name>` when named, one `data:` line per line of `data`, and the
/// blank line.
pub fn write_event(out: &mut Vec<u8>, event: Option<&str>, data: &str) {
    if let Some(name) = event {
        out.extend_from_slice(b"event: ");
        out.extend_from_slice(name.as_bytes());
        out.push(b'\n');
    }
    for line in lines(data) {
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(line.as_bytes());
        out.push(b'\n');
    }
    if data.is_empty() {
        out.extend_from_slice(b"data: \n");
    }
    out.push(b'\n');
}

/// Appends `data: <json>` and the blank line (serialized JSON holds no raw newline).
pub fn write_json(out: &mut Vec<u8>, event: Option<&str>, value: &impl serde::Serialize) {
    let text = serde_json::to_string(value).unwrap_or_else(|_| "{}".into());
    write_event(out, event, &text);
}

/// `data: [DONE]` and its blank line.
pub const DONE: &[u8] = b"data: [DONE]\n\n";

/// Whether streamed `bytes` hold the line of an OpenAI answer's last event: chat and
/// completions' `data: [DONE]`, or `event: response.completed` / `.incomplete` / `.failed`.
/// Whole lines only (text inside an event's JSON has its line breaks escaped); a line cut
/// between two chunks is not seen.
pub fn ends_answer(bytes: &[u8]) -> bool {
    bytes.split(|&b| b == b'\n' || b == b'\r').any(|line| {
        let Some((field, value)) = line.split_once_byte(b':') else {
            return false;
        };
        let value = value.strip_prefix(b" ").unwrap_or(value);
        match field {
            b"data" => value == b"[DONE]",
            b"event" => matches!(
                value,
                b"response.completed" | b"response.incomplete" | b"response.failed"
            ),
            _ => false,
        }
    })
}

/// `split_once` for byte slices.
trait SplitOnceByte {
    fn split_once_byte(&self, b: u8) -> Option<(&[u8], &[u8])>;
}

impl SplitOnceByte for [u8] {
    fn split_once_byte(&self, b: u8) -> Option<(&[u8], &[u8])> {
        let at = self.iter().position(|&x| x == b)?;
        Some((&self[..at], &self[at + 1..]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame_all(chunks: &[&[u8]]) -> (Vec<Event>, Vec<u8>) {
        let mut f = Framer::new();
        let mut out = Vec::new();
        for c in chunks {
            f.push(c);
            while let Some(e) = f.next_event() {
                out.push(Event::parse(&e));
            }
        }
        (out, f.finish())
    }

    #[test]
    fn every_line_ending_and_any_chunking_frame_the_same_events() {
        let text =
            "event: a\r\ndata: 1\r\ndata:2\r\n\r\n: keep-alive\n\ndata: x\r\rid: 9\ndata\n\n";
        let want = vec![
            Event {
                event: Some("a".into()),
                data: Some("1\n2".into()),
                id: None,
            },
            Event::default(),
            Event {
                data: Some("x".into()),
                ..Event::default()
            },
            Event {
                data: Some(String::new()),
                id: Some("9".into()),
                ..Event::default()
            },
        ];
        let bytes = text.as_bytes();
        assert_eq!(frame_all(&[bytes]), (want.clone(), Vec::new()));
        // Every split point, including between \r and \n.
        for at in 0..bytes.len() {
            let (a, b) = bytes.split_at(at);
            assert_eq!(
                frame_all(&[a, b]),
                (want.clone(), Vec::new()),
                "split at {at}"
            );
        }
        // Byte by byte.
        let chunks: Vec<&[u8]> = bytes.chunks(1).collect();
        assert_eq!(frame_all(&chunks).0, want);
    }

    #[test]
    fn raw_events_pass_through_byte_for_byte_and_a_tail_is_kept() {
        let mut f = Framer::new();
        f.push(b"data: {\"a\":1}\r\n\r\ndata: [DONE]\n\ndata: par");
        let mut out = Vec::new();
        while let Some(e) = f.next_event() {
            out.extend_from_slice(&e);
        }
        assert_eq!(out, b"data: {\"a\":1}\r\n\r\ndata: [DONE]\n\n");
        assert_eq!(f.finish(), b"data: par");
        assert!(f.is_empty());
    }

    #[test]
    fn an_answers_last_event_is_seen_in_any_framing() {
        assert!(ends_answer(b"data: {\"choices\":[]}\n\ndata: [DONE]\n\n"));
        assert!(ends_answer(b"data:[DONE]\r\n\r\n"));
        assert!(ends_answer(b"event: response.completed\rdata: {}\r\r"));
        assert!(ends_answer(b"event:response.failed\ndata: {}\n\n"));
        assert!(!ends_answer(
            b"data: {\"choices\":[{\"text\":\"[DONE]\"}]}\n\n"
        ));
        assert!(!ends_answer(
            b"event: response.output_text.delta\ndata: {}\n\n"
        ));
    }

    #[test]
    fn written_events_parse_back() {
        let mut out = Vec::new();
        write_event(&mut out, Some("response.completed"), "line1\nline2");
        write_json(&mut out, None, &serde_json::json!({"x": "a\nb"}));
        out.extend_from_slice(DONE);
        let (events, rest) = frame_all(&[&out]);
        assert!(rest.is_empty());
        assert_eq!(events[0].event.as_deref(), Some("response.completed"));
        assert_eq!(events[0].data.as_deref(), Some("line1\nline2"));
        assert_eq!(events[1].json().unwrap()["x"], "a\nb");
        assert!(events[2].is_done());
        let again = Event::parse(&events[0].to_bytes());
        assert_eq!(again, events[0]);
    }
}
