//! Generates the tonic client and server for `proto/*.proto` with a vendored `protoc`, so the
//! build needs no system protobuf compiler.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // SAFETY: build scripts are single-threaded; nothing reads the environment concurrently.
    unsafe { std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?) };
    tonic_prost_build::configure()
        .compile_protos(&["proto/kv_peer.proto", "proto/registry.proto"], &["proto"])?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
