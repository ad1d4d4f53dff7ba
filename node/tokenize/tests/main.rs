//! The integration tests of pd-tokenize, one module per subject, in one test binary (one binary
//! per crate keeps CI's disk and link time down).

mod from_dir;
mod from_files;
mod ids_only;
