//! The crate's single error type.

use std::path::PathBuf;

/// Boxed error as returned by the `tokenizers` crate.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Everything that can go wrong while loading, encoding, decoding or templating.
///
/// Display messages do not repeat the source error; print with the source chain
/// (e.g. anyhow's `{:#}`) to see the underlying cause.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizeError {
    /// A file of the model directory could not be read (missing, unreadable, not UTF-8).
    #[error("failed to read {}", path.display())]
    ReadFile {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A required file is not among those given to [`crate::Tokenizer::from_files`].
    #[error("missing {}", path.display())]
    MissingFile {
        /// The file.
        path: PathBuf,
    },
    /// A JSON file of the model directory is not valid JSON.
    #[error("failed to parse {} as JSON", path.display())]
    ParseJson {
        /// The file.
        path: PathBuf,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// A JSON file parsed, but a field has an unexpected shape.
    #[error("invalid field `{field}` in {}: {reason}", path.display())]
    InvalidField {
        /// The file.
        path: PathBuf,
        /// The field name.
        field: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// `tokenizer.json` could not be turned into a tokenizer.
    #[error("failed to load tokenizer from {}", path.display())]
    LoadTokenizer {
        /// The `tokenizer.json` file.
        path: PathBuf,
        /// The `tokenizers` error.
        #[source]
        source: BoxError,
    },
    /// Encoding text failed.
    #[error("failed to encode {len} bytes of text")]
    Encode {
        /// Length of the input text in bytes.
        len: usize,
        /// The `tokenizers` error.
        #[source]
        source: BoxError,
    },
    /// Decoding ids failed.
    #[error("failed to decode {len} token ids")]
    Decode {
        /// Number of ids in the input.
        len: usize,
        /// The `tokenizers` error.
        #[source]
        source: BoxError,
    },
    /// The model directory has no chat template (or only named ones and no "default").
    #[error("the tokenizer{} has no chat template", in_dir(dir))]
    NoChatTemplate {
        /// The model directory (empty for a tokenizer built from files).
        dir: PathBuf,
    },
    /// The chat template does not compile.
    #[error("invalid chat template in {}", path.display())]
    TemplateSyntax {
        /// The file the template came from.
        path: PathBuf,
        /// The minijinja error, with line information.
        #[source]
        source: minijinja::Error,
    },
    /// The chat template called `raise_exception(message)`, typically to reject the
    /// conversation (e.g. roles that do not alternate). The message is meant for the client.
    #[error("chat template error: {message}")]
    TemplateException {
        /// The message passed to `raise_exception`.
        message: String,
    },
    /// Rendering the chat template failed for another reason.
    #[error("failed to render the chat template")]
    TemplateRender {
        /// The minijinja error, with line information.
        #[source]
        source: minijinja::Error,
    },
    /// [`crate::write_byte_level_tokenizer`] was asked for a vocabulary too small for the 256
    /// bytes and the three special tokens.
    #[error("vocab_size {vocab_size} is below the minimum {min} (256 bytes + 3 special tokens)")]
    VocabTooSmall {
        /// The requested size.
        vocab_size: usize,
        /// The smallest size accepted.
        min: usize,
    },
    /// A JSON value could not be serialized for writing.
    #[error("failed to serialize {}", path.display())]
    SerializeJson {
        /// The file that was to be written.
        path: PathBuf,
        /// The serialization error.
        #[source]
        source: serde_json::Error,
    },
    /// A GGUF file's tokenizer is of a kind this crate does not build, or is inconsistent;
    /// `what` names it (tokenizer model, pre-tokenizer, token type, token).
    #[error("unsupported GGUF tokenizer: {what}")]
    UnsupportedGguf {
        /// What is not supported, with the metadata key it came from.
        what: String,
    },
    /// A file could not be written.
    #[error("failed to write {}", path.display())]
    WriteFile {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

/// ` in DIR`, or nothing for a tokenizer built from files.
fn in_dir(dir: &std::path::Path) -> String {
    if dir.as_os_str().is_empty() {
        String::new()
    } else {
        format!(" in {}", dir.display())
    }
}
