//! `cargo fuzz run kv_params`: the body and its property are `pd_fuzz_bodies::kv_params`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| pd_fuzz_bodies::kv_params::run(data));
