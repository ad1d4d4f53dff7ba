//! `cargo fuzz run sse_capture`: the body and its property are `pd_fuzz_bodies::sse_capture`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| pd_fuzz_bodies::sse_capture::run(data));
