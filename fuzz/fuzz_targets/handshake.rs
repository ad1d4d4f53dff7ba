//! `cargo fuzz run handshake`: the body and its property are `pd_fuzz_bodies::handshake`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| pd_fuzz_bodies::handshake::run(data));
