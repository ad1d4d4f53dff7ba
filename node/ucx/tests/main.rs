//! The integration tests of pd-ucx, one module per subject, in one test binary (one binary per
//! crate keeps CI's disk and link time down).

mod am;
mod common;
mod cross_process;
mod rma;
mod transport;
mod vanishing_interface;
