//! [`write_byte_level_tokenizer`]: a minimal byte-level BPE tokenizer for generated test
//! models.

use std::path::Path;

use serde_json::{Map, Value as Json, json};

use crate::error::TokenizeError;
use crate::gguf::GgufVocab;

/// Id of `<|endoftext|>` (the BOS and EOS token) in [`write_byte_level_tokenizer`]'s output.
pub const BYTE_LEVEL_ENDOFTEXT_ID: u32 = 256;
/// Id of `<|im_start|>` in [`write_byte_level_tokenizer`]'s output.
pub const BYTE_LEVEL_IM_START_ID: u32 = 257;
/// Id of `<|im_end|>` (also an EOS) in [`write_byte_level_tokenizer`]'s output.
pub const BYTE_LEVEL_IM_END_ID: u32 = 258;
/// Smallest `vocab_size` [`write_byte_level_tokenizer`] accepts: 256 bytes + 3 specials.
pub const BYTE_LEVEL_MIN_VOCAB_SIZE: usize = 259;

/// The Qwen2-style ChatML template written into `tokenizer_config.json`.
const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Writes `tokenizer.json` and `tokenizer_config.json` for a byte-level BPE tokenizer into
/// `dir` (created if missing), plus `generation_config.json` if `dir` has none.
///
/// Layout:
/// - ids 0..256 are the 256 bytes, **id = byte value**, each spelled with its GPT-2
///   `bytes_to_unicode` character; no merges, `ByteLevel` pre-tokenizer
///   (`add_prefix_space=false`, `use_regex=true`) and `ByteLevel` decoder, no post-processor
///   (so `add_special_tokens=true` adds nothing). Encoding any UTF-8 string yields exactly
///   its bytes, and decoding round-trips.
/// - 256 `<|endoftext|>` (bos and eos), 257 `<|im_start|>`, 258 `<|im_end|>` (also an eos),
///   then `<|reserved_K|>` special tokens (K from 0) up to `vocab_size`.
///
/// `tokenizer_config.json` carries a ChatML chat template (`<|im_start|>role\ncontent<|im_end|>\n`
/// per message, `<|im_start|>assistant\n` when `add_generation_prompt`), `bos_token`,
/// `eos_token` (`<|endoftext|>`) and `added_tokens_decoder`. Since `tokenizer_config.json`
/// can name only one EOS, `generation_config.json` lists `eos_token_id: [256, 258]`; it is
/// written only when absent so that it never overwrites a test model's own.
///
/// # Errors
/// [`TokenizeError::VocabTooSmall`] if `vocab_size < 259`, or a write failure.
pub fn write_byte_level_tokenizer(dir: &Path, vocab_size: usize) -> Result<(), TokenizeError> {
    if vocab_size < BYTE_LEVEL_MIN_VOCAB_SIZE {
        return Err(TokenizeError::VocabTooSmall {
            vocab_size,
            min: BYTE_LEVEL_MIN_VOCAB_SIZE,
        });
    }
    std::fs::create_dir_all(dir).map_err(|source| TokenizeError::WriteFile {
        path: dir.to_path_buf(),
        source,
    })?;

    let specials: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .into_iter()
        .map(str::to_owned)
        .chain((0..vocab_size - BYTE_LEVEL_MIN_VOCAB_SIZE).map(|k| format!("<|reserved_{k}|>")))
        .collect();

    let mut vocab = Map::new();
    for (byte, c) in bytes_to_unicode().into_iter().enumerate() {
        vocab.insert(c.to_string(), json!(byte));
    }
    let added_tokens: Vec<Json> = specials
        .iter()
        .enumerate()
        .map(|(i, content)| {
            json!({
                "id": 256 + i,
                "content": content,
                "single_word": false,
                "lstrip": false,
                "rstrip": false,
                "normalized": false,
                "special": true,
            })
        })
        .collect();
    let byte_level = |add_prefix_space: bool| {
        json!({
            "type": "ByteLevel",
            "add_prefix_space": add_prefix_space,
            "trim_offsets": true,
            "use_regex": true,
        })
    };
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": null,
        "pre_tokenizer": byte_level(false),
        "post_processor": null,
        "decoder": byte_level(false),
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": [],
        },
    });

    let mut added_tokens_decoder = Map::new();
    for (i, content) in specials.iter().enumerate() {
        added_tokens_decoder.insert(
            (256 + i).to_string(),
            json!({
                "content": content,
                "lstrip": false,
                "normalized": false,
                "rstrip": false,
                "single_word": false,
                "special": true,
            }),
        );
    }
    let config = json!({
        "add_bos_token": false,
        "add_eos_token": false,
        "add_prefix_space": false,
        "added_tokens_decoder": added_tokens_decoder,
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": false,
        "model_max_length": 1_048_576,
        "tokenizer_class": "PreTrainedTokenizerFast",
    });

    write_json(&dir.join("tokenizer.json"), &tokenizer)?;
    write_json(&dir.join("tokenizer_config.json"), &config)?;
    let generation_path = dir.join("generation_config.json");
    if !generation_path.exists() {
        let generation = json!({
            "bos_token_id": BYTE_LEVEL_ENDOFTEXT_ID,
            "eos_token_id": [BYTE_LEVEL_ENDOFTEXT_ID, BYTE_LEVEL_IM_END_ID],
        });
        write_json(&generation_path, &generation)?;
    }
    Ok(())
}

/// The vocabulary [`write_byte_level_tokenizer`] writes, in GGUF form (`tokenizer.ggml.*`):
/// the same ids, special tokens (as control tokens), GPT-2 pre-tokenizer, ChatML template, and
/// EOS `<|endoftext|>` with `<|im_end|>` as end-of-turn, so a generated GGUF model tokenizes
/// exactly as its Hugging Face twin.
///
/// # Errors
/// [`TokenizeError::VocabTooSmall`] if `vocab_size < 259`.
pub fn byte_level_gguf_vocab(vocab_size: usize) -> Result<GgufVocab, TokenizeError> {
    if vocab_size < BYTE_LEVEL_MIN_VOCAB_SIZE {
        return Err(TokenizeError::VocabTooSmall {
            vocab_size,
            min: BYTE_LEVEL_MIN_VOCAB_SIZE,
        });
    }
    let mut tokens: Vec<String> = bytes_to_unicode().iter().map(|c| c.to_string()).collect();
    tokens.extend(["<|endoftext|>", "<|im_start|>", "<|im_end|>"].map(String::from));
    tokens.extend((0..vocab_size - BYTE_LEVEL_MIN_VOCAB_SIZE).map(|k| format!("<|reserved_{k}|>")));
    let token_types = (0..vocab_size)
        .map(|id| if id < 256 { 1 } else { 3 })
        .collect();
    Ok(GgufVocab {
        model: "gpt2".into(),
        pre: Some("gpt-2".into()),
        tokens,
        token_types,
        merges: Vec::new(),
        bos_token_id: Some(BYTE_LEVEL_ENDOFTEXT_ID),
        eos_token_id: Some(BYTE_LEVEL_ENDOFTEXT_ID),
        eot_token_id: Some(BYTE_LEVEL_IM_END_ID),
        unknown_token_id: None,
        padding_token_id: Some(BYTE_LEVEL_ENDOFTEXT_ID),
        add_bos_token: Some(false),
        add_eos_token: Some(false),
        chat_template: Some(CHATML_TEMPLATE.into()),
    })
}

fn write_json(path: &Path, value: &Json) -> Result<(), TokenizeError> {
    let text =
        serde_json::to_string_pretty(value).map_err(|source| TokenizeError::SerializeJson {
            path: path.to_path_buf(),
            source,
        })?;
    std::fs::write(path, text).map_err(|source| TokenizeError::WriteFile {
        path: path.to_path_buf(),
        source,
    })
}

/// GPT-2's `bytes_to_unicode`: the printable character standing for each byte, indexed by
/// byte value. Printable Latin-1 bytes stand for themselves; the others map to U+0100 upward.
pub(crate) fn bytes_to_unicode() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for (byte, slot) in (0u32..).zip(table.iter_mut()) {
        let printable = (0x21..=0x7E).contains(&byte)
            || (0xA1..=0xAC).contains(&byte)
            || (0xAE..=0xFF).contains(&byte);
        let code = if printable {
            byte
        } else {
            next += 1;
            next - 1
        };
        // All codes are below U+0144, hence valid chars.
        *slot = char::from_u32(code).unwrap_or('\u{FFFD}');
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{TempDir, byte_level_tokenizer};
    use crate::{ChatMessage, Tokenizer};

    #[test]
    fn alphabet_matches_gpt2() {
        let t = bytes_to_unicode();
        assert_eq!(t[b'!' as usize], '!');
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[0], 'Ā');
        assert_eq!(t[0xA0], 'ł');
        assert_eq!(t[0xAD], 'Ń');
        let mut sorted = t.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 256);
    }

    #[test]
    fn encode_is_bytes_and_round_trips() {
        let (_dir, tok) = byte_level_tokenizer();
        for text in [
            "Hello, world!",
            "  leading and trailing spaces  \n\ttabs\r\n",
            "héllo wörld — ÿ ñ",
            "日本語のテキスト",
            "emoji 👋🏽 family 👨‍👩‍👧 flag 🇯🇵",
            "\0\u{1}\u{7f}",
            "",
        ] {
            let expected: Vec<u32> = text.bytes().map(u32::from).collect();
            for add_special in [false, true] {
                let ids = tok.encode(text, add_special).expect("encode");
                assert_eq!(ids, expected, "{text:?}");
            }
            assert_eq!(tok.decode(&expected, false).expect("decode"), text);
            assert_eq!(tok.decode(&expected, true).expect("decode"), text);
        }
    }

    #[test]
    fn special_tokens_in_text_are_single_tokens() {
        let (_dir, tok) = byte_level_tokenizer();
        let text = "<|im_start|>user\nhi<|im_end|><|endoftext|><|reserved_3|>";
        let ids = tok.encode(text, false).expect("encode");
        let mut expected = vec![BYTE_LEVEL_IM_START_ID];
        expected.extend("user\nhi".bytes().map(u32::from));
        expected.extend([BYTE_LEVEL_IM_END_ID, BYTE_LEVEL_ENDOFTEXT_ID, 259 + 3]);
        assert_eq!(ids, expected);
        assert_eq!(tok.encode(text, true).expect("encode"), expected);
        assert_eq!(tok.decode(&ids, false).expect("decode"), text);
        assert_eq!(tok.decode(&ids, true).expect("decode"), "user\nhi");
        // Partial special-token text is plain bytes.
        let plain = "<|im_start";
        let ids = tok.encode(plain, false).expect("encode");
        assert_eq!(ids, plain.bytes().map(u32::from).collect::<Vec<_>>());
    }

    #[test]
    fn vocab_specials_and_eos() {
        let (_dir, tok) = byte_level_tokenizer();
        assert_eq!(tok.vocab_size(), 300);
        assert_eq!(tok.token_to_id("<|im_end|>"), Some(BYTE_LEVEL_IM_END_ID));
        assert_eq!(tok.token_to_id("<|reserved_40|>"), Some(299));
        assert_eq!(tok.token_to_id("<|reserved_41|>"), None);
        assert_eq!(tok.id_to_token(u32::from(b' ')).as_deref(), Some("Ġ"));
        assert_eq!(
            tok.id_to_token(BYTE_LEVEL_IM_START_ID).as_deref(),
            Some("<|im_start|>")
        );
        assert_eq!(tok.id_to_token(300), None);
        assert_eq!(tok.bos_token(), Some("<|endoftext|>"));
        assert_eq!(tok.eos_token(), Some("<|endoftext|>"));
        assert_eq!(
            tok.eos_token_ids(),
            &[BYTE_LEVEL_ENDOFTEXT_ID, BYTE_LEVEL_IM_END_ID]
        );
    }

    #[test]
    fn minimum_vocab_and_too_small() {
        let dir = TempDir::new("min-vocab");
        write_byte_level_tokenizer(dir.path(), BYTE_LEVEL_MIN_VOCAB_SIZE).expect("write");
        let tok = Tokenizer::from_dir(dir.path()).expect("load");
        assert_eq!(tok.vocab_size(), BYTE_LEVEL_MIN_VOCAB_SIZE);
        let err = write_byte_level_tokenizer(dir.path(), 258);
        assert!(
            matches!(
                err,
                Err(TokenizeError::VocabTooSmall {
                    vocab_size: 258,
                    min: 259
                })
            ),
            "{err:?}"
        );
    }

    #[test]
    fn chatml_template() {
        let (_dir, tok) = byte_level_tokenizer();
        assert!(tok.has_chat_template());
        let messages = [
            ChatMessage::new("system", "You are helpful."),
            ChatMessage::new("user", "Hi 👋"),
        ];
        let text = tok.apply_chat_template(&messages, true).expect("render");
        assert_eq!(
            text,
            "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi 👋<|im_end|>\n<|im_start|>assistant\n"
        );
        let text = tok
            .apply_chat_template(&messages[1..], false)
            .expect("render");
        assert_eq!(text, "<|im_start|>user\nHi 👋<|im_end|>\n");
        let ids = tok.encode(&text, false).expect("encode");
        assert_eq!(ids.first(), Some(&BYTE_LEVEL_IM_START_ID));
        assert_eq!(
            ids.iter().filter(|&&id| id == BYTE_LEVEL_IM_END_ID).count(),
            1
        );
    }

    #[test]
    fn gguf_form_tokenizes_like_the_files() {
        let (_dir, files) = byte_level_tokenizer();
        let gguf =
            Tokenizer::from_gguf_vocab(&byte_level_gguf_vocab(300).expect("vocab")).expect("build");
        let text = "<|im_start|>user\nhéllo 123 👋<|im_end|>\n<|reserved_3|>";
        assert_eq!(
            gguf.encode(text, true).expect("encode"),
            files.encode(text, true).expect("encode")
        );
        assert_eq!(gguf.eos_token_ids(), files.eos_token_ids());
        assert_eq!(gguf.vocab_size(), files.vocab_size());
        let m = [ChatMessage::new("user", "hi")];
        assert_eq!(
            gguf.apply_chat_template(&m, true).expect("render"),
            files.apply_chat_template(&m, true).expect("render")
        );
    }

    #[test]
    fn existing_generation_config_is_kept() {
        let dir = TempDir::new("keep-gen");
        std::fs::write(
            dir.path().join("generation_config.json"),
            r#"{"eos_token_id": 7}"#,
        )
        .expect("write");
        write_byte_level_tokenizer(dir.path(), 300).expect("write");
        let tok = Tokenizer::from_dir(dir.path()).expect("load");
        assert_eq!(tok.eos_token_ids(), &[BYTE_LEVEL_ENDOFTEXT_ID, 7]);
    }
}
