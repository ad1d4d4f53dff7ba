//! The integration tests of pd-node, one module per subject, in one test binary (one binary per
//! crate keeps CI's disk and link time down). Run one subject with
//! `cargo test -p pd-node --test node pd::`.

mod api;
mod gateways;
mod kv_side_channel;
mod multi_turn;
mod pd;
mod real_model;
mod registry;
