//! Structured output: what a request's `response_format`, `structured_outputs` or `guided_*`
//! fields allow the model to write, as a mask over the vocabulary at every step.
//!
//! Brief overview:
//! - [`OutputSpec`] is the constraint as the client gave it (a JSON schema, any JSON object, a
//!   regular expression, a list of choices, a Lark grammar), with a fingerprint a prefill node
//!   attests its first token with.
//! - [`Vocabulary`] is built once per model from its tokenizer: each token's bytes in a trie,
//!   shared by every request. It compiles an [`OutputSpec`] into a [`TokenMatcher`], keeping
//!   the last few compiled so that a repeated schema reuses its lexer states.
//! - [`TokenMatcher`] is one sequence's position in the constraint: it masks a row of logits to
//!   the tokens that keep the output valid and advances on the token picked. `n > 1` children
//!   each clone it.
//!
//! The matching itself is [llguidance](https://github.com/guidance-ai/llguidance)'s, the library
//! vLLM and llama.cpp use for the same job. This crate does not sample, schedule, speak HTTP or
//! know the OpenAI API's field names beyond what [`OutputSpec`] records for error messages.
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

mod matcher;
mod spec;
mod vocabulary;

pub use matcher::TokenMatcher;
pub use spec::OutputSpec;
pub use vocabulary::{COMPILED_KEPT, Vocabulary};

/// Why a constraint could not be compiled or followed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GrammarError {
    /// The constraint is not valid or not supported (a bad schema, regex or grammar).
    #[error("{0}")]
    Invalid(String),
    /// The model's tokenizer cannot be used for structured output (neither byte-level nor
    /// byte-fallback BPE).
    #[error("structured output is not available for this model's tokenizer: {0}")]
    Unavailable(String),
    /// Following the constraint failed mid-generation (a limit of the matcher was reached, or
    /// no token can continue the output).
    #[error("structured output failed: {0}")]
    Failed(String),
}
