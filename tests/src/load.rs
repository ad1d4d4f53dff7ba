//! Background load: streaming clients looping greedy requests through a gateway, cycling the
//! three APIs, until stopped. Used by the tests that change things under load (policy swaps,
//! pushes in every language) and then require that no request failed.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::openai::{self, Api};

/// Clients running in tokio tasks; see [`Load::start`].
#[derive(Debug)]
pub struct Load {
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
    clients: Vec<tokio::task::JoinHandle<(usize, Vec<String>)>>,
}

/// What the clients saw: requests answered completely, and every other answer described.
#[derive(Debug, Default)]
pub struct LoadOutcome {
    /// Requests answered 200, complete, without an error.
    pub ok: usize,
    /// The others: API, status and body.
    pub failed: Vec<String>,
}

impl Load {
    /// Starts `clients` clients against the gateway at `http`. Client `w`'s `i`-th request is a
    /// streamed 4-token request on API `(w + i) % 3` for `"{i} {text}"` (so the clients' i-th
    /// requests share a prompt and D's prefix cache hits too); each stops after
    /// `max_per_client` requests whatever happens.
    pub fn start(http: &str, clients: usize, max_per_client: usize, text: &str) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicU64::new(0));
        let clients = (0..clients)
            .map(|w| {
                let (stop, done) = (stop.clone(), done.clone());
                let (http, text) = (http.to_string(), text.to_string());
                tokio::spawn(async move {
                    let client = reqwest::Client::new();
                    let mut failed = Vec::new();
                    let mut ok = 0usize;
                    for i in 0..max_per_client {
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        let api = Api::ALL[(w + i) % 3];
                        let body = api.streaming(&api.body(&format!("{i} {text}"), 4));
                        let a = openai::send(&client, &http, api, &body, None).await;
                        if a.status == 200 && a.complete && a.error.is_none() {
                            ok += 1;
                        } else {
                            failed.push(format!("{api:?}: {} {}", a.status, a.body));
                        }
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    (ok, failed)
                })
            })
            .collect();
        Load {
            stop,
            done,
            clients,
        }
    }

    /// Requests finished so far (answered or failed).
    pub fn done(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    /// Stops the clients after their current request and gathers what they saw.
    pub async fn stop(self) -> LoadOutcome {
        self.stop.store(true, Ordering::Relaxed);
        let mut out = LoadOutcome::default();
        for client in self.clients {
            let (ok, failed) = client.await.expect("a client task");
            out.ok += ok;
            out.failed.extend(failed);
        }
        out
    }
}
