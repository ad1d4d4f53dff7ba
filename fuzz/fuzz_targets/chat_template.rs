//! `cargo fuzz run chat_template`: the body and its property are `pd_fuzz_bodies::chat_template`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| pd_fuzz_bodies::chat_template::run(data));
