//! `cargo fuzz run gguf`: the body and its property are `pd_fuzz_bodies::gguf`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| pd_fuzz_bodies::gguf::run(data));
