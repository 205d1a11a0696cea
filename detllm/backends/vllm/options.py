"""The vllm backend's settings: what can be asked (`VLLMOptions`, checked before an engine
starts) and what was in effect (the `Applied` list, read back from the running engine's
config and env). Imports no vLLM: the engine's config object is passed in.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from ...core.config import MAX_BATCH, floats, ints, ranged
from ...core.errors import UsageError
from ..base import Applied

MIN_MAX_LOGPROBS = 20  # vLLM's own default cap on logprobs per step
_CPU_LIST = re.compile(r"\d+(-\d+)?(,\d+(-\d+)?)*")  # one rank's cores: "0", "0-3", "0,2-3"


@dataclass(frozen=True)
class VLLMOptions:
    max_num_seqs: int = ranged(8, ints(1, MAX_BATCH))  # sequences scheduled together; a batch larger than this runs in waves
    enforce_eager: bool | None = None  # None: True on CPU (no compile step), False on GPU (CUDA graphs)
    max_model_len: int = ranged(512, ints(1, 1 << 24))  # context the KV cache is sized for; prompt + new tokens must fit
    gpu_memory_utilization: float = ranged(0.9, floats(0, 1, lo_open=True))  # share of GPU memory vLLM may reserve (unused on CPU: kv_cache_gib)
    tensor_parallel_size: int = ranged(1, ints(1, 1024))  # GPUs (CPU: worker processes) the weights are split over; > 1 adds all-reduce order to the numerics
    cpu_threads_bind: str = ""  # CPU build, tensor_parallel_size > 1: VLLM_CPU_OMP_THREADS_BIND, cores per rank ("0|1", "0-1|2-3", "auto", "nobind"); "": --threads cores per rank (default 1), in order
    distributed_executor_backend: str = ""  # "mp", "ray" or "uni"; "": uni at tensor_parallel_size 1, else mp. Always passed: in a Ray placement group vLLM would pick its Ray executor by itself
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
    if opts.distributed_executor_backend not in ("", "mp", "ray", "uni"):
        raise UsageError(f"--opt distributed_executor_backend must be mp, ray or uni, got {opts.distributed_executor_backend!r}")
    if opts.cpu_threads_bind and (platform != "cpu" or opts.tensor_parallel_size == 1):
        raise UsageError("--opt cpu_threads_bind binds the OpenMP threads of vLLM's CPU worker processes, which only the CPU build "
                         "with tensor_parallel_size > 1 starts", hint="use --threads for the in-process engine")
    if opts.cpu_threads_bind and opts.cpu_threads_bind not in ("auto", "nobind"):
        ranks = opts.cpu_threads_bind.split("|")
        if len(ranks) != opts.tensor_parallel_size or not all(_CPU_LIST.fullmatch(r) for r in ranks):
            raise UsageError(f"--opt cpu_threads_bind expects {opts.tensor_parallel_size} CPU lists separated by '|' "
                             f"(one per rank, e.g. 0|1 or 0-1|2-3), 'auto' or 'nobind'; got {opts.cpu_threads_bind!r}")


def executor_backend(opts: VLLMOptions) -> str:
    """The distributed_executor_backend detllm passes: the option, else uni (the engine in this process,
    where capture's hooks reach it) at tensor_parallel_size 1 and mp (worker processes) above."""
    return opts.distributed_executor_backend or ("uni" if opts.tensor_parallel_size == 1 else "mp")


def threads_bind(opts: VLLMOptions, threads: int | None, cpus: list[int]) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND for the CPU build's worker processes (tensor_parallel_size > 1),
    or None for the in-process engine. Set explicitly: vLLM's "auto" binds one NUMA node per rank
    and asserts on a machine with fewer nodes than ranks. By default rank r gets `threads` (1)
    cores of `cpus` (this process's allowed CPUs), the next ones in order, none shared."""
    if opts.tensor_parallel_size == 1:
        return None
    if opts.cpu_threads_bind:
        return opts.cpu_threads_bind
    per = threads or 1
    need = per * opts.tensor_parallel_size
    if need > len(cpus):
        raise UsageError(f"tensor_parallel_size={opts.tensor_parallel_size} with {per} thread(s) per rank needs {need} cores; "
                         f"this process may use {len(cpus)} ({','.join(map(str, cpus))})",
                         hint="lower --threads or tensor_parallel_size, or share cores: --opt cpu_threads_bind='0-1|0-1'")
    return "|".join(_cpu_list(cpus[r * per:(r + 1) * per]) for r in range(opts.tensor_parallel_size))


def _cpu_list(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5": the spelling vLLM parses (cpu_resource_utils.parse_id_list)."""
    parts: list[list[int]] = []
    for i in sorted(ids):
        if parts and parts[-1][1] == i - 1:
            parts[-1][1] = i
        else:
            parts.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)


def applied(vc: Any, opts: VLLMOptions, *, dtype_asked: str, enforce_eager: bool, platform: str,
            batch_invariance: tuple[bool, str], attention: str | None, seed: int, threads: int | None,
            threads_now: int, bind: str | None = None, ranks: list[dict[str, Any]] | None = None) -> list[Applied]:
    """Each setting as asked and as the running engine has it (`vc`: its VllmConfig). `bind`: the
    VLLM_CPU_OMP_THREADS_BIND the engine started with; `ranks`: what each CPU worker process
    reports of itself ({"rank", "cpus", "omp_threads", "numa_nodes"}), None for the in-process engine."""
    env = os.environ
    workers = vc.parallel_config.world_size > 1
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
                env.get("VLLM_ENABLE_V1_MULTIPROCESSING"),
                f"engine core in this process; executor {vc.parallel_config.distributed_executor_backend}"
                + (f": {vc.parallel_config.world_size} worker processes run the model" if workers else ", in this process too")),
        Applied("VLLM_BATCH_INVARIANT", opts.batch_invariant, not opts.batch_invariant or bi_ok, env.get("VLLM_BATCH_INVARIANT"),
                "" if bi_ok or not opts.batch_invariant else f"left at 0: {bi_why}"),
        Applied("attention_backend", opts.attention_backend.upper() or "auto",
                not opts.attention_backend or opts.attention_backend.upper() == attention, attention),
        Applied("tensor_parallel_size", opts.tensor_parallel_size,
                vc.parallel_config.tensor_parallel_size == opts.tensor_parallel_size, vc.parallel_config.tensor_parallel_size),
        Applied("distributed_executor_backend", executor_backend(opts),
                str(vc.parallel_config.distributed_executor_backend) == executor_backend(opts),
                str(vc.parallel_config.distributed_executor_backend), "always passed: inside a Ray placement group vLLM would choose ray itself"),
        Applied("prefix_caching", opts.prefix_caching, bool(vc.cache_config.enable_prefix_caching) == opts.prefix_caching,
                bool(vc.cache_config.enable_prefix_caching)),
        Applied("logprobs_mode", "raw_logprobs", vc.model_config.logprobs_mode == "raw_logprobs", vc.model_config.logprobs_mode,
                "logprobs of the raw logits, before temperature/top-k/top-p"),
        Applied("chunked_prefill", None, True, bool(sched.enable_chunked_prefill),
                f"vLLM default; prompts over max_num_batched_tokens={sched.max_num_batched_tokens} are prefilled in chunks"),
        Applied("async_scheduling", None, True, bool(sched.async_scheduling), "vLLM default"),
        Applied("kv_cache_gib", opts.kv_cache_gib, True,
                env.get("VLLM_CPU_KVCACHE_SPACE") if platform == "cpu" else opts.kv_cache_gib, kv_note),
        _threads(threads, threads_now, platform, ranks),
        *([_binding(bind, ranks or [], user=bool(opts.cpu_threads_bind))] if platform == "cpu" and workers else []),
    ]


def _threads(threads: int | None, threads_now: int, platform: str, ranks: list[dict[str, Any]] | None) -> Applied:
    if ranks is None:
        return Applied("threads", threads, True, threads_now,
                       ("torch intra-op threads of the in-process worker; " if platform == "cpu" else "host threads; ")
                       + ("" if threads else "engine default kept; ") + "vLLM binds no OpenMP threads in-process")
    counts = sorted({r["omp_threads"] for r in ranks})
    value = counts[0] if len(counts) == 1 else [r["omp_threads"] for r in ranks]
    return Applied("threads", threads, threads is None or counts == [threads], value,
                   "OpenMP threads of each worker process (per rank, as each reports torch.get_num_threads()), "
                   "set by vLLM from VLLM_CPU_OMP_THREADS_BIND; this process only schedules")


def _binding(bind: str | None, ranks: list[dict[str, Any]], *, user: bool) -> Applied:
    """VLLM_CPU_OMP_THREADS_BIND as set and as the workers report their cores: applied when each
    rank runs on exactly the cores its list names ("auto"/"nobind": whatever vLLM chose). `user`:
    the user gave cpu_threads_bind; else detllm chose it (threads_bind's default): the machine's."""
    from_ranks = "|".join(_cpu_list(r["cpus"]) for r in ranks)
    asked = [_cpu_list(_ids(part)) for part in bind.split("|")] if bind and bind not in ("auto", "nobind") else None
    numa = sorted({n for r in ranks for n in r.get("numa_nodes", ())})
    where = "; ".join(f"rank {r['rank']}: cores {_cpu_list(r['cpus'])}, {r['omp_threads']} thread(s)" for r in ranks)
    return Applied("VLLM_CPU_OMP_THREADS_BIND", bind, asked is None or asked == from_ranks.split("|"), from_ranks,
                   f"as the worker processes report it: {where}; NUMA node(s) {','.join(map(str, numa)) or '?'}"
                   + ("" if user else "; chosen by detllm (no cpu_threads_bind given): --threads cores per rank, in order"),
                   chosen_by="user" if user else "machine")


def _ids(part: str) -> list[int]:
    """"0-2,5" -> [0, 1, 2, 5]."""
    out: list[int] = []
    for item in part.split(","):
        lo, _, hi = item.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


__all__ = ["MIN_MAX_LOGPROBS", "VLLMOptions", "applied", "threads_bind", "validate"]
