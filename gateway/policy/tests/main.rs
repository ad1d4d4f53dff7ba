//! The integration tests of pd-policy, one module per subject, in one test binary: each test
//! binary links the whole dependency tree, so one binary per crate keeps CI's disk and link time
//! down. Run one subject with `cargo test -p pd-policy --test policy sandbox::`.

mod common;
mod equivalence;
mod languages;
mod limits;
mod reuse;
mod sandbox;
mod slot;
mod validate;
