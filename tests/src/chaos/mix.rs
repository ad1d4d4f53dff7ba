//! The chaos suite's load: clients looping a mix of requests through Envoy — chat, completions
//! and responses; streamed or not; `n` from 1 to 3; greedy and seeded; structured output;
//! conversations continued with `previous_response_id` and with resent histories — and every
//! answer that completes checked against the reference node given the same request (a
//! continued turn: its whole history), token for token.
//!
//! Each request ends as one [`Seen`]: exact, wrong, an error (an OpenAI error object or SSE
//! error event, by code), an error that is not an OpenAI error object, a cut answer (the
//! connection closed or the stream ended without its end), a request past the bound, or left by
//! its client on purpose (the abort storm).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use serde_json::{Value, json};

use crate::openai::{self, Answer, Api};

/// No request may take longer than this, whatever is injected.
pub const BOUND: Duration = Duration::from_secs(60);

/// Leaving clients leave within this many milliseconds of sending: a tiny-model request takes
/// some tens of them, so the points fall before P answers, between P and D, and mid-decode.
const LEAVE_WITHIN_MS: u64 = 40;

/// How clients behave.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Clients {
    /// Every request read to its end.
    Patient,
    /// Most requests left at a random point (before P answers, between P and D, mid-decode).
    Leaving,
}

/// How one request ended.
#[derive(Debug, Clone, PartialEq)]
enum Seen {
    Exact,
    Wrong(String),
    /// Its code and message.
    Error(String, String),
    NotOpenAi(String),
    Cut(String),
    Hung,
    Left,
}

/// What the clients saw over a run.
#[derive(Debug, Default, Clone)]
pub struct Tally {
    /// Requests sent.
    pub sent: usize,
    /// Completed and token-exact with the reference.
    pub exact: usize,
    /// Completed but different from the reference: what differed.
    pub wrong: Vec<String>,
    /// OpenAI errors (status ≥ 400 with an error object, or an SSE error event), by code.
    pub errors: BTreeMap<String, usize>,
    /// The first message seen of each code.
    pub messages: BTreeMap<String, String>,
    /// Errors that were not OpenAI error objects.
    pub not_openai: Vec<String>,
    /// Answers cut short (connection closed, or a stream without its end).
    pub cut: Vec<String>,
    /// Requests past [`BOUND`].
    pub hung: usize,
    /// Requests their client left on purpose.
    pub left: usize,
    /// The longest a request took that was answered (exact, wrong or an error).
    pub slowest: Duration,
}

impl Tally {
    fn add(&mut self, seen: Seen) {
        self.sent += 1;
        match seen {
            Seen::Exact => self.exact += 1,
            Seen::Wrong(w) => self.wrong.push(w),
            Seen::Error(code, message) => {
                *self.errors.entry(code.clone()).or_default() += 1;
                self.messages.entry(code).or_insert(message);
            }
            Seen::NotOpenAi(e) => self.not_openai.push(e),
            Seen::Cut(e) => self.cut.push(e),
            Seen::Hung => self.hung += 1,
            Seen::Left => self.left += 1,
        }
    }

    fn merge(&mut self, other: Tally) {
        self.sent += other.sent;
        self.exact += other.exact;
        self.wrong.extend(other.wrong);
        for (k, v) in other.errors {
            *self.errors.entry(k).or_default() += v;
        }
        for (k, v) in other.messages {
            self.messages.entry(k).or_insert(v);
        }
        self.not_openai.extend(other.not_openai);
        self.cut.extend(other.cut);
        self.hung += other.hung;
        self.left += other.left;
        self.slowest = self.slowest.max(other.slowest);
    }

    /// OpenAI errors, all codes.
    pub fn error_count(&self) -> usize {
        self.errors.values().sum()
    }

    /// `code×n, ...`.
    pub fn error_codes(&self) -> String {
        let v: Vec<String> = self
            .errors
            .iter()
            .map(|(k, n)| format!("{k}×{n}"))
            .collect();
        v.join(", ")
    }
}

/// Clients in tokio tasks; see [`Mix::start`].
#[derive(Debug)]
pub struct Mix {
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
    exact: Arc<AtomicU64>,
    clients: Vec<tokio::task::JoinHandle<Tally>>,
}

/// Where a client sends and checks.
#[derive(Debug, Clone)]
struct Target {
    front: String,
    reference: String,
    client: reqwest::Client,
}

impl Mix {
    /// Starts `clients` clients sending through `front` (Envoy) and checking against
    /// `reference`; each stops after `max_per_client` requests whatever happens. `seed` varies
    /// prompts between runs (so a run does not hit the previous run's prefix cache only).
    pub fn start(
        front: &str,
        reference: &str,
        clients: (usize, usize),
        how: Clients,
        seed: u64,
    ) -> Self {
        let (clients, max_per_client) = clients;
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicU64::new(0));
        let exact = Arc::new(AtomicU64::new(0));
        let target = Target {
            front: front.to_owned(),
            reference: reference.to_owned(),
            client: reqwest::Client::new(),
        };
        let clients = (0..clients)
            .map(|w| {
                let (stop, done, exact) = (stop.clone(), done.clone(), exact.clone());
                let target = target.clone();
                tokio::spawn(async move {
                    let mut c = Client::new(target, w, how, seed);
                    let mut tally = Tally::default();
                    for i in 0..max_per_client {
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        let (seen, took) = c.one(i).await;
                        if !matches!(seen, Seen::Left | Seen::Hung) {
                            tally.slowest = tally.slowest.max(took);
                        }
                        if seen == Seen::Exact {
                            exact.fetch_add(1, Ordering::Relaxed);
                        }
                        tally.add(seen);
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    tally
                })
            })
            .collect();
        Mix {
            stop,
            done,
            exact,
            clients,
        }
    }

    /// Requests finished so far.
    pub fn done(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    /// Requests answered token-exact so far.
    pub fn exact(&self) -> u64 {
        self.exact.load(Ordering::Relaxed)
    }

    /// Stops the clients after their current request and gathers what they saw.
    pub async fn stop(self) -> Tally {
        self.stop.store(true, Ordering::Relaxed);
        let mut out = Tally::default();
        for c in self.clients {
            out.merge(c.await.expect("a client task"));
        }
        out
    }
}

/// One client: its conversation so far and its random numbers.
struct Client {
    target: Target,
    w: usize,
    how: Clients,
    seed: u64,
    rng: u64,
    /// A `/v1/responses` conversation: the last response's id and the history it stands for.
    conversation: Option<(String, Vec<Value>)>,
}

/// One request of the mix: the body sent, the body the reference is given, the API.
struct Request {
    api: Api,
    body: Value,
    reference: Value,
    /// A turn continuing the client's conversation (its user message).
    turn: Option<String>,
}

impl Client {
    fn new(target: Target, w: usize, how: Clients, seed: u64) -> Self {
        Self {
            target,
            w,
            how,
            seed,
            rng: 0x9E37_79B9_7F4A_7C15 ^ ((w as u64 + 1) << 32) ^ seed,
            conversation: None,
        }
    }

    fn next_random(&mut self) -> u64 {
        // xorshift64*: enough for abort points.
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// The `i`-th request of this client.
    fn request(&self, i: usize) -> Request {
        let text = format!(
            "{} {} {i}: tell me about rivers, mountains and the sea.",
            self.seed, self.w
        );
        let kind = (i + self.w * 3) % 8;
        let (api, body) = match kind {
            0 => (Api::Chat, Api::Chat.streaming(&Api::Chat.body(&text, 6))),
            1 => {
                let mut b = Api::Completions.body(&text, 5);
                b["n"] = json!(2);
                (Api::Completions, b)
            }
            2 | 6 => return self.turn(i, kind == 2),
            3 => {
                let mut b = Api::Chat.body(&text, 5);
                b["messages"] = json!([
                    {"role": "user", "content": format!("{} {} {i}: hello.", self.seed, self.w)},
                    {"role": "assistant", "content": "Hello! How can I help?"},
                    {"role": "user", "content": text},
                ]);
                (Api::Chat, b)
            }
            4 => {
                let mut b = Api::Completions.body(&text, 5);
                b["n"] = json!(3);
                b["temperature"] = json!(0.8);
                b["seed"] = json!(i as u64 + self.seed);
                (Api::Completions, Api::Completions.streaming(&b))
            }
            5 => {
                let mut b = Api::Chat.body(&text, 8);
                b["response_format"] = json!({"type": "json_schema", "json_schema": {
                    "name": "answer", "schema": {"type": "object",
                    "properties": {"river": {"type": "string"}}, "required": ["river"]}}});
                (Api::Chat, b)
            }
            _ => {
                let mut b = Api::Chat.body(&text, 4);
                b["n"] = json!(2);
                (Api::Chat, Api::Chat.streaming(&b))
            }
        };
        let mut reference = body.clone();
        if let Some(o) = reference.as_object_mut() {
            o.remove("stream");
            o.remove("stream_options");
        }
        Request {
            api,
            body,
            reference,
            turn: None,
        }
    }

    /// A `/v1/responses` turn: the conversation continued (at most three turns long), or a new
    /// one; streamed or not.
    fn turn(&self, i: usize, stream: bool) -> Request {
        let user = format!("{} {} {i}: and then?", self.seed, self.w);
        let api = Api::Responses;
        let mut body = api.body(&user, 5);
        let mut history = Vec::new();
        if let Some((id, h)) = self.conversation.as_ref().filter(|(_, h)| h.len() < 6) {
            body["previous_response_id"] = json!(id);
            history = h.clone();
        }
        history.push(json!({"role": "user", "content": user}));
        let reference = json!({"model": openai::MODEL, "input": history,
                               "max_output_tokens": 5, "temperature": 0});
        if stream {
            body = api.streaming(&body);
        }
        Request {
            api,
            body,
            reference,
            turn: Some(user),
        }
    }

    /// The `i`-th request sent, what came of it, and how long the answer took.
    async fn one(&mut self, i: usize) -> (Seen, Duration) {
        let r = self.request(i);
        let (leave, after) = (
            self.next_random() % 10 < 7,
            self.next_random() % LEAVE_WITHIN_MS,
        );
        let leave_after =
            (self.how == Clients::Leaving && leave).then(|| Duration::from_millis(after));
        let t = &self.target;
        let send = openai::try_send(&t.client, &t.front, r.api, &r.body);
        let start = std::time::Instant::now();
        let answer = match leave_after {
            Some(after) => match tokio::time::timeout(after, send).await {
                Ok(a) => a,
                Err(_) => return (Seen::Left, start.elapsed()),
            },
            None => match tokio::time::timeout(BOUND, send).await {
                Ok(a) => a,
                Err(_) => return (Seen::Hung, start.elapsed()),
            },
        };
        let took = start.elapsed();
        let a = match answer {
            Ok(a) => a,
            Err(e) => {
                self.conversation = None;
                return (Seen::Cut(format!("{:?}: {e}", r.api)), took);
            }
        };
        let seen = self.judge(&r, &a).await;
        match (&seen, &r.turn) {
            (Seen::Exact, Some(user)) => {
                let mut history = r.reference["input"].as_array().cloned().unwrap_or_default();
                debug_assert!(history.last().is_some_and(|m| m["content"] == *user));
                history.push(json!({"role": "assistant", "content": a.texts.concat()}));
                self.conversation = a.response_id.clone().map(|id| (id, history));
            }
            (_, Some(_)) => self.conversation = None,
            _ => {}
        }
        (seen, took)
    }

    async fn judge(&self, r: &Request, a: &Answer) -> Seen {
        if let Some(e) = &a.error {
            // An OpenAI error object: a message, and a type or code.
            let openai = e["message"].is_string()
                && (e["type"].is_string() || e["code"].is_string())
                && (a.status == 200 || serde_json::from_str::<Value>(&a.body).is_ok());
            if !openai {
                return Seen::NotOpenAi(format!("{:?} {}: {}", r.api, a.status, a.body));
            }
            let code = e["code"]
                .as_str()
                .or(e["type"].as_str())
                .unwrap_or("unknown");
            let message = e["message"]
                .as_str()
                .unwrap_or("")
                .chars()
                .take(200)
                .collect();
            return Seen::Error(format!("{code}/{}", a.status), message);
        }
        if !a.complete {
            return Seen::Cut(format!("{:?} {}: {}", r.api, a.status, a.body));
        }
        let t = &self.target;
        let want = match openai::try_send(&t.client, &t.reference, r.api, &r.reference).await {
            Ok(w) if w.status == 200 && w.complete => w,
            other => panic!("the reference node failed {}: {other:?}", r.reference),
        };
        if a.texts == want.texts {
            Seen::Exact
        } else {
            Seen::Wrong(format!(
                "{:?} {}: got {:?}, the reference {:?}",
                r.api, r.body, a.texts, want.texts
            ))
        }
    }
}
