//! Generates `bindings.rs` for the system UCX (ucp + ucs) with bindgen.
//!
//! UCX is found with pkg-config (module `ucx`); when pkg-config lacks it we fall back to the
//! system include path and link `ucp` and `ucs` directly. Debian 12 ships UCX 1.13.1 in
//! `libucx-dev`; bindgen needs `libclang-dev`.

use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-env-changed=UCX_INCLUDE_DIR");

    let mut include_paths: Vec<PathBuf> = Vec::new();
    match pkg_config::Config::new()
        .atleast_version("1.10")
        .probe("ucx")
    {
        Ok(lib) => include_paths.extend(lib.include_paths),
        Err(err) => {
            println!("cargo:warning=pkg-config could not find ucx ({err}); linking -lucp -lucs");
            println!("cargo:rustc-link-lib=ucp");
            println!("cargo:rustc-link-lib=ucs");
        }
    }
    if let Ok(dir) = env::var("UCX_INCLUDE_DIR") {
        include_paths.push(PathBuf::from(dir));
    }

    let mut builder = bindgen::Builder::default()
        .header("wrapper.h")
        .rust_edition(bindgen::RustEdition::Edition2024)
        .allowlist_function("ucp_.*")
        .allowlist_function("ucs_.*")
        .allowlist_type("ucp_.*")
        .allowlist_type("ucs_.*")
        .allowlist_var("UCP_.*")
        .allowlist_var("UCS_.*")
        // Enums become plain integer constants: UCX combines enum values into bit masks.
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        // `ucs_status_t` is compared and negated as an integer; keep it a plain type alias.
        .derive_default(true)
        .layout_tests(false)
        .generate_comments(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for path in &include_paths {
        builder = builder.clang_arg(format!("-I{}", path.display()));
    }
    let bindings = builder
        .generate()
        .expect("bindgen failed on the UCX headers (is libucx-dev installed?)");

    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR is set by cargo"));
    bindings
        .write_to_file(out.join("bindings.rs"))
        .expect("write bindings.rs");
}
