//! The ids-only path of byte-level BPE tokenizers (`Tokenizer::encode`) against the
//! `tokenizers` library's whole pipeline (`Tokenizer::encode_reference`), on random text made
//! of what trips tokenizers: special tokens and pieces of them, digits of several scripts,
//! contractions, runs of whitespace, multi-byte characters.
//!
//! The tokenizers: the test models' byte tokenizer (`ByteLevel` alone, no merges); one with
//! merges, SmolLM2's `Digits` + `ByteLevel` pre-tokenizer and a non-special added token; and a
//! GGUF vocabulary with merges under each pre-tokenizer a GGUF file may name (`gpt-2`,
//! `smollm`, `llama-bpe`, `qwen2`: the last two split with their own regex, then `ByteLevel`
//! without one), converted as a GGUF model's is. The real SmolLM2 tokenizer gets the same check
//! in `pd-model`'s `real_gguf.rs`.

use std::path::{Path, PathBuf};

use pd_tokenize::{Tokenizer, byte_level_gguf_vocab, write_byte_level_tokenizer};
use serde_json::{Value, json};

/// Random text: `n` strings of up to 40 pieces each, from a fixed seed.
pub(crate) fn random_texts(seed: u64, n: usize) -> Vec<String> {
    const PIECES: &[&str] = &[
        "a",
        "b",
        "the",
        " the",
        "The",
        "  ",
        "   ",
        "\n",
        "\n\n",
        "\t",
        "\r\n",
        " ",
        "'s",
        "'re",
        "'ll",
        "'S",
        "'Ve",
        "'",
        "\"",
        "1",
        "23",
        "2024",
        "٣",
        "²",
        "½",
        "é",
        "ß",
        "中文",
        "Ж",
        "👋",
        "!",
        "?",
        ".",
        ",",
        "-",
        "_",
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<|im_st",
        "|>",
        "<",
        "<tool>",
        "<tool",
        "\u{a0}",
        "\u{200b}",
        "0",
        " is",
        "in",
        "er",
        "on",
    ];
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        // xorshift64*
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_F491_4F6C_DD1D)
    };
    (0..n)
        .map(|_| {
            let len = next() % 41;
            (0..len)
                .map(|_| PIECES[(next() % PIECES.len() as u64) as usize])
                .collect()
        })
        .collect()
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pd-tokenize-ids-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn assert_same_ids(tok: &Tokenizer, texts: &[String]) {
    assert!(
        format!("{tok:?}").contains("ids_only: Some"),
        "the ids-only path does not serve this tokenizer: {tok:?}"
    );
    for text in texts {
        for add_special_tokens in [false, true] {
            assert_eq!(
                tok.encode(text, add_special_tokens).unwrap(),
                tok.encode_reference(text, add_special_tokens).unwrap(),
                "{text:?} (add_special_tokens {add_special_tokens})"
            );
        }
    }
}

#[test]
fn the_byte_tokenizer_gives_the_library_s_ids() {
    let dir = temp_dir("bytes");
    write_byte_level_tokenizer(&dir, 300).unwrap();
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert_same_ids(&tok, &random_texts(1, 3000));
}

/// The byte tokenizer's files with merges added (`Ġ t`, `h e`, `Ġt he`, ...), SmolLM2's
/// pre-tokenizer, and a non-special added token `<tool>`.
fn with_merges(dir: &Path) -> Tokenizer {
    write_byte_level_tokenizer(dir, 259).unwrap();
    let path = dir.join("tokenizer.json");
    let mut t: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let merges = [
        ("Ġ", "t"),
        ("h", "e"),
        ("Ġt", "he"),
        ("i", "n"),
        ("Ġ", "a"),
        ("e", "r"),
        ("o", "n"),
        ("Ġ", "i"),
        ("Ġi", "s"),
        ("Ġ", "Ġ"),
        ("ĠĠ", "ĠĠ"),
        ("Ċ", "Ċ"),
        ("'", "s"),
    ];
    let vocab = t["model"]["vocab"].as_object_mut().unwrap();
    let mut next = 259;
    for (a, b) in merges {
        vocab.insert(format!("{a}{b}"), json!(next));
        next += 1;
    }
    t["model"]["merges"] = json!(
        merges
            .iter()
            .map(|(a, b)| format!("{a} {b}"))
            .collect::<Vec<_>>()
    );
    t["added_tokens"].as_array_mut().unwrap().push(json!({
        "id": next, "content": "<tool>", "single_word": false, "lstrip": false,
        "rstrip": false, "normalized": false, "special": false
    }));
    t["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": true},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}
    ]});
    std::fs::write(&path, t.to_string()).unwrap();
    Tokenizer::from_dir(dir).unwrap()
}

#[test]
fn a_tokenizer_with_merges_and_digits_gives_the_library_s_ids() {
    let dir = temp_dir("merges");
    let tok = with_merges(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    // The merges are in use: " the" is one token.
    assert_eq!(tok.encode(" the", false).unwrap().len(), 1);
    assert_same_ids(&tok, &random_texts(2, 3000));
}

/// A GGUF vocabulary: the byte tokenizer's (256 byte tokens, control tokens) with merges
/// (`Ġ t`, `h e`, `Ġt he`, `1 2`, `12 3`, ...) and a user-defined `<tool>`, under
/// pre-tokenizer `pre`.
fn gguf(pre: &str) -> Tokenizer {
    let mut vocab = byte_level_gguf_vocab(259).unwrap();
    let merges = [
        ("Ġ", "t"),
        ("h", "e"),
        ("Ġt", "he"),
        ("i", "n"),
        ("Ġ", "Ġ"),
        ("ĠĠ", "ĠĠ"),
        ("Ċ", "Ċ"),
        ("'", "s"),
        ("1", "2"),
        ("12", "3"),
        ("2", "0"),
        ("20", "2"),
    ];
    for (a, b) in merges {
        vocab.tokens.push(format!("{a}{b}"));
        vocab.token_types.push(1);
    }
    vocab.merges = merges.iter().map(|(a, b)| format!("{a} {b}")).collect();
    vocab.tokens.push("<tool>".into());
    vocab.token_types.push(4);
    vocab.pre = Some(pre.into());
    // Llama 3's default: BOS added by a post-processor (so only `add_special_tokens: false`
    // takes the ids-only path there).
    vocab.add_bos_token = (pre != "llama-bpe").then_some(false);
    Tokenizer::from_gguf_vocab(&vocab).unwrap()
}

#[test]
fn every_gguf_pre_tokenizer_gives_the_library_s_ids() {
    for (seed, pre) in [(3, "gpt-2"), (4, "smollm"), (5, "llama-bpe"), (6, "qwen2")] {
        let tok = gguf(pre);
        // The merges are in use: " the" is one token.
        assert_eq!(tok.encode(" the", false).unwrap().len(), 1, "{pre}");
        // The post-processor's special tokens (Llama 3's BOS) are added on the same path.
        assert!(format!("{tok:?}").contains("post: Some("), "{pre}: {tok:?}");
        if pre == "llama-bpe" {
            assert_eq!(tok.encode("he", true).unwrap()[0], 256, "BOS first");
        }
        assert_same_ids(&tok, &random_texts(seed, 2000));
    }
}

/// A pipeline the ids-only path does not run exactly (here a normalizer) takes the library's.
#[test]
fn other_tokenizers_take_the_library_s_path() {
    let dir = temp_dir("normalizer");
    let mut tok = with_merges(&dir);
    let path = dir.join("tokenizer.json");
    let mut t: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    t["normalizer"] = json!({"type": "NFC"});
    std::fs::write(&path, t.to_string()).unwrap();
    tok = Tokenizer::from_dir(&dir).unwrap_or(tok);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(format!("{tok:?}").contains("ids_only: None"), "{tok:?}");
    assert_eq!(
        tok.encode("the 12", false).unwrap(),
        tok.encode_reference("the 12", false).unwrap()
    );
}
