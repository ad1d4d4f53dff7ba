//! [`Tokenizer`]: a Hugging Face model directory's tokenizer, stop ids and chat template.

use std::collections::BTreeMap;
use std::fmt;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use serde_json::Value as Json;
use xxhash_rust::xxh3::Xxh3Default;

use crate::byte_level_ids::ByteLevelIds;
use crate::decoder::IncrementalDecoder;
use crate::error::TokenizeError;
use crate::gguf::GgufVocab;
use crate::template::{ChatTemplate, SpecialTokens};

/// One chat message, as in the OpenAI `messages` array (text content only), as the chat
/// template sees it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ... Passed to the template verbatim.
    pub role: String,
    /// The message text.
    pub content: String,
    /// An assistant message's tool calls, as transformers hands them to templates (each
    /// call's `function.arguments` an object where the client sent a JSON string). Absent from
    /// the template's message when `None`, so `message.tool_calls is defined` holds only here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A tool message's answer to this call id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    /// Builds a message from a role and its text.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
        }
    }
}

/// The files a tokenizer is built from and must exist: `tokenizer.json`, `tokenizer_config.json`.
const REQUIRED_FILES: [&str; 2] = ["tokenizer.json", "tokenizer_config.json"];
/// The files read when present.
const OPTIONAL_FILES: [&str; 3] = [
    "chat_template.jinja",
    "generation_config.json",
    "config.json",
];

/// A model directory's tokenizer: vocabulary, special tokens, stop ids and chat template.
///
/// Loaded once with [`Tokenizer::from_dir`] (or [`Tokenizer::from_files`], from the files of
/// another node's [`Tokenizer::files`]); immutable afterwards, `Send + Sync`.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The ids-only path, when `inner`'s pipeline is one it runs exactly.
    ids_only: Option<ByteLevelIds>,
    /// The model directory, or empty when built from files (error messages only).
    dir: PathBuf,
    vocab_size: usize,
    eos_token_ids: Vec<u32>,
    special: SpecialTokens,
    chat: Option<ChatTemplate>,
    /// What it was built from (`config.json` reduced to its `eos_token_id` fields).
    files: BTreeMap<String, String>,
    fingerprint: u64,
}

impl fmt::Debug for Tokenizer {
    // The inner tokenizer's Debug prints the whole vocabulary; show a summary instead.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("dir", &self.dir)
            .field("files", &self.files.keys().collect::<Vec<_>>())
            .field("fingerprint", &format_args!("{:016x}", self.fingerprint))
            .field("vocab_size", &self.vocab_size)
            .field("eos_token_ids", &self.eos_token_ids)
            .field("special", &self.special)
            .field("has_chat_template", &self.chat.is_some())
            .field("ids_only", &self.ids_only)
            .finish()
    }
}

impl Tokenizer {
    /// Loads the tokenizer of the Hugging Face model directory `dir`.
    ///
    /// Reads:
    /// - `tokenizer.json` (required): vocabulary, normalizer, pre-tokenizer, decoder.
    /// - `tokenizer_config.json` (required): `bos_token`, `eos_token`, `unk_token`,
    ///   `pad_token` (strings or `{"content": ...}` objects) and `chat_template` (a string, or
    ///   a list of `{name, template}` of which the one named `default` is used).
    /// - `chat_template.jinja` (optional): overrides `chat_template`, as in `transformers`.
    /// - `generation_config.json` and `config.json` (optional): `eos_token_id`, an integer or
    ///   a list (also `text_config.eos_token_id` in `config.json`).
    ///
    /// The same as [`Tokenizer::from_files`] over those files.
    ///
    /// # Errors
    /// A required file is missing or unreadable ([`TokenizeError::ReadFile`] names it), a file
    /// is not valid JSON, `tokenizer.json` is not a valid tokenizer, or the chat template does
    /// not compile.
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizeError> {
        let mut files = BTreeMap::new();
        for name in REQUIRED_FILES {
            files.insert(name.to_owned(), read_required(&dir.join(name))?);
        }
        for name in OPTIONAL_FILES {
            if let Some(text) = read_optional(&dir.join(name))? {
                files.insert(name.to_owned(), text);
            }
        }
        Self::build(files, dir)
    }

    /// Builds the tokenizer from the contents of a model directory's files, keyed by file name
    /// (the names [`Tokenizer::from_dir`] reads; others are ignored). Exactly what `from_dir`
    /// builds from a directory holding these files: a gateway given a node's
    /// [`Tokenizer::files`] tokenizes and renders chat templates as the node does.
    ///
    /// # Errors
    /// [`TokenizeError::MissingFile`] without `tokenizer.json` or `tokenizer_config.json`; then
    /// as [`Tokenizer::from_dir`] (errors name the file alone).
    pub fn from_files(files: &BTreeMap<String, String>) -> Result<Self, TokenizeError> {
        let known = files
            .iter()
            .filter(|(name, _)| {
                REQUIRED_FILES.contains(&name.as_str()) || OPTIONAL_FILES.contains(&name.as_str())
            })
            .map(|(name, text)| (name.clone(), text.clone()))
            .collect();
        Self::build(known, Path::new(""))
    }

    /// Builds the tokenizer a GGUF file describes (see [`GgufVocab::to_files`]): exactly
    /// [`Tokenizer::from_files`] over the equivalent Hugging Face files, which are then its
    /// [`Tokenizer::files`], so a gateway rebuilds it without the GGUF.
    ///
    /// # Errors
    /// [`TokenizeError::UnsupportedGguf`] naming what is not supported (a SentencePiece
    /// vocabulary, an unknown pre-tokenizer...); then as [`Tokenizer::from_files`].
    pub fn from_gguf_vocab(vocab: &GgufVocab) -> Result<Self, TokenizeError> {
        Self::build(vocab.to_files()?, Path::new(""))
    }

    /// The one loading path: `files` holds only known names; `dir` prefixes paths in errors.
    fn build(mut files: BTreeMap<String, String>, dir: &Path) -> Result<Self, TokenizeError> {
        let file = |name: &str| files.get(name).map(String::as_str);
        let required = |name: &str| {
            file(name).ok_or_else(|| TokenizeError::MissingFile {
                path: dir.join(name),
            })
        };

        let tokenizer_path = dir.join("tokenizer.json");
        // `tokenizers` panics on some malformed files (an `expect` in its decoder's
        // deserializer; found by the `registry` fuzz target): a file from outside (a node's
        // registration, on the gateway) must be an error, never a crash.
        let text = required("tokenizer.json")?;
        let inner = std::panic::catch_unwind(|| text.parse::<tokenizers::Tokenizer>())
            .unwrap_or_else(|_| Err("the tokenizers library panicked reading it".into()))
            .map_err(|source| TokenizeError::LoadTokenizer {
                path: tokenizer_path.clone(),
                source,
            })?;

        let config_path = dir.join("tokenizer_config.json");
        let config = parse_json(&config_path, required("tokenizer_config.json")?)?;

        let special = SpecialTokens {
            bos: special_token(&config, &config_path, "bos_token")?,
            eos: special_token(&config, &config_path, "eos_token")?,
            unk: special_token(&config, &config_path, "unk_token")?,
            pad: special_token(&config, &config_path, "pad_token")?,
        };

        let mut eos_token_ids = Vec::new();
        if let Some(id) = special.eos.as_deref().and_then(|t| inner.token_to_id(t)) {
            eos_token_ids.push(id);
        }
        let mut model_config = None;
        for name in ["generation_config.json", "config.json"] {
            let path = dir.join(name);
            let Some(text) = file(name) else {
                continue;
            };
            let json = parse_json(&path, text)?;
            let mut fields = vec![json.get("eos_token_id")];
            if name == "config.json" {
                fields.push(json.get("text_config").and_then(|t| t.get("eos_token_id")));
            }
            for field in fields.into_iter().flatten() {
                for id in token_ids(field, &path)? {
                    if !eos_token_ids.contains(&id) {
                        eos_token_ids.push(id);
                    }
                }
            }
            if name == "config.json" {
                model_config = Some(eos_fields_only(&json));
            }
        }
        let chat =
            match chat_template_source(dir, file("chat_template.jinja"), &config, &config_path)? {
                Some((source, path)) => Some(ChatTemplate::new(&source, special.clone(), &path)?),
                None => None,
            };

        // Added tokens may sit above the base vocabulary with gaps; count up to the highest id.
        let max_added = inner
            .get_added_tokens_decoder()
            .keys()
            .max()
            .map_or(0, |&id| id as usize + 1);
        let vocab_size = inner.get_vocab_size(true).max(max_added);

        // The model's config.json carries far more than the tokenizer needs (and differs
        // between checkpoints of one tokenizer): keep only what was read from it.
        if let Some(reduced) = model_config {
            files.insert("config.json".to_owned(), reduced);
        }
        let fingerprint = fingerprint(&files);

        Ok(Self {
            ids_only: ByteLevelIds::for_tokenizer(&inner),
            inner,
            dir: dir.to_path_buf(),
            vocab_size,
            eos_token_ids,
            special,
            chat,
            files,
            fingerprint,
        })
    }

    /// The files this tokenizer was built from, by name, as [`Tokenizer::from_files`] takes
    /// them: `tokenizer.json`, `tokenizer_config.json`, and those of `chat_template.jinja`,
    /// `generation_config.json` and `config.json` that exist. `config.json` is reduced to its
    /// `eos_token_id` and `text_config.eos_token_id` (all the tokenizer reads of it).
    pub fn files(&self) -> &BTreeMap<String, String> {
        &self.files
    }

    /// xxh3-64 of [`Tokenizer::files`]: for each file in name order, the name's length in
    /// bytes (u64, little-endian), the name, the content's length (u64, little-endian) and the
    /// content, hashed as one stream with seed 0. Equal fingerprints mean equal files, so
    /// equal tokenization and chat templates.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// Encodes `text` to token ids.
    ///
    /// A byte-level BPE tokenizer (GPT-2's family, SmolLM2's) is run without the `tokenizers`
    /// library's offset bookkeeping, ~3× faster, to the same ids (see
    /// [`Tokenizer::encode_reference`]); others through the library.
    ///
    /// Special tokens written in `text` (e.g. `<|im_start|>`) are always recognised as single
    /// tokens, as with `transformers`' default `split_special_tokens=False`.
    /// `add_special_tokens` only controls the tokenizer's post-processor (e.g. a BOS token
    /// prepended by Llama tokenizers); pass `false` for text from
    /// [`Tokenizer::apply_chat_template`], which already contains it.
    ///
    /// # Errors
    /// [`TokenizeError::Encode`] if the tokenizer fails (e.g. an unknown token without an
    /// `unk_token` to fall back to).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        match &self.ids_only {
            Some(fast) if fast.serves(add_special_tokens) => fast
                .encode(self.inner.get_model(), text, add_special_tokens)
                .map_err(|source| TokenizeError::Encode {
                    len: text.len(),
                    source,
                }),
            _ => self.encode_reference(text, add_special_tokens),
        }
    }

    /// [`Tokenizer::encode`] through the `tokenizers` library's whole pipeline, also for the
    /// tokenizers [`Tokenizer::encode`] takes a shorter way with (byte-level BPE: the same
    /// ids without the library's offsets and per-token strings). For checking one against the
    /// other.
    ///
    /// # Errors
    /// As [`Tokenizer::encode`].
    pub fn encode_reference(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        let encoding = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|source| TokenizeError::Encode {
                len: text.len(),
                source,
            })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Decodes ids to text. Ids outside the vocabulary are skipped, as `tokenizers` does.
    ///
    /// Incomplete UTF-8 sequences decode to U+FFFD. No `clean_up_tokenization_spaces` pass is
    /// applied (vLLM and TGI do not apply it to generated text either).
    ///
    /// # Errors
    /// [`TokenizeError::Decode`] if the tokenizer's decoder fails.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizeError> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|source| TokenizeError::Decode {
                len: ids.len(),
                source,
            })
    }

    /// Number of token ids, added tokens included (one more than the highest id).
    ///
    /// A model's embedding may be larger (padded); ids in between decode to nothing.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Ids that end generation: the union, in this order, of `tokenizer_config.json`
    /// `eos_token`, `generation_config.json` `eos_token_id` and `config.json` `eos_token_id`.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    /// The `bos_token` of `tokenizer_config.json`, if any.
    pub fn bos_token(&self) -> Option<&str> {
        self.special.bos.as_deref()
    }

    /// The `eos_token` of `tokenizer_config.json`, if any.
    pub fn eos_token(&self) -> Option<&str> {
        self.special.eos.as_deref()
    }

    /// The id of `token` (a vocabulary string such as `<|im_end|>`, or `Ġthe` for byte-level
    /// vocabularies), if it exists.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The vocabulary string of `id`, if it exists.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Whether the directory has a (default) chat template.
    pub fn has_chat_template(&self) -> bool {
        self.chat.is_some()
    }

    /// The chat template's source (the default one), if any.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat.as_ref().map(|c| c.source())
    }

    /// The `pad_token` of `tokenizer_config.json`, if any.
    pub fn pad_token(&self) -> Option<&str> {
        self.special.pad.as_deref()
    }

    /// The `unk_token` of `tokenizer_config.json`, if any.
    pub fn unk_token(&self) -> Option<&str> {
        self.special.unk.as_deref()
    }

    /// Renders the chat template (tokenizer_config.json "chat_template", string or list of
    /// `{name, template}` with the "default" one used, or `chat_template.jinja`) with
    /// `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `unk_token`,
    /// `pad_token`, `tools = none`, `documents = none`, and the `raise_exception` /
    /// `strftime_now` helpers, like `transformers` does.
    ///
    /// Whether the rendered text then gets `add_special_tokens = false` when encoding is the
    /// caller's business; `transformers` does so because templates include the BOS token
    /// themselves, and callers should do the same.
    ///
    /// # Errors
    /// [`TokenizeError::NoChatTemplate`] if there is none, [`TokenizeError::TemplateException`]
    /// if the template rejects the conversation via `raise_exception`, and
    /// [`TokenizeError::TemplateRender`] for other template failures.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizeError> {
        self.apply_chat_template_with_tools(messages, None, add_generation_prompt)
    }

    /// [`Tokenizer::apply_chat_template`] with the request's `tools` (OpenAI's list of
    /// `{"type": "function", "function": {...}}`) given to the template as `tools`, as
    /// transformers' `apply_chat_template(tools=...)` does; `None` leaves `tools` none.
    ///
    /// # Errors
    /// As [`Tokenizer::apply_chat_template`].
    pub fn apply_chat_template_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, TokenizeError> {
        let chat = self
            .chat
            .as_ref()
            .ok_or_else(|| TokenizeError::NoChatTemplate {
                dir: self.dir.clone(),
            })?;
        chat.render(messages, tools, add_generation_prompt)
    }

    /// A fresh streaming detokenizer for one sequence's generated tokens.
    pub fn decoder(&self, skip_special_tokens: bool) -> IncrementalDecoder {
        IncrementalDecoder::new(skip_special_tokens)
    }

    /// A streaming detokenizer that uses the last few `prompt_ids` as context, as vLLM does,
    /// so that the first generated token decodes as it would mid-text (e.g. keeps the leading
    /// space that SentencePiece decoders strip at the start of a string).
    pub fn decoder_with_prompt(
        &self,
        skip_special_tokens: bool,
        prompt_ids: &[u32],
    ) -> IncrementalDecoder {
        IncrementalDecoder::with_context(skip_special_tokens, prompt_ids)
    }

    /// The underlying `tokenizers` tokenizer, for what this API does not cover (offsets,
    /// batch encoding).
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

fn read_required(path: &Path) -> Result<String, TokenizeError> {
    std::fs::read_to_string(path).map_err(|source| TokenizeError::ReadFile {
        path: path.to_path_buf(),
        source,
    })
}

fn read_optional(path: &Path) -> Result<Option<String>, TokenizeError> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TokenizeError::ReadFile {
            path: path.to_path_buf(),
            source,
        }),
    }
}

fn parse_json(path: &Path, text: &str) -> Result<Json, TokenizeError> {
    serde_json::from_str(text).map_err(|source| TokenizeError::ParseJson {
        path: path.to_path_buf(),
        source,
    })
}

/// A special token of `tokenizer_config.json`: a string, an `{"content": ...}` object
/// (serialized `AddedToken`), or null/absent.
fn special_token(
    config: &Json,
    path: &Path,
    field: &'static str,
) -> Result<Option<String>, TokenizeError> {
    match config.get(field) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Object(obj)) => match obj.get("content") {
            Some(Json::String(s)) => Ok(Some(s.clone())),
            _ => Err(TokenizeError::InvalidField {
                path: path.to_path_buf(),
                field,
                reason: "object without a string `content`",
            }),
        },
        Some(_) => Err(TokenizeError::InvalidField {
            path: path.to_path_buf(),
            field,
            reason: "expected a string, an object with `content`, or null",
        }),
    }
}

/// `eos_token_id`: an integer, a list of integers, or null.
fn token_ids(value: &Json, path: &Path) -> Result<Vec<u32>, TokenizeError> {
    let invalid = || TokenizeError::InvalidField {
        path: path.to_path_buf(),
        field: "eos_token_id",
        reason: "expected a token id, a list of token ids, or null",
    };
    let one = |v: &Json| {
        v.as_u64()
            .and_then(|id| u32::try_from(id).ok())
            .ok_or_else(invalid)
    };
    match value {
        Json::Null => Ok(Vec::new()),
        Json::Array(items) => items.iter().map(one).collect(),
        v => Ok(vec![one(v)?]),
    }
}

/// See [`Tokenizer::fingerprint`].
fn fingerprint(files: &BTreeMap<String, String>) -> u64 {
    let mut h = Xxh3Default::new();
    for (name, content) in files {
        h.update(&(name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
        h.update(&(content.len() as u64).to_le_bytes());
        h.update(content.as_bytes());
    }
    h.digest()
}

/// `config.json` reduced to the fields the tokenizer reads (`eos_token_id`,
/// `text_config.eos_token_id`), those present only.
fn eos_fields_only(config: &Json) -> String {
    let mut out = serde_json::Map::new();
    if let Some(v) = config.get("eos_token_id") {
        out.insert("eos_token_id".to_owned(), v.clone());
    }
    if let Some(v) = config
        .get("text_config")
        .and_then(|t| t.get("eos_token_id"))
    {
        let mut text_config = serde_json::Map::new();
        text_config.insert("eos_token_id".to_owned(), v.clone());
        out.insert("text_config".to_owned(), Json::Object(text_config));
    }
    Json::Object(out).to_string()
}

/// The template source and the file it came from: `chat_template.jinja` if present, else
/// `tokenizer_config.json`'s `chat_template`.
fn chat_template_source(
    dir: &Path,
    jinja: Option<&str>,
    config: &Json,
    config_path: &Path,
) -> Result<Option<(String, PathBuf)>, TokenizeError> {
    if let Some(source) = jinja {
        return Ok(Some((source.to_owned(), dir.join("chat_template.jinja"))));
    }
    let invalid = |reason| TokenizeError::InvalidField {
        path: config_path.to_path_buf(),
        field: "chat_template",
        reason,
    };
    let source = match config.get("chat_template") {
        None | Some(Json::Null) => None,
        Some(Json::String(s)) => Some(s.clone()),
        Some(Json::Array(items)) => {
            let mut default = None;
            for item in items {
                match (item.get("name"), item.get("template")) {
                    (Some(Json::String(name)), Some(Json::String(template))) => {
                        if name == "default" {
                            default = Some(template.clone());
                        }
                    }
                    _ => return Err(invalid("list entries must be {name, template} strings")),
                }
            }
            default
        }
        Some(_) => return Err(invalid("expected a string or a list of {name, template}")),
    };
    Ok(source.map(|s| (s, config_path.to_path_buf())))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by the `registry` fuzz target (fuzz/): `tokenizers` 0.23 panics on a raw control
    /// character inside the decoder's object instead of answering an error.
    #[test]
    fn a_tokenizer_json_that_makes_tokenizers_panic_is_an_error() {
        let files = BTreeMap::from([
            (
                "tokenizer.json".to_string(),
                "{\"decoder\": {\"type\": \"ByteLe\nx\"}}".to_string(),
            ),
            ("tokenizer_config.json".to_string(), "{}".to_string()),
        ]);
        let got = Tokenizer::from_files(&files);
        assert!(
            matches!(got, Err(TokenizeError::LoadTokenizer { .. })),
            "{got:?}"
        );
    }

    #[test]
    fn tokenizer_is_send_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Tokenizer>();
    }

    #[test]
    fn eos_token_id_shapes() {
        let p = Path::new("x.json");
        assert_eq!(token_ids(&serde_json::json!(2), p).ok(), Some(vec![2]));
        assert_eq!(
            token_ids(&serde_json::json!([1, 2]), p).ok(),
            Some(vec![1, 2])
        );
        assert_eq!(token_ids(&serde_json::json!(null), p).ok(), Some(vec![]));
        assert!(token_ids(&serde_json::json!("a"), p).is_err());
        assert!(token_ids(&serde_json::json!(-1), p).is_err());
    }
}
