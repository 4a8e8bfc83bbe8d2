# Sourced by scripts/check-mac and scripts/release: the cross toolchain that checks and links the
# Mac crates on Linux, installed from package registries when missing.
#
#   rustup targets  aarch64-apple-darwin, x86_64-apple-darwin (the standard library)
#   PyPI            ziglang (clang as the C compiler for ring's and tracing-oslog's C code, with
#                   macOS libc headers) and cargo-zigbuild (sets CC/AR/linker per target for cargo)
#   repo            build-support/macos-include: our own minimal <os/log.h>, the one header the
#                   zig SDK lacks (tracing-oslog's C shim)
#
# mac_toolchain_ensure returns 3 (after printing why) when this machine cannot get the toolchain,
# e.g. rustup cannot add a target; callers that may skip turn that into a `skipped:` line.

MAC_TARGETS=(aarch64-apple-darwin x86_64-apple-darwin)
# Pinned: a newer zig can change which flags it accepts from cc-rs.
MAC_ZIGLANG_VERSION=0.17.1
MAC_CARGO_ZIGBUILD_VERSION=0.24.1
# The oldest macOS the binaries claim to run on (rustc's default for aarch64 is 11.0 too).
export MACOSX_DEPLOYMENT_TARGET=11.0

mac_toolchain_ensure() {
  local t missing=()
  for t in "${MAC_TARGETS[@]}"; do
    rustup target list --installed 2>/dev/null | grep -qx "$t" || missing+=("$t")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    if ! command -v rustup >/dev/null; then
      echo "no rustup on PATH to add ${missing[*]}" >&2
      return 3
    fi
    echo "-- rustup target add ${missing[*]}"
    if ! rustup target add "${missing[@]}"; then
      echo "rustup could not add ${missing[*]}" >&2
      return 3
    fi
  fi
  local have_zig have_zigbuild
  have_zig=$(python3 -c 'import importlib.metadata as m; print(m.version("ziglang"))' 2>/dev/null || true)
  have_zigbuild=$(cargo-zigbuild --version 2>/dev/null | awk '{print $2}' || true)
  if [ "$have_zig" != "$MAC_ZIGLANG_VERSION" ] || [ "$have_zigbuild" != "$MAC_CARGO_ZIGBUILD_VERSION" ]; then
    echo "-- pip install ziglang==$MAC_ZIGLANG_VERSION cargo-zigbuild==$MAC_CARGO_ZIGBUILD_VERSION"
    if ! python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
      "ziglang==$MAC_ZIGLANG_VERSION" "cargo-zigbuild==$MAC_CARGO_ZIGBUILD_VERSION"; then
      echo "pip could not install ziglang and cargo-zigbuild" >&2
      return 3
    fi
    hash -r
  fi
  # pip's scripts directory may not be on PATH (a --user install, a fresh virtualenv).
  if ! command -v cargo-zigbuild >/dev/null; then
    local bin
    bin=$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
    export PATH="$bin:$PATH"
    command -v cargo-zigbuild >/dev/null || { echo "cargo-zigbuild is installed but not on PATH" >&2; return 3; }
  fi
  local inc t_
  inc="$(pwd)/build-support/macos-include"
  for t in "${MAC_TARGETS[@]}"; do
    t_=${t//-/_}
    export "CFLAGS_$t_=-I$inc"
  done
}
