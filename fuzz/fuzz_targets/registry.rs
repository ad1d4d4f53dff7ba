//! `cargo fuzz run registry`: the body and its property are `pd_fuzz_bodies::registry`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| pd_fuzz_bodies::registry::run(data));
