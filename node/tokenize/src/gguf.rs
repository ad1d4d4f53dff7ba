//! [`GgufVocab`]: the tokenizer a GGUF file carries in its `tokenizer.ggml.*` metadata, as plain
//! data, turned into the Hugging Face files [`crate::Tokenizer::from_files`] builds from.
//!
//! Only byte-level BPE vocabularies (`tokenizer.ggml.model = gpt2`: GPT-2, SmolLM, Qwen2,
//! Llama 3) are supported; each pre-tokenizer name is mapped to the `tokenizer.json`
//! pre-tokenizer of the model it names, and unknown names are refused rather than approximated.
//! SentencePiece vocabularies (`llama`) and the others are refused, naming the model.
//!
//! The caller (the model crate) reads the GGUF; this module never sees a file.

use std::collections::{BTreeMap, HashMap};

use serde_json::{Map, Value as Json, json};

use crate::error::TokenizeError;

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
mod token_type {
    pub(super) const NORMAL: i32 = 1;
    pub(super) const UNKNOWN: i32 = 2;
    pub(super) const CONTROL: i32 = 3;
    pub(super) const USER_DEFINED: i32 = 4;
    pub(super) const UNUSED: i32 = 5;
    pub(super) const BYTE: i32 = 6;
}

/// The tokenizer of a GGUF file (`tokenizer.ggml.*` and `tokenizer.chat_template`), as read from
/// its metadata. Keys a file lacks are `None`, empty or `false`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`: `gpt2` (byte-level BPE) is supported; `llama` (SentencePiece)
    /// and others are refused.
    pub model: String,
    /// `tokenizer.ggml.pre`: the pre-tokenizer's name (`smollm`, `qwen2`, `llama-bpe`,
    /// `gpt-2`, ...).
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`: the vocabulary; index = token id.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type`, one per token (1 normal, 2 unknown, 3 control,
    /// 4 user-defined, 5 unused, 6 byte); empty means all normal.
    pub token_types: Vec<i32>,
    /// `tokenizer.ggml.merges`: BPE merges in priority order, `"left right"`.
    pub merges: Vec<String>,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos_token_id: Option<u32>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos_token_id: Option<u32>,
    /// `tokenizer.ggml.eot_token_id` (end of turn; also stops generation).
    pub eot_token_id: Option<u32>,
    /// `tokenizer.ggml.unknown_token_id`.
    pub unknown_token_id: Option<u32>,
    /// `tokenizer.ggml.padding_token_id`.
    pub padding_token_id: Option<u32>,
    /// `tokenizer.ggml.add_bos_token`; `None` takes llama.cpp's default for the pre-tokenizer
    /// (true for Llama 3, false otherwise).
    pub add_bos_token: Option<bool>,
    /// `tokenizer.ggml.add_eos_token`.
    pub add_eos_token: Option<bool>,
    /// `tokenizer.chat_template`.
    pub chat_template: Option<String>,
}

/// A pre-tokenizer this module implements, by the names llama.cpp gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PreTokenizer {
    /// GPT-2's regex (`'s|'t|... ?\p{L}+| ?\p{N}+|...`) inside byte-level.
    Gpt2,
    /// SmolLM: every digit alone, then GPT-2's regex.
    SmolLm,
    /// Llama 3: its own regex (digits in runs of at most three), then byte-level without regex.
    Llama3,
    /// Qwen2: Llama 3's regex with digits one by one, then byte-level without regex.
    Qwen2,
}

/// The names accepted, for error messages.
const SUPPORTED_PRE: &str = "gpt-2, smollm, llama-bpe (llama3, llama-v3), qwen2";

/// Llama 3's split regex, as in its `tokenizer.json` (and llama.cpp's `LLAMA3` pre-type).
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split regex, as in its `tokenizer.json` (and llama.cpp's `QWEN2` pre-type).
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

impl PreTokenizer {
    fn from_name(name: Option<&str>) -> Result<Self, TokenizeError> {
        Ok(match name {
            Some("gpt-2") => Self::Gpt2,
            Some("smollm") => Self::SmolLm,
            Some("llama-bpe" | "llama3" | "llama-v3") => Self::Llama3,
            Some("qwen2") => Self::Qwen2,
            other => {
                return Err(TokenizeError::UnsupportedGguf {
                    what: format!(
                        "pre-tokenizer {:?} (tokenizer.ggml.pre); supported: {SUPPORTED_PRE}",
                        other.unwrap_or("<none>")
                    ),
                });
            }
        })
    }

    /// The `pre_tokenizer` object of `tokenizer.json`.
    fn to_json(self) -> Json {
        let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
        let split = |regex: &str| json!({"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false});
        match self {
            Self::Gpt2 => byte_level(true),
            Self::SmolLm => json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                byte_level(true),
            ]}),
            Self::Llama3 => json!({"type": "Sequence", "pretokenizers": [
                split(LLAMA3_REGEX),
                byte_level(false),
            ]}),
            Self::Qwen2 => json!({"type": "Sequence", "pretokenizers": [
                split(QWEN2_REGEX),
                byte_level(false),
            ]}),
        }
    }
}

impl GgufVocab {
    /// The Hugging Face files equivalent to this vocabulary, as [`crate::Tokenizer::from_files`]
    /// takes them (and [`crate::Tokenizer::files`] hands them out):
    /// - `tokenizer.json`: a BPE model over `tokens` and `merges` (byte-level, no
    ///   normalizer), the pre-tokenizer `pre` names, control tokens as special added tokens and
    ///   user-defined ones as added tokens, a post-processor adding BOS/EOS when the GGUF asks;
    /// - `tokenizer_config.json`: the BOS/EOS/UNK/PAD token strings and `chat_template`;
    /// - `generation_config.json`: `eos_token_id` = the EOS and EOT ids.
    ///
    /// # Errors
    /// [`TokenizeError::UnsupportedGguf`] naming what is not supported (tokenizer model,
    /// pre-tokenizer, token type) or inconsistent (a token id out of range, a duplicate token, a
    /// merge that is not two tokens).
    pub fn to_files(&self) -> Result<BTreeMap<String, String>, TokenizeError> {
        let unsupported = |what: String| Err(TokenizeError::UnsupportedGguf { what });
        match self.model.as_str() {
            "gpt2" => {}
            "llama" => {
                return unsupported(
                    "tokenizer model \"llama\" (SentencePiece; tokenizer.ggml.model): only \
                     byte-level BPE (\"gpt2\") vocabularies are supported"
                        .into(),
                );
            }
            other => {
                return unsupported(format!(
                    "tokenizer model {other:?} (tokenizer.ggml.model): only byte-level BPE \
                     (\"gpt2\") vocabularies are supported"
                ));
            }
        }
        let pre = PreTokenizer::from_name(self.pre.as_deref())?;
        let n = self.tokens.len();
        if n == 0 {
            return unsupported("empty vocabulary (tokenizer.ggml.tokens)".into());
        }
        if !self.token_types.is_empty() && self.token_types.len() != n {
            return unsupported(format!(
                "{} token types for {n} tokens (tokenizer.ggml.token_type)",
                self.token_types.len()
            ));
        }
        let ty = |id: usize| {
            self.token_types
                .get(id)
                .copied()
                .unwrap_or(token_type::NORMAL)
        };
        let token = |field: &str, id: Option<u32>| -> Result<Option<&str>, TokenizeError> {
            match id {
                None => Ok(None),
                Some(id) => match self.tokens.get(id as usize) {
                    Some(t) => Ok(Some(t.as_str())),
                    None => Err(TokenizeError::UnsupportedGguf {
                        what: format!("{field} {id} is outside the vocabulary of {n} tokens"),
                    }),
                },
            }
        };
        let bos = token("tokenizer.ggml.bos_token_id", self.bos_token_id)?;
        let eos = token("tokenizer.ggml.eos_token_id", self.eos_token_id)?;
        token("tokenizer.ggml.eot_token_id", self.eot_token_id)?;
        let unk = token("tokenizer.ggml.unknown_token_id", self.unknown_token_id)?;
        let pad = token("tokenizer.ggml.padding_token_id", self.padding_token_id)?;

        let mut vocab = Map::new();
        let mut seen: HashMap<&str, usize> = HashMap::with_capacity(n);
        let mut added = Vec::new();
        for (id, text) in self.tokens.iter().enumerate() {
            if let Some(first) = seen.insert(text.as_str(), id) {
                return unsupported(format!(
                    "token {text:?} appears twice in the vocabulary (ids {first} and {id})"
                ));
            }
            vocab.insert(text.clone(), json!(id));
            let special = match ty(id) {
                token_type::NORMAL | token_type::UNUSED | token_type::UNKNOWN => continue,
                token_type::CONTROL => true,
                token_type::USER_DEFINED => false,
                other => {
                    let name = if other == token_type::BYTE {
                        "6 (byte, SentencePiece only)".to_owned()
                    } else {
                        other.to_string()
                    };
                    return unsupported(format!(
                        "token type {name} of token {id} {text:?} (tokenizer.ggml.token_type)"
                    ));
                }
            };
            added.push(json!({
                "id": id, "content": text, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": special,
            }));
        }
        let merges = self
            .merges
            .iter()
            .map(|m| {
                // llama.cpp splits at the first space after the first byte (a space cannot sit
                // inside a multi-byte character, so: after the first character).
                let first = m.chars().next().map_or(0, char::len_utf8);
                match m[first..].find(' ').map(|i| i + first) {
                    Some(i) => Ok(json!([&m[..i], &m[i + 1..]])),
                    None => Err(TokenizeError::UnsupportedGguf {
                        what: format!("merge {m:?} is not two tokens (tokenizer.ggml.merges)"),
                    }),
                }
            })
            .collect::<Result<Vec<_>, _>>()?;

        let add_bos = self.add_bos_token.unwrap_or(pre == PreTokenizer::Llama3);
        let add_eos = self.add_eos_token.unwrap_or(false);
        let post_processor = post_processor(
            add_bos.then_some(bos).flatten(),
            self.bos_token_id,
            add_eos.then_some(eos).flatten(),
            self.eos_token_id,
        );
        let tokenizer = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": pre.to_json(),
            "post_processor": post_processor,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {
                "type": "BPE",
                "dropout": null,
                "unk_token": unk,
                "continuing_subword_prefix": null,
                "end_of_word_suffix": null,
                "fuse_unk": false,
                "byte_fallback": false,
                // Llama 3 takes a pre-token found whole in the vocabulary as is (llama.cpp
                // `ignore_merges`, tokenizers' `ignore_merges`).
                "ignore_merges": pre == PreTokenizer::Llama3,
                "vocab": vocab,
                "merges": merges,
            },
        });
        let config = json!({
            "add_bos_token": add_bos,
            "add_eos_token": add_eos,
            "bos_token": bos,
            "eos_token": eos,
            "unk_token": unk,
            "pad_token": pad,
            "chat_template": self.chat_template,
            "clean_up_tokenization_spaces": false,
            "tokenizer_class": "PreTrainedTokenizerFast",
        });
        let mut eos_ids: Vec<u32> = Vec::new();
        for id in [self.eos_token_id, self.eot_token_id].into_iter().flatten() {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
        let generation = json!({ "bos_token_id": self.bos_token_id, "eos_token_id": eos_ids });

        let mut files = BTreeMap::new();
        for (name, value) in [
            ("tokenizer.json", tokenizer),
            ("tokenizer_config.json", config),
            ("generation_config.json", generation),
        ] {
            let text =
                serde_json::to_string(&value).map_err(|source| TokenizeError::SerializeJson {
                    path: name.into(),
                    source,
                })?;
            files.insert(name.to_owned(), text);
        }
        Ok(files)
    }
}

/// A `TemplateProcessing` that puts `bos` before and `eos` after the sequence, or `null` when
/// neither is added.
fn post_processor(
    bos: Option<&str>,
    bos_id: Option<u32>,
    eos: Option<&str>,
    eos_id: Option<u32>,
) -> Json {
    let mut special = Map::new();
    let mut single = Vec::new();
    let mut pair = Vec::new();
    let mut add = |token: &str, id: Option<u32>| {
        special.insert(
            token.to_owned(),
            json!({"id": token, "ids": [id], "tokens": [token]}),
        );
    };
    if let Some(b) = bos {
        add(b, bos_id);
        single.push(json!({"SpecialToken": {"id": b, "type_id": 0}}));
        pair.push(json!({"SpecialToken": {"id": b, "type_id": 0}}));
    }
    single.push(json!({"Sequence": {"id": "A", "type_id": 0}}));
    pair.push(json!({"Sequence": {"id": "A", "type_id": 0}}));
    if let Some(b) = bos {
        pair.push(json!({"SpecialToken": {"id": b, "type_id": 1}}));
    }
    pair.push(json!({"Sequence": {"id": "B", "type_id": 1}}));
    if let Some(e) = eos {
        add(e, eos_id);
        single.push(json!({"SpecialToken": {"id": e, "type_id": 0}}));
        pair.push(json!({"SpecialToken": {"id": e, "type_id": 1}}));
    }
    if bos.is_none() && eos.is_none() {
        return Json::Null;
    }
    json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": special})
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Tokenizer;
    use crate::byte_level::bytes_to_unicode;

    /// 256 byte tokens (id = 3 + byte), three control tokens first, merges for `12`, `he`,
    /// `Ġhe` and `123`, then a user-defined token.
    fn vocab(pre: &str) -> GgufVocab {
        let mut tokens: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
            .map(String::from)
            .to_vec();
        let mut token_types = vec![token_type::CONTROL; 3];
        tokens.extend(bytes_to_unicode().iter().map(|c| c.to_string()));
        token_types.extend([token_type::NORMAL; 256]);
        for t in ["12", "he", "Ġhe", "123"] {
            tokens.push(t.into());
            token_types.push(token_type::NORMAL);
        }
        tokens.push("<tool>".into());
        token_types.push(token_type::USER_DEFINED);
        GgufVocab {
            model: "gpt2".into(),
            pre: Some(pre.into()),
            tokens,
            token_types,
            merges: ["1 2", "h e", "Ġ he", "12 3"].map(String::from).to_vec(),
            bos_token_id: Some(1),
            eos_token_id: Some(2),
            eot_token_id: Some(0),
            unknown_token_id: None,
            padding_token_id: Some(2),
            add_bos_token: Some(false),
            add_eos_token: None,
            chat_template: Some(
                "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}".into(),
            ),
        }
    }

    fn id(tok: &Tokenizer, t: &str) -> u32 {
        tok.token_to_id(t).expect(t)
    }

    fn bytes(tok: &Tokenizer, s: &str) -> Vec<u32> {
        s.bytes()
            .map(|b| id(tok, &bytes_to_unicode()[b as usize].to_string()))
            .collect()
    }

    #[test]
    fn smollm_splits_digits_one_by_one() {
        let tok = Tokenizer::from_gguf_vocab(&vocab("smollm")).expect("build");
        let ids = tok.encode("he 123", false).expect("encode");
        let mut want = vec![id(&tok, "he"), id(&tok, "Ġ")];
        want.extend(bytes(&tok, "123"));
        assert_eq!(ids, want);
        // The same vocabulary under GPT-2's splitting merges the digits.
        let gpt2 = Tokenizer::from_gguf_vocab(&vocab("gpt-2")).expect("build");
        assert_eq!(
            gpt2.encode("he 123", false).expect("encode"),
            vec![id(&gpt2, "he"), id(&gpt2, "Ġ"), id(&gpt2, "123")]
        );
        assert_eq!(
            gpt2.encode(" he", false).expect("encode"),
            vec![id(&gpt2, "Ġhe")]
        );
    }

    #[test]
    fn llama3_groups_three_digits_and_qwen2_one() {
        let llama3 = Tokenizer::from_gguf_vocab(&vocab("llama-bpe")).expect("build");
        let mut want = vec![id(&llama3, "123")];
        want.extend(bytes(&llama3, "4"));
        // Llama 3 adds BOS by default (no add_bos_token key).
        let mut v = vocab("llama-bpe");
        v.add_bos_token = None;
        let with_bos = Tokenizer::from_gguf_vocab(&v).expect("build");
        assert_eq!(llama3.encode("1234", true).expect("encode"), want);
        assert_eq!(
            with_bos.encode("1234", true).expect("encode"),
            [vec![1], want.clone()].concat()
        );
        assert_eq!(with_bos.encode("1234", false).expect("encode"), want);
        let qwen2 = Tokenizer::from_gguf_vocab(&vocab("qwen2")).expect("build");
        assert_eq!(
            qwen2.encode("1234", true).expect("encode"),
            bytes(&qwen2, "1234")
        );
    }

    #[test]
    fn specials_eos_template_and_round_trip() {
        let tok = Tokenizer::from_gguf_vocab(&vocab("smollm")).expect("build");
        let text = "<|im_start|>user\nhe<|im_end|><tool>";
        let ids = tok.encode(text, false).expect("encode");
        assert_eq!(ids[0], 1);
        assert_eq!(&ids[ids.len() - 2..], &[2, 263]);
        assert_eq!(tok.decode(&ids, false).expect("decode"), text);
        assert_eq!(tok.decode(&ids, true).expect("decode"), "user\nhe<tool>");
        assert_eq!(tok.eos_token_ids(), &[2, 0]);
        assert_eq!(tok.bos_token(), Some("<|im_start|>"));
        assert_eq!(tok.eos_token(), Some("<|im_end|>"));
        assert_eq!(tok.vocab_size(), 264);
        let rendered = tok
            .apply_chat_template(&[crate::ChatMessage::new("user", "hi")], true)
            .expect("render");
        assert_eq!(
            rendered,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
        // The files it hands out rebuild the same tokenizer.
        let again = Tokenizer::from_files(tok.files()).expect("rebuild");
        assert_eq!(again.fingerprint(), tok.fingerprint());
        assert_eq!(again.encode(text, false).expect("encode"), ids);
        assert!(tok.files().contains_key("tokenizer.json"));
    }

    #[test]
    fn refusals_name_what() {
        let mut v = vocab("smollm");
        v.model = "llama".into();
        let err = Tokenizer::from_gguf_vocab(&v).unwrap_err().to_string();
        assert!(
            err.contains("\"llama\"") && err.contains("SentencePiece"),
            "{err}"
        );
        let err = Tokenizer::from_gguf_vocab(&vocab("falcon"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"falcon\"") && err.contains("smollm"),
            "{err}"
        );
        let mut v = vocab("smollm");
        v.token_types[5] = token_type::BYTE;
        let err = Tokenizer::from_gguf_vocab(&v).unwrap_err().to_string();
        assert!(err.contains("token type 6"), "{err}");
        let mut v = vocab("smollm");
        v.tokens[7] = v.tokens[6].clone();
        let err = Tokenizer::from_gguf_vocab(&v).unwrap_err().to_string();
        assert!(err.contains("twice"), "{err}");
        let mut v = vocab("smollm");
        v.eos_token_id = Some(9999);
        let err = Tokenizer::from_gguf_vocab(&v).unwrap_err().to_string();
        assert!(err.contains("eos_token_id 9999"), "{err}");
        let mut v = vocab("smollm");
        v.merges.push("nospace".into());
        let err = Tokenizer::from_gguf_vocab(&v).unwrap_err().to_string();
        assert!(err.contains("nospace"), "{err}");
    }
}
