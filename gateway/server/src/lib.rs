//! `pd-gateway`: the front door of a prefill/decode-disaggregated cluster.
//!
//! An unmodified OpenAI client talks to it; it tokenizes the prompt once (with the tokenizer
//! the nodes registered), asks a sandboxed WebAssembly routing policy where to prefill and
//! where to decode, drives the chosen prefill node (P) and decode node (D) over their OpenAI
//! HTTP API with vLLM's `kv_transfer_params` protocol, and streams D's answer back.
//!
//! Brief overview:
//! - [`proxy`]: the pingora service; one small method per phase of a request.
//! - [`picker`]: the same routing as an Endpoint Picker (Envoy's `ext_proc`) for another data
//!   plane: it names the endpoint, the data plane and the nodes carry the request.
//! - [`admission`]: how many requests are served at once, and the bounded wait for a slot.
//! - [`openai`]: what routing reads from a request and how it is rewritten for P and D.
//! - [`cluster`]: the live view of nodes, their load and prefix-cache hashes.
//! - [`registry`]: the `pd.registry.v1.NodeRegistry` service nodes stream into.
//! - [`static_node`]: nodes named on the command line instead (any server speaking vLLM's
//!   API and metrics), kept in the view by scraping them.
//! - [`route`]: the policy call with its fallback.
//! - [`spread`]: n>1 over several decode nodes: placing children, merging their answers.
//! - [`lease`]: releasing P's leases nobody will pull.
//! - [`conversation`]: what is kept between a conversation's turns: which node holds which
//!   finished turn's KV (reverse pull), and `/v1/responses` turns for `previous_response_id`.
//! - [`answer`]: what is read from a node's answer on its way out (a retained turn's params,
//!   the response object), and what is removed from it for an untrusted client.
//! - [`drain`]: what `SIGTERM` does: open requests finish before the process exits.
//! - [`decision_log`]: sampled decisions (inputs and outputs) for `GET /admin/decisions`.
//! - [`admin`]: the operator's API (policy push, rollback, dry-run, decisions, nodes).
//! - [`cases`], [`replay`], [`template`]: the policy author's tools (`pd-gateway policy test`,
//!   `replay`, `new`), which run policies here, without a cluster.
//! - [`state`]: what outlives the process (responses, the policy slot, drains, a minted token)
//!   behind one interface, with an embedded store (`--state-dir`).
//! - [`metrics`]: Prometheus metrics.
//! - [`secret`]: checking API keys and tokens.
//! - [`upstream`]: the pooled HTTP/1 client the request path calls nodes with.
//! - [`tokenizer_api`]: vLLM's `/tokenize`, `/detokenize`, `/tokenizer_info`, answered from a
//!   registered tokenizer.
//!
//! This crate does not run models or link candle (tokenizing uses `pd-tokenize`), does not move
//! KV (nodes pull from each other), and does not run policies itself (`pd-policy` does).
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]
#![deny(unused_must_use)]

pub mod admin;
pub mod admission;
pub mod answer;
pub mod cases;
pub mod cluster;
pub mod conversation;
pub mod decision_log;
pub mod drain;
pub mod error;
pub mod lease;
pub mod metrics;
pub mod openai;
pub mod picker;
pub mod proxy;
pub mod registry;
pub mod replay;
pub mod route;
pub mod secret;
pub mod spread;
pub mod state;
pub mod static_node;
pub mod template;
pub mod tokenizer_api;
pub mod upstream;
