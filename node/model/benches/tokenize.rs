//! Tokenizing a prompt to ids: `Tokenizer::encode` (the ids-only path for byte-level BPE) vs
//! `Tokenizer::encode_reference` (the `tokenizers` library's whole pipeline), same texts, same
//! run, interleaved. The tokenizers: the real model's (SmolLM2-135M-Instruct, from the GGUF
//! file `PD_MODEL_GGUF` names; skipped without it); its vocabulary and merges under Llama 3's
//! and Qwen2's pre-tokenizers (`tokenizer.ggml.pre` set to `llama-bpe` / `qwen2`: their split
//! regex, then byte-level without one; Llama 3 also adds a BOS); and the test models' byte
//! tokenizer (one token per byte: what the gateway bench's tiny model uses). Prompts of 64 and 2000 bytes of
//! English-like text, each distinct (a number in front), 2000 per row.
//!
//! Run: `PD_MODEL_GGUF=$(bash scripts/fetch-model.sh) cargo bench -p pd-model --bench tokenize`
//! Results are in `BENCHMARKS.md` ("Tokenizer"; history: `docs/bench-log/gateway.md`).

use std::time::Instant;

use pd_model::ModelSource;
use pd_tokenize::Tokenizer;

fn prompts(len: usize) -> Vec<String> {
    (0..2000)
        .map(|i| {
            let mut s = format!("{i:08} ");
            while s.len() < len {
                s.push_str("The capital of France is Paris, said 12 people; they're sure. ");
            }
            s.truncate(len);
            s
        })
        .collect()
}

/// Mean µs per prompt of `encode` and `encode_reference` (with the post-processor's special
/// tokens, as a completions prompt is tokenized), best of 3 rounds each.
fn row(name: &str, tok: &Tokenizer, len: usize) {
    let texts = prompts(len);
    let (mut fast, mut reference) = (f64::MAX, f64::MAX);
    let mut ids = 0;
    for _ in 0..3 {
        let t = Instant::now();
        for p in &texts {
            ids += tok.encode(p, true).expect("encode").len();
        }
        fast = fast.min(t.elapsed().as_secs_f64() * 1e6 / texts.len() as f64);
        let t = Instant::now();
        for p in &texts {
            ids -= tok.encode_reference(p, true).expect("encode").len();
        }
        reference = reference.min(t.elapsed().as_secs_f64() * 1e6 / texts.len() as f64);
    }
    assert_eq!(ids, 0, "both paths give as many ids");
    let tokens = tok.encode(&texts[0], true).expect("encode").len();
    println!(
        "| {name} | {len} | {tokens} | {reference:.1} | {fast:.1} | {:.2}× |",
        reference / fast
    );
}

fn main() {
    println!("| tokenizer | prompt bytes | tokens | library µs | ids-only µs | speed-up |");
    println!("|---|---:|---:|---:|---:|---:|");
    match std::env::var("PD_MODEL_GGUF") {
        Ok(path) => {
            let tok = ModelSource::open(std::path::Path::new(&path))
                .and_then(|s| s.tokenizer())
                .expect("the model's tokenizer");
            for len in [64, 2000] {
                row("SmolLM2", &tok, len);
            }
            let vocab = pd_model::GgufFile::open(std::path::Path::new(&path))
                .and_then(|f| f.vocab())
                .expect("the model's vocabulary");
            for pre in ["llama-bpe", "qwen2"] {
                let mut v = vocab.clone();
                v.pre = Some(pre.into());
                v.add_bos_token = None;
                let tok = Tokenizer::from_gguf_vocab(&v)
                    .expect("the vocabulary under another pre-tokenizer");
                for len in [64, 2000] {
                    row(&format!("SmolLM2's vocabulary, `{pre}`"), &tok, len);
                }
            }
        }
        Err(_) => eprintln!("PD_MODEL_GGUF not set: the real tokenizer's rows are skipped"),
    }
    let dir = std::env::temp_dir().join(format!("pd-bench-tokenize-{}", std::process::id()));
    pd_tokenize::write_byte_level_tokenizer(&dir, 300).expect("the byte tokenizer");
    let tok = Tokenizer::from_dir(&dir).expect("the byte tokenizer");
    let _ = std::fs::remove_dir_all(&dir);
    for len in [64, 2000] {
        row("byte (tiny model)", &tok, len);
    }
}
