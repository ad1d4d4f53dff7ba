#!/usr/bin/env bash
# Installs what a fresh Debian machine with only a Rust toolchain lacks. Idempotent: each step
# checks first and does nothing when its thing is already there.
set -euo pipefail

# System packages the build, the tests or the demo need. (Later issues add UCX, protoc, cmake.)
APT_PACKAGES=(curl ca-certificates pkg-config)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo not found; install a Rust toolchain with rustup first" >&2
  exit 1
fi
# rustfmt and clippy are part of the test command.
if command -v rustup >/dev/null 2>&1; then
  for c in rustfmt clippy; do
    rustup component list --installed 2>/dev/null | grep -q "^$c" || rustup component add "$c"
  done
fi
