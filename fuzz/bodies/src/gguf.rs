//! A GGUF file opened as a node opens `--model` (`pd_model::GgufFile::open`: candle's header
//! reader and the node's checks), then its config and its tokenizer (`GgufFile::vocab` →
//! `pd_tokenize::Tokenizer::from_gguf_vocab`, what `ModelSource::tokenizer` does); or, on the
//! other branch, a GGUF vocabulary (the tiny byte-level one, changed by the input) built into a
//! tokenizer that then encodes and decodes.
//!
//! Property: nothing panics (a file from outside is an error, never a crash); a tokenizer that
//! builds encodes text to ids it knows and decodes them.

use std::io::Write;
use std::path::PathBuf;

use pd_tokenize::{GgufVocab, Tokenizer};

use crate::input::Input;

/// The file the raw branch writes its input to (one per process and thread).
fn scratch() -> PathBuf {
    let dir = std::env::var_os("PD_FUZZ_SCRATCH")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    dir.join(format!(
        "pd-fuzz-gguf-{}-{:?}.gguf",
        std::process::id(),
        std::thread::current().id()
    ))
}

/// The target.
pub fn run(data: &[u8]) {
    crate::caught_panics_are_not_crashes();
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode & 1 == 0 {
        file(rest);
    } else {
        vocab(rest);
    }
}

fn file(bytes: &[u8]) {
    let path = scratch();
    {
        let mut f = std::fs::File::create(&path).expect("scratch file");
        f.write_all(bytes).expect("scratch file");
    }
    let Ok(g) = pd_model::GgufFile::open(&path) else {
        return;
    };
    let _ = g.config();
    if let Ok(v) = g.vocab()
        && let Ok(t) = Tokenizer::from_gguf_vocab(&v)
    {
        exercise(&t, "Hello, world! 12345 ünïcødé\n\t");
    }
}

fn exercise(t: &Tokenizer, text: &str) {
    let Ok(ids) = t.encode(text, true) else {
        return;
    };
    let n = t.vocab_size();
    for &id in &ids {
        assert!((id as usize) < n.max(1) || t.id_to_token(id).is_some());
    }
    let _ = t.decode(&ids, false);
    let _ = t.decode(&ids, true);
    let mut d = t.decoder(false);
    for &id in &ids {
        let _ = d.step(t, id);
    }
    let _ = t.apply_chat_template(&[pd_tokenize::ChatMessage::new("user", text)], true);
}

fn vocab(bytes: &[u8]) {
    let mut input = Input::new(bytes);
    let mut v: GgufVocab = pd_tokenize::byte_level_gguf_vocab(300).expect("tiny vocab");
    if input.bool() {
        v.model = input.pick(&["gpt2", "llama", "", "bert"]).into();
    }
    if input.bool() {
        v.pre = input.pick(&[
            None,
            Some("smollm".to_string()),
            Some("qwen2".into()),
            Some("llama-bpe".into()),
            Some("gpt-2".into()),
            Some("x".into()),
        ]);
    }
    for _ in 0..input.below(8) {
        let i = input.below(v.tokens.len() + 2);
        let s = input.string(12);
        match v.tokens.get_mut(i) {
            Some(t) => *t = s,
            None => v.tokens.push(s),
        }
    }
    if input.bool() {
        v.token_types = (0..input.below(v.tokens.len() + 4))
            .map(|_| i32::from(input.byte() as i8))
            .collect();
    }
    for _ in 0..input.below(8) {
        let m = format!("{} {}", input.string(6), input.string(6));
        if input.bool() {
            v.merges.push(m);
        } else if !v.merges.is_empty() {
            let i = input.below(v.merges.len());
            v.merges[i] = m;
        }
    }
    let id = |input: &mut Input<'_>, old: Option<u32>| match input.byte() % 4 {
        0 => None,
        1 => Some(input.u32()),
        2 => Some(input.below(v.tokens.len() + 1) as u32),
        _ => old,
    };
    let (b, e, t, u, p) = (
        v.bos_token_id,
        v.eos_token_id,
        v.eot_token_id,
        v.unknown_token_id,
        v.padding_token_id,
    );
    v.bos_token_id = id(&mut input, b);
    v.eos_token_id = id(&mut input, e);
    v.eot_token_id = id(&mut input, t);
    v.unknown_token_id = id(&mut input, u);
    v.padding_token_id = id(&mut input, p);
    v.add_bos_token = input.pick(&[None, Some(true), Some(false)]);
    v.add_eos_token = input.pick(&[None, Some(true), Some(false)]);
    if input.bool() {
        v.chat_template = Some(input.string(256));
    }
    let text = input.string(256);
    if let Ok(t) = Tokenizer::from_gguf_vocab(&v) {
        exercise(&t, &text);
    }
}
