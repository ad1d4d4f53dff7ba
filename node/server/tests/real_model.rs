//! `pd-node serve --model FILE.gguf` on the real model (SmolLM2-135M-Instruct Q4_1, fetched by
//! `bash scripts/fetch-model.sh`; `PD_MODEL_GGUF` names it): the real binary answers a chat
//! question over the OpenAI API with the right answer, greedy, and scores a multiple-choice
//! question's answers as an evaluation harness does (the right one most likely). Without the file the test fails
//! when `CI=true` and skips with a message otherwise.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use serde_json::{Value, json};

/// The `pd-node` child, killed on drop.
struct Node(Child);

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn model_file() -> Option<PathBuf> {
    match pd_model::testing::real_model_file() {
        Ok(path) => Some(path),
        Err(msg) => {
            assert!(std::env::var("CI").as_deref() != Ok("true"), "{msg}");
            eprintln!("skipping: {msg}");
            None
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_gguf_answers_the_capital_of_france() {
    let Some(file) = model_file() else { return };
    let mut child = Command::new(env!("CARGO_BIN_EXE_pd-node"))
        .arg("serve")
        .arg("--model")
        .arg(&file)
        .args(["--port", "0", "--num-gpu-blocks", "64"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn pd-node");
    let stdout = child.stdout.take().expect("stdout");
    let node = Node(child);
    let http = tokio::task::spawn_blocking(move || {
        let mut out = BufReader::new(stdout);
        loop {
            let mut line = String::new();
            assert!(
                out.read_line(&mut line).expect("read stdout") > 0,
                "pd-node exited before listening"
            );
            if let Some(a) = line.trim().strip_prefix("pd-node listening on ") {
                return a.to_string();
            }
        }
    })
    .await
    .expect("reader");
    let client = reqwest::Client::new();

    // The served name defaults to the file's name without `.gguf`.
    let models: Value = client
        .get(format!("{http}/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let name = models["data"][0]["id"].as_str().unwrap().to_owned();
    assert_eq!(name, "SmolLM2-135M-Instruct.Q4_1");

    let resp = client
        .post(format!("{http}/v1/chat/completions"))
        .json(&json!({
            "model": name,
            "messages": [
                {"role": "system", "content": "Answer in one sentence."},
                {"role": "user", "content": "What is the capital of France?"},
            ],
            "temperature": 0,
            "max_tokens": 24,
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let body: Value = resp.json().await.unwrap();
    let text = body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default();
    assert!(text.contains("Paris"), "answer: {text:?} ({body})");
    // <|im_end|> (EOS) ends the answer before max_tokens.
    assert_eq!(body["choices"][0]["finish_reason"], "stop", "{body}");

    // A multiple-choice question scored as lm-evaluation-harness scores one: context and each
    // continuation tokenized on their own (`/tokenize`, as its remote tokenizer does), sent as
    // ids with `echo`, `logprobs: 1` and `max_tokens: 0`; the continuation's logprobs summed.
    let post = |path: &'static str, body: Value| {
        let req = client.post(format!("{http}{path}")).json(&body).send();
        async move {
            let r = req.await.unwrap();
            assert_eq!(r.status().as_u16(), 200, "{path}");
            r.json::<Value>().await.unwrap()
        }
    };
    let ids = |v: &Value| -> Vec<u64> {
        v["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect()
    };
    let context = ids(&post("/tokenize", json!({"prompt": "The capital of France is"})).await);
    let mut scores = Vec::new();
    for answer in [" Paris", " Berlin", " Madrid", " London"] {
        let tail = ids(&post(
            "/tokenize",
            json!({"prompt": answer, "add_special_tokens": false}),
        )
        .await);
        let whole: Vec<u64> = context.iter().chain(&tail).copied().collect();
        let r = post(
            "/v1/completions",
            json!({"model": name, "prompt": [whole], "echo": true, "logprobs": 1, "max_tokens": 0}),
        )
        .await;
        let lps = r["choices"][0]["logprobs"]["token_logprobs"]
            .as_array()
            .unwrap()
            .clone();
        assert_eq!(lps.len(), whole.len(), "{r}");
        let sum: f64 = lps[context.len()..]
            .iter()
            .map(|l| l.as_f64().unwrap())
            .sum();
        scores.push((sum, answer));
    }
    scores.sort_by(|a, b| b.0.total_cmp(&a.0));
    assert_eq!(
        scores[0].1, " Paris",
        "most likely continuation: {scores:?}"
    );
    drop(node);
}
