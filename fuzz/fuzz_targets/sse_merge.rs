//! `cargo fuzz run sse_merge`: the body and its property are `pd_fuzz_bodies::sse_merge`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| pd_fuzz_bodies::sse_merge::run(data));
