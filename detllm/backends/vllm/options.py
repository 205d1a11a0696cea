"""The vllm backend's settings: what can be asked (`VLLMOptions`, checked before an engine
starts) and what was in effect (the `Applied` list, read back from the running engine's
config and env). Imports no vLLM: the engine's config object is passed in.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ...config import MAX_BATCH, floats, ints, ranged
from ...errors import UsageError
from ..base import Applied

MIN_MAX_LOGPROBS = 20  # vLLM's own default cap on logprobs per step


@dataclass(frozen=True)
class VLLMOptions:
    max_num_seqs: int = ranged(8, ints(1, MAX_BATCH))  # sequences scheduled together; a batch larger than this runs in waves
    enforce_eager: bool | None = None  # None: True on CPU (no compile step), False on GPU (CUDA graphs)
    max_model_len: int = ranged(512, ints(1, 1 << 24))  # context the KV cache is sized for; prompt + new tokens must fit
    gpu_memory_utilization: float = ranged(0.9, floats(0, 1, lo_open=True))  # share of GPU memory vLLM may reserve (unused on CPU: kv_cache_gib)
    tensor_parallel_size: int = ranged(1, ints(1, 1024))  # GPUs the weights are split over; > 1 adds all-reduce order to the numerics
    attention_backend: str = ""  # force one (FLASH_ATTN, TRITON_ATTN, ...); "" lets vLLM choose
    batch_invariant: bool = False  # VLLM_BATCH_INVARIANT=1: batch-invariant kernels, needed for tier 3
    kv_cache_gib: int | None = ranged(None, ints(1, 65536))  # KV cache size; None: 1 GiB on CPU (VLLM_CPU_KVCACHE_SPACE), vLLM's choice on GPU
    prefix_caching: bool = False  # reuse KV of shared prefixes: warm and cold cache may compute differently
    perturb: str = ""  # TEST-ONLY (detllm.perturb): MODULE:output|weight:REL[@STEP], applied through hooks on the running engine


def validate(opts: VLLMOptions, platform: str) -> None:
    """Refuse options no engine on this build ("cpu" or "gpu") could honour, before one starts."""
    for name in ("max_num_seqs", "max_model_len", "tensor_parallel_size"):
        if getattr(opts, name) < 1:
            raise UsageError(f"--opt {name} must be at least 1, got {getattr(opts, name)}")
    if not 0.0 < opts.gpu_memory_utilization <= 1.0:
        raise UsageError(f"--opt gpu_memory_utilization must be in (0, 1], got {opts.gpu_memory_utilization}")
    if opts.kv_cache_gib is not None and opts.kv_cache_gib < 1:
        raise UsageError(f"--opt kv_cache_gib must be at least 1, got {opts.kv_cache_gib}")
    if platform == "cpu" and opts.tensor_parallel_size > 1:
        raise UsageError("--opt tensor_parallel_size > 1 is not supported by detllm's in-process CPU engine",
                         hint="use tensor_parallel_size=1 on CPU")


def applied(vc: Any, opts: VLLMOptions, *, dtype_asked: str, enforce_eager: bool, platform: str,
            batch_invariance: tuple[bool, str], attention: str | None, seed: int, threads: int | None,
            threads_now: int) -> list[Applied]:
    """Each setting as asked and as the running engine has it (`vc`: its VllmConfig)."""
    env = os.environ
    dtype = str(vc.model_config.dtype).replace("torch.", "")
    bi_ok, bi_why = batch_invariance
    kv_note = "VLLM_CPU_KVCACHE_SPACE (GiB)" if platform == "cpu" else "kv_cache_memory_bytes" if opts.kv_cache_gib else "sized by gpu_memory_utilization"
    sched = vc.scheduler_config
    return [
        Applied("seed", seed, True, seed, "SamplingParams.seed per request, from (seed, prompt_index); engine seed fixed at 0"),
        Applied("dtype", dtype_asked, dtype_asked in ("auto", dtype), dtype),
        Applied("max_num_seqs", opts.max_num_seqs, sched.max_num_seqs == opts.max_num_seqs, sched.max_num_seqs,
                "batches larger than this are scheduled in waves"),
        Applied("enforce_eager", enforce_eager, vc.model_config.enforce_eager == enforce_eager, vc.model_config.enforce_eager,
                "no torch.compile, no CUDA graphs"),
        Applied("max_model_len", opts.max_model_len, vc.model_config.max_model_len == opts.max_model_len, vc.model_config.max_model_len),
        Applied("VLLM_ENABLE_V1_MULTIPROCESSING", "0", env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0",
                env.get("VLLM_ENABLE_V1_MULTIPROCESSING"), f"in-process engine (executor {vc.parallel_config.distributed_executor_backend})"),
        Applied("VLLM_BATCH_INVARIANT", opts.batch_invariant, not opts.batch_invariant or bi_ok, env.get("VLLM_BATCH_INVARIANT"),
                "" if bi_ok or not opts.batch_invariant else f"left at 0: {bi_why}"),
        Applied("attention_backend", opts.attention_backend.upper() or "auto",
                not opts.attention_backend or opts.attention_backend.upper() == attention, attention),
        Applied("tensor_parallel_size", opts.tensor_parallel_size,
                vc.parallel_config.tensor_parallel_size == opts.tensor_parallel_size, vc.parallel_config.tensor_parallel_size),
        Applied("prefix_caching", opts.prefix_caching, bool(vc.cache_config.enable_prefix_caching) == opts.prefix_caching,
                bool(vc.cache_config.enable_prefix_caching)),
        Applied("logprobs_mode", "raw_logprobs", vc.model_config.logprobs_mode == "raw_logprobs", vc.model_config.logprobs_mode,
                "logprobs of the raw logits, before temperature/top-k/top-p"),
        Applied("chunked_prefill", None, True, bool(sched.enable_chunked_prefill),
                f"vLLM default; prompts over max_num_batched_tokens={sched.max_num_batched_tokens} are prefilled in chunks"),
        Applied("async_scheduling", None, True, bool(sched.async_scheduling), "vLLM default"),
        Applied("kv_cache_gib", opts.kv_cache_gib, True,
                env.get("VLLM_CPU_KVCACHE_SPACE") if platform == "cpu" else opts.kv_cache_gib, kv_note),
        Applied("threads", threads, True, threads_now,
                ("torch intra-op threads of the in-process worker; " if platform == "cpu" else "host threads; ")
                + ("" if threads else "engine default kept; ") + "vLLM binds no OpenMP threads in-process"),
    ]


__all__ = ["MIN_MAX_LOGPROBS", "VLLMOptions", "applied", "validate"]
