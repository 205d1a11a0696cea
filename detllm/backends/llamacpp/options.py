"""The `llamacpp` backend's `--opt` settings (`LlamaCppOptions`) and the checks that refuse a
bad one before a server starts. What each maps to on llama-server's command line is backend.py's
`argv`; what was in effect, its `determinism`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...core.config import MAX_BATCH, floats, ints, ranged
from ...core.errors import UsageError

DEFAULT_CTX = 1024  # tokens per slot when --opt ctx_size is not given (capped at the model's training context)
FLASH_ATTN = ("on", "off", "auto")
KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")  # llama-server -ctk/-ctv


@dataclass(frozen=True)
class LlamaCppOptions:
    bin: str | None = None  # llama.cpp bin folder or llama-server path; else DETLLM_LLAMA_BIN, PATH, build cache
    threads: int | None = ranged(None, ints(1, 1024))  # -t generation threads; None: --threads, else llama.cpp's default (recorded)
    threads_batch: int | None = ranged(None, ints(1, 1024))  # -tb prompt-processing threads; None: same as threads
    batch: int | None = ranged(None, ints(1, 1 << 20))  # -b logical batch in tokens; None: llama.cpp default (2048)
    ubatch: int | None = ranged(None, ints(1, 1 << 20))  # -ub physical batch in tokens (one graph evaluation); None: default (512)
    slots: int | None = ranged(None, ints(1, MAX_BATCH))  # -np parallel sequences; None: the largest batch size of the run
    ctx_size: int | None = ranged(None, ints(1, 1 << 24))  # context per slot in tokens; None: min(1024, the model's training context)
    cache_prompt: bool = False  # reuse a slot's KV cache across requests: faster, a known nondeterminism source
    flash_attn: str | None = None  # -fa on|off|auto; None keeps llama.cpp's default (auto)
    kv_type: str | None = None  # -ctk/-ctv KV cache type (f32, f16, q8_0...); None: llama.cpp's default (f16)
    port: int | None = ranged(None, ints(1, 65535))  # fixed port on 127.0.0.1; None picks a free one
    startup_timeout: float = ranged(120.0, floats(0, 86400, lo_open=True))  # seconds to wait for the server's /health
    request_timeout: float = ranged(600.0, floats(0, 86400, lo_open=True))  # seconds one HTTP request may take


def validate(o: LlamaCppOptions) -> None:
    for name in ("threads", "threads_batch", "batch", "ubatch", "slots", "ctx_size", "port"):
        value = getattr(o, name)
        if value is not None and value < 1:
            raise UsageError(f"--opt {name} must be at least 1, got {value}")
    if o.flash_attn is not None and o.flash_attn not in FLASH_ATTN:
        raise UsageError(f"--opt flash_attn must be one of {', '.join(FLASH_ATTN)}, got {o.flash_attn!r}")
    if o.kv_type is not None and o.kv_type not in KV_TYPES:
        raise UsageError(f"--opt kv_type must be one of {', '.join(KV_TYPES)}, got {o.kv_type!r}")
    if o.startup_timeout <= 0 or o.request_timeout <= 0:
        raise UsageError("--opt startup_timeout and request_timeout must be positive seconds")


__all__ = ["DEFAULT_CTX", "FLASH_ATTN", "KV_TYPES", "LlamaCppOptions", "validate"]
