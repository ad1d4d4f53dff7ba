//! The real model: SmolLM2-135M-Instruct Q4_1 (`bash scripts/fetch-model.sh` puts it in the
//! cache; `PD_MODEL_GGUF` names it). Without the file these tests fail when `CI=true` and
//! skip with a message otherwise.
//!
//! The configuration and tokenizer read from the file are SmolLM2's (`real_gguf_greedy.rs`
//! compares the forward pass with candle-transformers).

use crate::common::model_file;
use pd_model::{Arch, ModelSource};

#[test]
fn config_and_tokenizer_are_smollm2() {
    let Some(path) = model_file() else { return };
    let source = ModelSource::open(&path).unwrap();
    let ModelSource::Gguf(g) = &source else {
        panic!("not read as GGUF")
    };
    let c = g.config().unwrap();
    assert_eq!(c.arch, Arch::Llama);
    assert_eq!(
        (
            c.num_layers,
            c.hidden_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim
        ),
        (30, 576, 9, 3, 64)
    );
    assert_eq!((c.intermediate_size, c.vocab_size), (1536, 49152));
    assert_eq!((c.rope_theta, c.max_position_embeddings), (100_000.0, 8192));
    assert!(c.tie_word_embeddings);
    assert_eq!(c.eos_token_ids, vec![2]);
    let tok = source.tokenizer().unwrap();
    assert_eq!(tok.eos_token_ids(), &[2]);
    // `smollm` splits digits one by one.
    let ids = tok.encode("2024", false).unwrap();
    assert_eq!(ids.len(), 4, "{ids:?}");
    let text = "What is the capital of France? Ünïcödé 日本 👋";
    let ids = tok.encode(text, true).unwrap();
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
    let chat = tok
        .apply_chat_template(&[pd_tokenize::ChatMessage::new("user", "Hi")], true)
        .unwrap();
    assert_eq!(
        chat,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging \
         Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = tok.encode(&chat, false).unwrap();
    assert_eq!(ids[0], 1, "<|im_start|> is one token");
}

/// Our token ids equal llama.cpp's for the same file, on a fixture of 24 texts: ASCII, digit
/// runs, accents, CJK, emoji (ZWJ sequences, flags, skin tones), code, whitespace runs. The
/// fixture was written once by `fixtures/gen_llama_tokenize.py` with `llama-tokenize` from the
/// llama.cpp that `scripts/llama-cpp.sh` builds.
#[test]
fn token_ids_equal_llama_cpp_on_the_fixture() {
    let Some(path) = model_file() else { return };
    let tok = ModelSource::open(&path).unwrap().tokenizer().unwrap();
    let fixture: serde_json::Value =
        serde_json::from_str(include_str!("fixtures/smollm2_llama_tokenize.json")).unwrap();
    let cases = fixture["cases"].as_array().expect("cases");
    assert!(cases.len() >= 20, "{} cases", cases.len());
    let mut wrong = Vec::new();
    for case in cases {
        let text = case["text"].as_str().expect("text");
        let want: Vec<u32> = case["ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|i| u32::try_from(i.as_u64().expect("id")).expect("u32"))
            .collect();
        let got = tok.encode(text, false).unwrap();
        if got != want {
            wrong.push(format!("{text:?}: ours {got:?}, llama.cpp {want:?}"));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {} differ:\n{}",
        wrong.len(),
        cases.len(),
        wrong.join("\n")
    );
}

/// `Tokenizer::encode` takes a shorter way for byte-level BPE (ids without the `tokenizers`
/// library's offsets): on SmolLM2's real tokenizer, and on its vocabulary under Llama 3's and
/// Qwen2's pre-tokenizers, it gives the library's ids, for the fixture's texts and for random
/// mixes of them with special tokens, digits and whitespace.
#[test]
fn the_ids_only_path_gives_the_library_s_ids() {
    let Some(path) = model_file() else { return };
    let tok = ModelSource::open(&path).unwrap().tokenizer().unwrap();
    assert!(format!("{tok:?}").contains("ids_only: Some"), "{tok:?}");
    let fixture: serde_json::Value =
        serde_json::from_str(include_str!("fixtures/smollm2_llama_tokenize.json")).unwrap();
    let mut pieces: Vec<String> = fixture["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| c["text"].as_str().expect("text").to_owned())
        .collect();
    for p in [
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<|im_st",
        "2024",
        "٣²½",
        "  ",
        "\n\n",
        "\t",
        "'s",
        "'re",
        " the",
        "👋",
        "\u{a0}",
    ] {
        pieces.push(p.to_owned());
    }
    let mut state = 0x9E37_79B9_7F4A_7C15_u64;
    let mut next = move || {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_F491_4F6C_DD1D)
    };
    let mut texts = pieces.clone();
    for _ in 0..2000 {
        let len = next() % 12;
        texts.push(
            (0..len)
                .map(|_| pieces[(next() % pieces.len() as u64) as usize].as_str())
                .collect(),
        );
    }
    // The same vocabulary and merges under Llama 3's and Qwen2's pre-tokenizers (their own split
    // regex, then byte-level without one; Llama 3 adds a BOS): the other GGUF tokenizers served.
    let vocab = pd_model::GgufFile::open(&path).unwrap().vocab().unwrap();
    let mut tokenizers = vec![("smollm", tok)];
    for pre in ["llama-bpe", "qwen2"] {
        let mut v = vocab.clone();
        v.pre = Some(pre.into());
        v.add_bos_token = None;
        let tok = pd_tokenize::Tokenizer::from_gguf_vocab(&v).unwrap();
        assert!(
            format!("{tok:?}").contains("ids_only: Some"),
            "{pre}: {tok:?}"
        );
        tokenizers.push((pre, tok));
    }
    for (pre, tok) in &tokenizers {
        for text in &texts {
            for add_special_tokens in [false, true] {
                assert_eq!(
                    tok.encode(text, add_special_tokens).unwrap(),
                    tok.encode_reference(text, add_special_tokens).unwrap(),
                    "{pre}: {text:?} (add_special_tokens {add_special_tokens})"
                );
            }
        }
    }
}
