"""`hf`: Hugging Face transformers in-process, with its own batched decode loop.

The loop (not `model.generate`) lets every request carry its own seeded
torch.Generator, so sampled output does not depend on batch order, and returns
raw-logit logprobs for the chosen token and the top-k. Left padding, and only
generated tokens are returned, never padding. Models are loaded once per process.
The batch-invariant ops of `--opt batch_invariant=true` live in invariant.py; `capture` (locate)
re-runs this same loop with taps at one step (capture.py).
"""

from __future__ import annotations

import copy
import inspect
import logging
import os
import random
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Sequence

from ...core.clock import clock as _clock, since as _since
from ...core.config import Decoding, RunConfig
from ...runfolder.env import dist_version
from ...core.errors import BackendError, BackendUnavailableError, UsageError
from ...core.hashing import content_key, folder_files, folder_identity, prehash
from ...core.modelfiles import check_model_files
from ...core import perturb
from ...core.ompwait import wait_default_before_torch
from ...models import local_folder, resolve_model
from ...models.hub import hub_unreachable
from ...core.processwide import disable_tf32, read_tf32, refuse_after_batch_invariant, tf32_is_off, write_tf32
from ..base import (Applied, Backend, Capabilities, Generation, Installed, ModelIdentity, Request,
                    parse_options, request_seed)
from .lean import forget_sources, without_triton

if TYPE_CHECKING:
    from ..capture import Capture, CaptureSpec

CUBLAS_WORKSPACE = ":4096:8"  # the value cuBLAS documents for deterministic GEMM workspaces
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
INSTALL = {  # what to run when one is missing (detllm doctor)
    "torch": "scripts/install.sh   (CPU torch 2.13.0 through constraints.txt), or pip with torch first at the pin (docs/ci.md#install)",
    "transformers": "scripts/install.sh, or pip install -c constraints.txt 'detllm[hf]'",
}
_LOADED: dict[tuple, tuple[Any, Any]] = {}  # (source, content key, revision, dtype, device, attn) -> (model, tokenizer)


@dataclass(frozen=True)
class HFOptions:
    attn_implementation: str = "eager"  # eager | sdpa: kernels differ, so it is recorded and fixed
    trust_remote_code: bool = False  # never run hub code unless asked
    batch_invariant: bool = False  # tier 3: batch-invariant ops for the run (invariant.py); slower
    perturb: str | None = None  # TEST-ONLY: MODULE:output|weight:REL[@STEP] (detllm.perturb), a known difference for locate


def _invariant():
    from . import invariant  # only `--opt batch_invariant=true` installs, probes or counts those ops

    return invariant


def _torch():
    wait_default_before_torch()  # before torch loads libgomp: how idle threads wait, from how busy the machine is (core/ompwait.py)
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as exc:
        raise BackendUnavailableError(
            "the hf backend needs torch and transformers", hint="run scripts/install.sh, or install with pip, torch first at the pin (docs/ci.md#install)"
        ) from exc
    return torch


class HFBackend(Backend):
    name = "hf"
    Options = HFOptions

    def __init__(self, model: str, *, options: HFOptions | None = None, revision: str | None = None,
                 dtype: str = "float32", device: str = "cpu", cublas_workspace: bool = False) -> None:
        wait_default_before_torch()  # before anything imports torch: a built-in model's first build does (core/ompwait.py)
        self.revision = revision
        self.resolved = resolve_model(model)
        self._folder = self._local_folder()
        if self._folder is not None:
            # the files' hashes (the cache key of _load, the run's model identity) are read on a thread of their
            # own while torch and transformers import: ~0.45 s of smollm2-135m's start, off the clock
            prehash(folder_files(Path(self._folder)))
        torch = _torch()
        refuse_after_batch_invariant("the hf backend")
        self.options = options or HFOptions()
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailableError("--device cuda was asked for but CUDA is not available", hint="use --device cpu")
        self.device = device
        self._cublas_note = self._set_cublas(torch) if (device == "cuda" and cublas_workspace) else None
        self.requested_dtype = dtype  # recorded as requested; "auto" resolves to float32 here
        if dtype == "auto":
            dtype = "float32"
        self.dtype = dtype
        self.perturbation = perturb.parse(self.options.perturb) if self.options.perturb else None  # before any load
        self.model, self.tokenizer = self._load(torch)
        if self.perturbation is not None:
            perturb.resolve(self.model, self.perturbation)  # an unknown module is a UsageError before anything is written

    @classmethod
    def from_config(cls, config: RunConfig) -> "HFBackend":
        opts = parse_options(HFOptions, config.options, "hf")
        return cls(config.model, options=opts, revision=config.revision, dtype=config.dtype, device=config.device,
                   cublas_workspace=config.tier >= 1)

    def _set_cublas(self, torch) -> tuple[bool, str]:
        current = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        if current in (":4096:8", ":16:8"):
            return True, f"already set to {current}"
        if torch.cuda.is_initialized():
            return False, "CUDA was initialised before detllm could set it"
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
        return True, "set before CUDA initialised"

    def _local_folder(self) -> Any:
        """The model's folder on this machine (a hub id already in the hub cache: no network), or None
        when from_pretrained must download it; a UsageError when it is not cached and the hub is unreachable."""
        if self.resolved.path is not None:
            return self.resolved.path
        try:
            return local_folder(self.resolved, self.revision)
        except BackendError:
            why = hub_unreachable()  # a short connect now, not the hub client's retries (~50 s offline)
            if why:
                raise UsageError(f"model {self.resolved.id!r} is not in the hub cache and the hub cannot be reached: {why}",
                                 hint="pass a built-in model or a local folder, or load it once where the hub is reachable "
                                      "to fill the hub cache") from None
            return None  # not cached: from_pretrained downloads it where the hub is reachable

    def _load(self, torch):
        folder = self._folder
        with without_triton(torch):  # the model classes' imports pull triton, which a GPU-less torch never runs (lean.py)
            from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # keep stderr for detllm's one-line messages
        if folder is not None:
            check_model_files(folder)  # a truncated or corrupt file is one line naming it, not a loader traceback
        source = str(folder) if folder else self.resolved.id
        # keyed on every file's content, not its size and mtime: a file edited in place (same size,
        # mtime set back) is reloaded, never served from the model loaded before the edit
        content = content_key(folder) if folder else None
        key = (source, content, self.revision, self.dtype, self.device, self.options.attn_implementation)
        if key in _LOADED:
            return _LOADED[key]
        logging.getLogger("huggingface_hub").setLevel(logging.ERROR)  # retry chatter would bury the one-line error
        try:
            tok = AutoTokenizer.from_pretrained(source, revision=self.revision, trust_remote_code=self.options.trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(
                source, revision=self.revision, dtype=getattr(torch, _DTYPES[self.dtype]),
                attn_implementation=self.options.attn_implementation, trust_remote_code=self.options.trust_remote_code,
            )
        except (OSError, ValueError) as exc:  # no such files, or files transformers cannot read as a model
            raise UsageError(f"cannot load model {self.resolved.id!r}: {(str(exc).splitlines() or [''])[0][:200]}",
                             hint="pass a built-in model, a local folder, or a hub id reachable from this machine") from exc
        except Exception as exc:  # any other loader failure (safetensors, tokenizers): one line, never a traceback
            raise BackendError(f"transformers could not load model {self.resolved.id!r}: {exc.__class__.__name__}: "
                               f"{(str(exc).splitlines() or [''])[0][:200]}") from exc
        model.to(self.device).eval()
        forget_sources()  # the source text loading left in linecache (lean.py)
        tok.padding_side = "left"  # decoder-only: pad on the left so the last position is real
        for stale in [k for k in _LOADED if k[0] == source and k[1] != content]:
            del _LOADED[stale]  # files changed since: that model is never served again
        _LOADED[key] = (model, tok)
        return model, tok

    # ------------------------------------------------------------ interface

    def capabilities(self) -> Capabilities:
        if not self.options.batch_invariant:
            return Capabilities(
                max_tier=2, logprobs=True, sampling=True, batch_invariant=False,
                notes=("transformers kernels are not batch invariant: padding and batch shape change GEMM reductions; "
                       "pass --opt batch_invariant=true for tier 3",),
                capture="ops",
            )
        missing = _invariant().uncovered(self._invariant_ops())
        notes = tuple(f"batch_invariant: op {op.name!r} {op.how}" for op in missing)
        return Capabilities(max_tier=2 if missing else 3, logprobs=True, sampling=True, batch_invariant=not missing, notes=notes,
                            capture="ops")

    def _invariant_ops(self):
        return _invariant().coverage(self.model, self.options.attn_implementation, self.device)

    def context_limit(self) -> int | None:
        # past its trained positions a model keeps generating, silently degraded: refuse instead
        return getattr(self.model.config, "max_position_embeddings", None)

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    @property
    def _last_logits_only(self) -> dict[str, int]:
        # the prompt's lm_head on its last position only: the loop reads nothing else (a 49152-wide GEMM per token saved)
        return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(self.model.forward).parameters else {}

    def _eos(self) -> set[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return set(eos if isinstance(eos, list) else [eos]) - {None}

    def generate(self, requests: Sequence[Request], decoding: Decoding, *, seed: int, n_logprobs: int, logprobs: bool) -> list[Generation]:
        torch = _torch()
        try:
            inv = _invariant() if self.options.batch_invariant else None  # its ops are installed only then
            before = inv.live_calls(self.model) if inv else None
            with torch.inference_mode(), perturb.applied(self.model, self.perturbation) as moved:
                gens = self._generate(torch, requests, decoding, seed, n_logprobs, logprobs, at_step=self.stepper(moved))
            after = inv.live_calls(self.model) if inv else None
            if before is not None and after is not None:  # tier 3: the invariant kernels' own count, the mode's live proof
                mode = {"batch_invariant": True, "linear_calls": after[0] - before[0], "attention_calls": after[1] - before[1],
                        "seen_by": "hf: the batch-invariant kernels' own call counts during this batch"}
                for g in gens:
                    g.evidence = {**(g.evidence or {}), "mode": mode}
            return gens
        except RuntimeError as exc:
            raise BackendError(f"transformers failed while generating: {str(exc).splitlines()[0][:300]}") from exc

    grafts = True  # CaptureSpec.graft: modules and ops (backends/grafthook.py)

    def capture(self, requests: Sequence[Request], decoding: Decoding, *, seed: int, n_logprobs: int,
                spec: CaptureSpec) -> Capture:
        from . import capture

        return capture.capture(self, requests, decoding, seed=seed, n_logprobs=n_logprobs, spec=spec)

    @staticmethod
    def stepper(moved: perturb.Applied | None, then: Callable[[int], ContextManager] | None = None) -> Callable[[int], ContextManager]:
        """The loop's per-step hook: tells a perturbation the step about to run, then enters `then(step)`."""
        def at_step(step: int) -> ContextManager:
            if moved is not None:
                moved.step = step
            return then(step) if then is not None else nullcontext()
        return at_step

    def _generate(self, torch, requests, decoding, seed, n_logprobs, want_logprobs, *,
                  at_step: Callable[[int], ContextManager] | None = None, steps: int | None = None,
                  timed: dict | None = None) -> list[Generation]:
        """The one decode loop (generate and capture): `at_step(step)` is entered around each step's
        forward; `steps` stops it early (capture: steps 0..s). `timed` (capture's cost): the last
        step's forward timed, then the same forward run again on a copy of the cache taken before
        it, with timed["bare"] set (at_step then adds no hooks), timed too; its outputs are dropped."""
        n = len(requests)
        width = max(len(r.input_ids) for r in requests)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else next(iter(self._eos()), 0)
        ids = torch.full((n, width), pad, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for row, req in enumerate(requests):
            ids[row, width - len(req.input_ids):] = torch.tensor(req.input_ids, dtype=torch.long)
            mask[row, width - len(req.input_ids):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        gens = None
        if not decoding.greedy:
            gens = [torch.Generator(device=self.device).manual_seed(request_seed(seed, r)) for r in requests]
        eos = self._eos()
        out_ids: list[list[int]] = [[] for _ in requests]
        out_lp: list[list[float]] = [[] for _ in requests]
        out_top: list[list[list[tuple[int, float]]]] = [[] for _ in requests]
        reasons = ["length"] * n
        done = [False] * n
        past, cur, cur_pos = None, ids, pos
        rows: list[int] = []  # the padded batch shape's rows per forward: what was really computed together
        last = min(decoding.max_new_tokens, steps or decoding.max_new_tokens) - 1
        for step in range(last + 1):
            timing = timed is not None and step == last
            if timing:
                kept, clock = copy.deepcopy(past), _clock()
            with (at_step(step) if at_step is not None else nullcontext()):
                rows.append(int(cur.shape[0]))
                out = self.model(input_ids=cur, attention_mask=mask, position_ids=cur_pos, past_key_values=past,
                                 use_cache=True, **self._last_logits_only)
            if timing:  # the bare forward second: a first forward's warm-up is counted to the capture, never to it
                timed["forward"], timed["bare"], clock = _since(clock), True, _clock()
                with (at_step(step) if at_step is not None else nullcontext()):
                    self.model(input_ids=cur, attention_mask=mask, position_ids=cur_pos, past_key_values=kept,
                               use_cache=True, **self._last_logits_only)
                timed["bare"], timed["bare_forward"] = False, _since(clock)
            past = out.past_key_values
            logits = out.logits[:, -1, :].float()  # (n, vocab) raw logits of the next token
            nxt = logits.argmax(dim=-1) if gens is None else self._sample(torch, logits, decoding, gens)
            if want_logprobs:  # only then: tier 1 records token ids alone
                logp = torch.log_softmax(logits, dim=-1)
                chosen = logp.gather(1, nxt[:, None])[:, 0].tolist()
                tv, ti = logp.topk(min(n_logprobs, logp.shape[-1]), dim=-1)
                tv, ti = tv.tolist(), ti.tolist()
            nxt_list = nxt.tolist()
            for row in range(n):
                if done[row]:
                    continue
                out_ids[row].append(nxt_list[row])
                if want_logprobs:
                    out_lp[row].append(chosen[row])
                    out_top[row].append(list(zip(ti[row], tv[row])))
                if nxt_list[row] in eos:
                    done[row], reasons[row] = True, "stop"
            if all(done):
                break
            nxt = torch.where(torch.tensor(done, device=self.device), torch.full_like(nxt, pad), nxt)
            mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=self.device)], dim=-1)
            cur, cur_pos = nxt[:, None], cur_pos[:, -1:] + 1
        return [
            Generation(
                token_ids=out_ids[r],
                token_texts=[self.tokenizer.decode([t]) for t in out_ids[r]],
                text=self.tokenizer.decode(out_ids[r]),
                finish_reason=reasons[r],
                logprobs=out_lp[r] if want_logprobs else None,
                top_logprobs=out_top[r] if want_logprobs else None,
                evidence={"computed_with": {"rows": min(rows, default=n), "forwards": len(rows),
                                            "seen_by": "hf: padded batch shape per forward"}},
            )
            for r in range(n)
        ]

    can_score = True
    score_method = "one forward pass over prompt + generated tokens (transformers)"

    def score(self, input_ids: Sequence[int], target_ids: Sequence[int]) -> list[float]:
        torch = _torch()
        seq = torch.tensor([list(input_ids) + list(target_ids)], dtype=torch.long, device=self.device)
        with torch.inference_mode(), perturb.applied(self.model, self.perturbation) as moved:
            if moved is not None:
                moved.step = 0  # one prefill forward
            logits = self.model(input_ids=seq, attention_mask=torch.ones_like(seq)).logits[0].float()
        start = len(input_ids) - 1  # logits at position p predict token p + 1
        logp = torch.log_softmax(logits[start:start + len(target_ids)], dim=-1)
        return logp.gather(1, torch.tensor(list(target_ids), device=self.device)[:, None])[:, 0].tolist()

    @staticmethod
    def _sample(torch, logits, decoding: Decoding, gens) -> Any:
        scores = logits / decoding.temperature
        if decoding.top_k:
            kth = scores.topk(min(decoding.top_k, scores.shape[-1]), dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if decoding.top_p < 1.0:
            sorted_s, order = scores.sort(dim=-1, descending=True)
            cum = sorted_s.softmax(-1).cumsum(-1)
            drop = cum - sorted_s.softmax(-1) > decoding.top_p  # keep the smallest set reaching top_p
            scores = scores.scatter(1, order, sorted_s.masked_fill(drop, float("-inf")))
        probs = scores.softmax(-1)
        picks = [torch.multinomial(probs[row], 1, generator=g) for row, g in enumerate(gens)]
        return torch.cat(picks)

    def model_identity(self) -> ModelIdentity:
        return folder_identity(self.resolved.id, local_folder(self.resolved, self.revision), revision=self.revision)

    @contextmanager
    def determinism(self, *, tier: int, seed: int, threads: int | None) -> Iterator[list[Applied]]:
        torch = _torch()
        import numpy as np

        refuse_after_batch_invariant("the hf backend")  # also for a backend built before vLLM's mode was switched on

        saved = {
            "det": torch.are_deterministic_algorithms_enabled(),
            "warn": torch.is_deterministic_algorithms_warn_only_enabled(),
            "threads": torch.get_num_threads(),
            "cudnn_det": torch.backends.cudnn.deterministic,
            "cudnn_bench": torch.backends.cudnn.benchmark,
            "tf32": read_tf32(torch),  # new fp32_precision API where it exists: reading legacy allow_tf32 can raise
            "py_rng": random.getstate(),
            "np_rng": np.random.get_state(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,  # manual_seed reseeds CUDA too
        }
        applied = [Applied("seed.python", seed, True, seed), Applied("seed.numpy", seed, True, seed),
                   Applied("seed.torch", seed, True, seed, "plus a torch.Generator per request seeded from (seed, prompt_index)")]
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        forget_sources()  # torch's lazy CUDA seeding read every file on the stack (lean.py)
        stack = ExitStack()
        try:
            if tier >= 1:
                torch.use_deterministic_algorithms(True)
                torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
                applied.append(Applied("torch.use_deterministic_algorithms", True, True, True, "restored afterwards"))
                applied.append(Applied("cudnn.deterministic / benchmark", [True, False], True, [True, False]))
            else:
                applied.append(Applied("torch.use_deterministic_algorithms", False, True, torch.are_deterministic_algorithms_enabled(), "tier 0 asks for nothing"))
            if self.device == "cuda":
                now = disable_tf32(torch)
                applied.append(Applied("tf32", False, tf32_is_off(now), False if tf32_is_off(now) else now, ", ".join(f"{k}={v}" for k, v in now.items())))
                ok, note = self._cublas_note or (False, "not requested at tier 0")
                applied.append(Applied("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE, ok, os.environ.get("CUBLAS_WORKSPACE_CONFIG"), note))
            else:
                applied.append(Applied("tf32", False, False, None, "CPU run: TF32 is a CUDA setting"))
                applied.append(Applied("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE, False, None, "CPU run: no cuBLAS"))
            if threads is not None:
                torch.set_num_threads(threads)
            applied.append(Applied("threads", threads, True, torch.get_num_threads(), "" if threads else "engine default kept"))
            applied.append(Applied("attn_implementation", self.options.attn_implementation, True, self.options.attn_implementation))
            if self.perturbation is not None:
                applied.append(Applied("perturb", self.options.perturb, True, str(self.perturbation),
                                       "TEST-ONLY: a known difference made on purpose (detllm locate's tests)"))
            applied.append(Applied("dtype", self.requested_dtype, True, str(self.model.dtype).replace("torch.", ""),
                                   "auto resolves to float32" if self.requested_dtype == "auto" else ""))
            if self.options.batch_invariant:  # the invariant ops, swapped in for this run only
                ops, invariant = self._invariant_ops(), _invariant()
                complete = not invariant.uncovered(ops)  # all or nothing: a partial swap proves nothing
                if not complete and tier >= 3:  # probed again under this run's thread count, and it failed
                    raise BackendError(f"batch_invariant: {'; '.join(f'{o.name} {o.how}' for o in invariant.uncovered(ops))}")
                applied.extend(invariant.applied(ops, installed=complete))
                if complete:
                    stack.enter_context(invariant.installed(self.model, self.options.attn_implementation))
            yield applied
        finally:
            stack.close()
            torch.use_deterministic_algorithms(saved["det"], warn_only=saved["warn"])
            torch.set_num_threads(saved["threads"])
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved["cudnn_det"], saved["cudnn_bench"]
            random.setstate(saved["py_rng"])
            np.random.set_state(saved["np_rng"])
            torch.set_rng_state(saved["torch_rng"])
            if saved["cuda_rng"] is not None:
                torch.cuda.set_rng_state_all(saved["cuda_rng"])
            write_tf32(torch, saved["tf32"])  # last: a BackendError here leaves nothing else unrestored

    def env_info(self) -> dict[str, Any]:
        from importlib import metadata

        return {
            "name": "hf",
            "version": metadata.version("transformers"),
            "torch": metadata.version("torch"),
            "device": self.device,
            "dtype": self.dtype,
            "attn_implementation": self.options.attn_implementation,
        }

    def close(self) -> None:
        """Models stay cached for the process (loaded once per process, not once per run)."""

    @classmethod
    def installed(cls) -> Installed:
        missing = [d for d in ("torch", "transformers") if dist_version(d) is None]
        if missing:
            return Installed(False, why=f"{', '.join(missing)} not installed", fix=INSTALL[missing[-1]])
        return Installed(True, engine=f"transformers {dist_version('transformers')}")
