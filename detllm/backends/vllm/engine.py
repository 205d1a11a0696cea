"""The one vLLM engine of this process (`vllm.LLM`, in-process, one at a time).

Owns starting it with the env vars it reads, reusing it for the same key, shutting it down and
restoring those env vars, and telling processwide.py once an engine ran batch-invariant. vLLM
is imported here, when an engine starts. Knows nothing of requests or options: backend.py.
"""

from __future__ import annotations

import difflib
import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any

from ...core.chatter import captured_stderr
from ...core.errors import BackendError, BackendUnavailableError, UsageError
from ...core.processwide import mark_batch_invariant_started, refuse_after_batch_invariant
from .installed import INSTALL_CPU, INSTALL_CUDA

# vLLM logs INFO to stdout by default; detllm keeps stdout for its own output.
LOGGING_DEFAULTS = {"VLLM_LOGGING_LEVEL": "ERROR", "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
# env vars vLLM's batch-invariant mode writes (processwide.py): saved and restored with the engine's own
_BI_ENV = ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "VLLM_ALLREDUCE_USE_SYMM_MEM", "VLLM_USE_AOT_COMPILE",
           "NCCL_LAUNCH_MODE", "NCCL_COLLNET_ENABLE", "NCCL_NVLS_ENABLE", "NCCL_P2P_NET_DISABLE", "NCCL_MIN_NCHANNELS",
           "NCCL_MAX_NCHANNELS", "NCCL_PROTO", "NCCL_ALGO", "NCCL_NTHREADS", "NCCL_SOCKET_NTHREADS")


@dataclass
class _Engine:
    key: tuple  # (model source, its content key, revision, dtype, platform, options, max_logprobs)
    llm: Any  # vllm.LLM
    saved_env: dict[str, str | None]  # env vars this engine set -> their previous values
    ranks: list[dict[str, Any]] | None = None  # worker processes' own report (worker_ranks), asked once


_ENGINE: _Engine | None = None


def worker_ranks() -> list[dict[str, Any]] | None:
    """What each worker process of the running engine reports of itself, in rank order:
    {"rank", "cpus" (its CPU affinity), "omp_threads" (torch's pool), "numa_nodes" (of those
    cpus)}. None when no engine is up or it runs the model in this process (world size 1)."""
    if _ENGINE is None or _ENGINE.llm.llm_engine.vllm_config.parallel_config.world_size == 1:
        return None
    if _ENGINE.ranks is None:
        # collective_rpc answers in rank order
        _ENGINE.ranks = [{"rank": r, **got} for r, got in enumerate(_ENGINE.llm.collective_rpc(_rank_report))]
    return _ENGINE.ranks


def attention_names(vc: Any) -> str | None:
    """The attention backend(s) the model's layers use in the process holding them (`vc`: its VllmConfig)."""
    layers = vc.compilation_config.static_forward_context
    names = {cls.get_name() for cls in (getattr(m, "attn_backend", None) for m in layers.values()) if cls is not None}
    return ",".join(sorted(names)) or None


def _rank_report(worker: Any) -> dict[str, Any]:
    """Runs in a worker process (vLLM's collective_rpc passes the worker): the cores its threads are
    pinned to (the union over its threads: vLLM pins each OpenMP thread to one core of the rank's
    list, and the main thread's own affinity names only the first), its threads, its attention backend."""
    import torch
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list

    pinned: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            pinned |= os.sched_getaffinity(int(tid))
        except OSError:  # the thread ended meanwhile
            pass
    cpus = sorted(pinned)
    numa = sorted({c.numa_node for c in get_allowed_cpu_list() if c.id in cpus})
    return {"attention": attention_names(worker.vllm_config), "cpus": cpus, "omp_threads": torch.get_num_threads(), "numa_nodes": numa}


def current_llm() -> Any:
    """The running engine's `vllm.LLM`, or None when none is up."""
    return _ENGINE.llm if _ENGINE is not None else None


def release_engine() -> None:
    """Shut the process's engine down and restore the env vars it set. Safe to call twice."""
    global _ENGINE
    engine, _ENGINE = _ENGINE, None
    if engine is None:
        return
    try:
        engine.llm.llm_engine.engine_core.shutdown()
    finally:
        del engine.llm
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()  # also drops vLLM's env-var cache, so the next engine reads fresh values
        _restore_env(engine.saved_env)


def _restore_env(saved: dict[str, str | None]) -> None:
    for name, old in saved.items():
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def start_engine(key: tuple, env: dict[str, str], llm_kwargs: dict[str, Any]) -> Any:
    """The engine for `key`: the running one when its key matches, else a new one (the old one
    released first) built with `env` set and `llm_kwargs` passed to `vllm.LLM`."""
    global _ENGINE
    if _ENGINE is not None and _ENGINE.key == key:
        return _ENGINE.llm
    release_engine()  # one engine at a time: a second would double memory and share global state
    invariant = env.get("VLLM_BATCH_INVARIANT") == "1"
    if not invariant:
        refuse_after_batch_invariant("an engine without batch_invariant")
    saved = {name: os.environ.get(name) for name in (*env, *(_BI_ENV if invariant else ()))}
    for name, value in LOGGING_DEFAULTS.items():
        os.environ.setdefault(name, value)  # before vLLM's logger is configured, on its first import
    # Some vLLM modules log while it is still importing, before that configuration exists.
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    os.environ.update(env)  # read by vLLM while the engine is built: must be set first
    try:
        import torch
        from vllm import LLM
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
    except ImportError as exc:
        _restore_env(saved)
        raise BackendUnavailableError(f"vllm is installed but cannot be imported: {exc}", hint=f"{INSTALL_CPU}; {INSTALL_CUDA}") from exc
    backend = llm_kwargs.get("attention_backend")
    if backend and backend.upper() not in AttentionBackendEnum.__members__:
        _restore_env(saved)
        close = difflib.get_close_matches(backend.upper(), AttentionBackendEnum.__members__, n=1)
        raise UsageError(f"unknown vLLM attention backend {backend!r}",
                         hint=f"did you mean {close[0]!r}?" if close else f"one of: {', '.join(AttentionBackendEnum.__members__)}")
    set_num_threads = torch.set_num_threads
    try:
        # the engine's start-up chatter (torch's NUMA notice, ...) stays off detllm's one-line stderr (chatter.py)
        with warnings.catch_warnings(), captured_stderr():
            warnings.simplefilter("ignore", FutureWarning)  # torch deprecations inside vLLM, not ours to act on
            llm = LLM(**llm_kwargs)
    except ValueError as exc:  # vLLM's config validation (pydantic errors are ValueErrors too)
        _restore_env(saved)
        raise UsageError(f"vLLM refused the engine configuration: {first_line(exc)}") from exc
    except Exception as exc:
        _restore_env(saved)
        raise BackendError(f"vLLM engine failed to start: {first_line(exc)}") from exc
    finally:
        # vLLM's in-process CPU worker replaces torch.set_num_threads with a no-op for the whole
        # process; put it back so --threads (and the hf backend in the same process) still work.
        torch.set_num_threads = set_num_threads
    _ENGINE = _Engine(key, llm, saved)
    if invariant:
        mark_batch_invariant_started()  # for the rest of the process, whatever release_engine restores
    return llm


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]


__all__ = ["attention_names", "current_llm", "first_line", "release_engine", "start_engine", "worker_ranks"]
