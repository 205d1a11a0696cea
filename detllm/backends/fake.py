"""`fake`: a scripted backend with injectable divergences, for fast tests.

Tokens are a pure function of (salt, input ids, tokens so far): no model, no torch.
Injections make a chosen prompt diverge at a chosen generated-token position, on a
chosen run (the n-th time that prompt is generated at a batch size) or batch size,
so every verdict can be produced. Usable from the CLI: `--backend fake --opt diverge=...`. Its `capture` is a scripted two-layer
model in Hugging Face module names whose chosen module's output moves where an injection applies
(`capture_module`, `capture_nudge`, `capture_from_step`): locate's unit tests run on it.
"""

from __future__ import annotations

import hashlib
import os
import random
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

from ..core.config import Decoding, RunConfig, floats, ints, ranged
from ..core.errors import UsageError
from .base import (Applied, Backend, Capabilities, Capture, CapturedTensor, CaptureSpec, Generation, Installed, ModelIdentity,
                   Request, WeightFile, parse_options, request_seed)

_FIRST, _LAST = 32, 126  # generated ids are printable ASCII so they decode to text


@dataclass(frozen=True)
class Injection:
    prompt: int  # prompt index that diverges
    pos: int  # generated-token index where it diverges
    run: int | None = None  # n-th generation of that prompt at that batch size; None: every run
    batch: int | None = None  # only at this batch size; None: any
    what: str = "token"  # token: a different token id; logprob: same token, logprob nudged
    fresh: bool = False  # only in a process started for a fresh-process repeat (check --fresh-process)

    @classmethod
    def parse(cls, spec: str) -> "Injection":
        """`prompt=0,pos=3,run=1,batch=8,what=token`; prompt and pos are required."""
        fields: dict[str, str] = {}
        for part in spec.split(","):
            if "=" not in part:
                raise UsageError(f"fake diverge spec parts are key=value, got {part!r} in {spec!r}")
            k, v = part.split("=", 1)
            fields[k.strip()] = v.strip()
        unknown = set(fields) - {"prompt", "pos", "run", "batch", "what", "fresh"}
        if unknown or "prompt" not in fields or "pos" not in fields:
            raise UsageError(f"fake diverge spec needs prompt= and pos= (optional run=, batch=, what=, fresh=), got {spec!r}")
        if fields.get("what", "token") not in ("token", "logprob"):
            raise UsageError(f"fake diverge what= must be token or logprob, got {fields['what']!r}")
        try:
            return cls(
                prompt=int(fields["prompt"]),
                pos=int(fields["pos"]),
                run=int(fields["run"]) if "run" in fields else None,
                batch=int(fields["batch"]) if "batch" in fields else None,
                what=fields.get("what", "token"),
                fresh=fields.get("fresh", "0") not in ("0", "false"),
            )
        except ValueError as exc:
            raise UsageError(f"fake diverge spec has a non-integer value: {spec!r}") from exc


@dataclass(frozen=True)
class FakeOptions:
    diverge: str = ""  # injections separated by ';' (see Injection.parse)
    salt: str = ""  # changes every token and the weights hash: a "different model"
    max_tier: int = ranged(2, ints(0, 3))  # highest tier the fake claims to enforce
    batch_invariant: bool = False  # claim tier-3 batch invariance
    batch_drift: float = ranged(0.0, floats(-100, 100))  # logprob offset per extra batch member (non-invariant numerics)
    stable_threads: int = ranged(0, ints(0, 1024))  # > 0: at --threads N, batch_drift and batch= injections vanish (a knob for diagnose tests)
    capture: str = "modules"  # what capture() offers: none (a backend without internals), layers or modules
    capture_module: str = "model.layers.0.mlp.down_proj"  # the scripted module an applying injection moves
    capture_nudge: float = ranged(1e-3, floats(0, 1))  # how far, relative to its output (3e-7: a reduction-order wobble)
    capture_from_step: int = ranged(-1, ints(-1, 1_000_000))  # >= 0: the move happens at this earlier step (cached K/V carry it)
    alone: bool = False  # compute each request of a batch alone: an engine that cannot co-schedule (engagement tests)


class FakeBackend(Backend):
    name = "fake"
    uses_torch = False
    Options = FakeOptions

    def __init__(self, options: FakeOptions | None = None, *, model: str = "fake", dtype: str = "float32") -> None:
        self.requested_dtype = dtype  # recorded like a real engine's: "auto" resolves to float32
        self.options = options or FakeOptions()
        self.model = model
        self.injections = tuple(Injection.parse(s) for s in self.options.diverge.split(";") if s.strip())
        self._seen: dict[tuple[int, int], int] = {}  # (prompt_index, batch size) -> generations so far
        self._threads: int | None = None  # --threads of the current run (stable_threads compares with it)

    @classmethod
    def from_config(cls, config: RunConfig) -> "FakeBackend":
        return cls(parse_options(FakeOptions, config.options, "fake"), model=config.model, dtype=config.dtype)

    def capabilities(self) -> Capabilities:
        tier = 3 if self.options.batch_invariant else min(self.options.max_tier, 2)
        notes = () if tier == 3 else ("fake backend configured without batch_invariant",)
        return Capabilities(max_tier=tier, logprobs=True, sampling=True, batch_invariant=self.options.batch_invariant, notes=notes,
                            capture=self.options.capture)

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def _score(self, *parts: object) -> int:
        h = hashlib.sha256(repr((self.options.salt,) + parts).encode()).digest()
        return int.from_bytes(h[:8], "little")

    def generate(
        self, requests: Sequence[Request], decoding: Decoding, *, seed: int, n_logprobs: int, logprobs: bool
    ) -> list[Generation]:
        out = []
        size = len(requests)
        in_fresh_child = os.environ.get("DETLLM_FRESH_CHILD") == "1"  # set by fresh.py in a fresh-process repeat
        stable = bool(self.options.stable_threads) and self._threads == self.options.stable_threads
        for req in requests:
            key = (req.prompt_index, size)
            run = self._seen.get(key, 0)
            self._seen[key] = run + 1
            rng = random.Random(request_seed(seed, req))  # the prompt's content, not its position (base.request_seed)
            inj = self._applying(req, run, size, stable, in_fresh_child)
            out.append(self._one(req, decoding, rng, n_logprobs, logprobs, 1 if stable else size, inj))
            out[-1].evidence = {"computed_with": {"rows": 1 if self.options.alone else size, "forwards": decoding.max_new_tokens,
                                                  "seen_by": "fake: each request computed alone (alone=true)" if self.options.alone
                                                  else "fake: each batch computed together"}}
        return out

    def _applying(self, req: Request, run: int, size: int, stable: bool, in_fresh_child: bool) -> list[Injection]:
        return [i for i in self.injections
                if i.prompt == req.prompt_index and (i.run is None or i.run == run) and (i.batch is None or i.batch == size)
                and not (stable and i.batch is not None) and (not i.fresh or in_fresh_child)]

    def capture(self, requests: Sequence[Request], decoding: Decoding, *, seed: int, n_logprobs: int,
                spec: CaptureSpec) -> Capture:
        """The batch re-run as generate() runs it (a re-run is the first run: run=0) up to spec.step, and
        the scripted model's modules at spec.step for row spec.row (_ScriptedModel)."""
        if self.options.capture == "none":
            raise NotImplementedError("fake configured with capture=none")
        size, stable = len(requests), bool(self.options.stable_threads) and self._threads == self.options.stable_threads
        short = Decoding(spec.step + 1, decoding.temperature, decoding.top_p, decoding.top_k)
        gens, moved = [], None
        for row, req in enumerate(requests):
            inj = self._applying(req, 0, size, stable, os.environ.get("DETLLM_FRESH_CHILD") == "1")
            gens.append(self._one(req, short, random.Random(request_seed(seed, req)), n_logprobs, True, 1 if stable else size, inj))
            if row == spec.row:
                moved = next((i.pos for i in inj), None)
        width = max(len(r.input_ids) for r in requests)
        model = _ScriptedModel(self.options, requests[spec.row], gens[spec.row].token_ids, width, size)
        captured = model.capture(spec, moved)
        captured.generations = gens
        return captured

    def _one(self, req, decoding, rng, n_logprobs, want_logprobs, size, injections) -> Generation:
        ids: list[int] = []
        lps: list[float] = []
        tops: list[list[tuple[int, float]]] = []
        span = _LAST - _FIRST + 1
        prefix = hashlib.sha256(f"({self.options.salt!r}, {tuple(req.input_ids)!r}, ".encode())  # repr of the (salt, ids, generated) key, up to the last part
        for pos in range(decoding.max_new_tokens):
            h = prefix.copy()  # == self._score(tuple(req.input_ids), tuple(ids)), without re-hashing the prompt per token
            h.update(f"{tuple(ids)!r})".encode())
            base = int.from_bytes(h.digest()[:8], "little")
            cands = [_FIRST + (base + 7 * j) % span for j in range(max(n_logprobs, 2))]
            cand_lp = [-0.05 - 0.7 * j - (base % 97) / 1000.0 for j in range(len(cands))]
            if not decoding.greedy:
                choice = rng.randrange(min(len(cands), decoding.top_k or len(cands)))
            else:
                choice = 0
            tok, lp = cands[choice], cand_lp[choice]
            for inj in injections:
                if inj.pos == pos and inj.what == "token":
                    # the runner-up becomes the top-1 (and the chosen token), as if the scores had moved
                    cands[0], cands[1] = cands[1], cands[0]
                    tok, lp = cands[choice], cand_lp[choice]
                elif inj.pos == pos and inj.what == "logprob":
                    lp += 1e-6
                    cand_lp[choice] = lp
            drift = self.options.batch_drift * (size - 1)
            ids.append(tok)
            lps.append(lp + drift)
            tops.append([(c, l + drift) for c, l in zip(cands[:n_logprobs], cand_lp[:n_logprobs])])
        texts = [chr(t) for t in ids]
        return Generation(
            token_ids=ids,
            token_texts=texts,
            text="".join(texts),
            finish_reason="length",
            logprobs=lps if want_logprobs else None,
            top_logprobs=tops if want_logprobs else None,
        )

    def model_identity(self) -> ModelIdentity:
        w = hashlib.sha256(f"fake-weights:{self.options.salt}".encode()).hexdigest()
        return ModelIdentity(
            id=self.model,
            path=None,
            revision=None,
            format="fake",
            weights=(WeightFile("fake.weights", w, 0),),
            weights_sha256=hashlib.sha256(f"fake.weights:{w}".encode()).hexdigest(),
            tokenizer_sha256=hashlib.sha256(b"fake-utf8-byte-tokenizer").hexdigest(),
        )

    @contextmanager
    def determinism(self, *, tier: int, seed: int, threads: int | None) -> Iterator[list[Applied]]:
        self._threads = threads
        yield [
            Applied("seed", seed, True, seed, "per-request random.Random(request_seed(seed, prompt id, occurrence))"),
            Applied("threads", threads, False, None, "the fake backend runs no threads"),
            Applied("dtype", self.requested_dtype, True, "float32" if self.requested_dtype == "auto" else self.requested_dtype,
                    "scripted numbers: recorded as a real engine would"),
        ]

    def env_info(self) -> dict:
        return {"name": "fake", "version": "1"}

    @classmethod
    def installed(cls) -> Installed:
        return Installed(True, engine="scripted tokens for tests (no model)")


class _ScriptedModel:
    """Two scripted decoder layers under Hugging Face module names. Each module's output is a pure
    function of (module, row tokens, step) times (1 + d), d the relative move it carries: zero until the
    chosen module moves (at the injection's step, or capture_from_step), then growing 1.5x per module.
    A move at an earlier step reaches later steps through the cached K/V of the layers after it."""

    H = 8  # hidden size
    LAYER = ("input_layernorm:norm", "self_attn.q_proj:gemm", "self_attn.k_proj:gemm", "self_attn.v_proj:gemm",
             "self_attn.o_proj:gemm", "self_attn:attention", "post_attention_layernorm:norm", "mlp.gate_proj:gemm",
             "mlp.up_proj:gemm", "mlp.act_fn:activation", "mlp.down_proj:gemm", "mlp:other", ":layer")

    def __init__(self, options: FakeOptions, req: Request, generated: list[int], width: int, size: int) -> None:
        self.o, self.req, self.generated, self.width, self.size = options, req, generated, width, size
        self.names = [("model.embed_tokens", "embedding")]
        for layer in range(2):
            self.names += [(f"model.layers.{layer}" + (f".{n}" if n else ""), k) for n, k in (x.split(":") for x in self.LAYER)]
        self.names += [("model.norm", "norm"), ("lm_head", "logits")]

    def _base(self, name: str, step: int, rows: int):
        import numpy as np

        key = hashlib.sha256(repr((self.o.salt, name, tuple(self.req.input_ids), tuple(self.generated[:step]))).encode()).digest()
        return np.random.default_rng(int.from_bytes(key[:8], "little")).standard_normal((rows, self.H)).astype(np.float32)

    def _layer_of(self, name: str) -> int:
        parts = name.split(".")
        return int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else -1

    def capture(self, spec: CaptureSpec, moved: int | None) -> Capture:
        import numpy as np

        # the step the module moves at, on the side an injection applies to (None: it never moves)
        at = None if moved is None else (self.o.capture_from_step if self.o.capture_from_step >= 0 else moved)
        rows = len(self.req.input_ids) if spec.step == 0 else 1
        pad = self.width - rows if spec.step == 0 else 0  # left padding in the captured row (prefill), as engines see it
        target = self.o.capture_module
        hit = at is not None and at == spec.step
        kv_moved = at is not None and at < spec.step  # K/V written at step `at` by the layers after the module
        tensors, d, prev = [], 0.0, np.asarray(self.req.input_ids if spec.step == 0 else self.generated[spec.step - 1:spec.step],
                                                  dtype=np.int64)[:, None]
        entering = prev  # the hidden state entering the current decoder layer (a layer's own input)
        for order, (name, kind) in enumerate(self.names):
            base = self._base(name, spec.step, rows)
            inputs = [entering if kind == "layer" else prev]
            if kind == "attention" and spec.step > 0:
                past = len(self.req.input_ids) + spec.step - 1
                carry = 1 + self.o.capture_nudge if kv_moved and self._layer_of(name) > self._layer_of(target) else 1.0
                kv = [(self._base(name + suffix, 0, past) * np.float32(carry)).astype(np.float32) for suffix in ("/k", "/v")]
                inputs += kv
                if carry != 1.0:
                    d = d or self.o.capture_nudge
            if hit and name == target:
                d += self.o.capture_nudge
            elif d:
                d *= 1.5
            out = (base * np.float32(1 + d)).astype(np.float32)
            # each side's error against float64: a rounding-sized nudge (<= 1e-6) is the engine's own rounding
            # on both sides; a larger one is an error of the moved module on the moved side only
            wobble = self.o.capture_nudge <= 1e-6
            noise = float(np.abs(base).max()) * max(8 * self.o.capture_nudge if wobble else 1e-7,
                                                    self.o.capture_nudge if hit and name == target else 0.0)
            if pad:
                filler = np.full((pad, self.H), float(self.size), dtype=np.float32)  # padding rows: batch-dependent
                out_seen, inputs = np.concatenate([filler, out]), [np.concatenate([np.zeros((pad,) + i.shape[1:], i.dtype), i])
                                                                      if i.shape[0] == rows else i for i in inputs]
            else:
                out_seen = out
            tensors.append(CapturedTensor(
                name=name, kind=kind, order=order, output=out_seen, inputs=inputs,
                input_shapes=[(self.size,) + tuple(i.shape) for i in inputs], output_shape=(self.size,) + out_seen.shape,
                ref_error=noise if spec.reference else None, input_names=["hidden_states", "past_keys", "past_values"][:len(inputs)],
                cached_steps=[0] * len(self.req.input_ids) + list(range(1, spec.step)) if len(inputs) > 1 else [],
                cached_from_step=(at if kv_moved and len(inputs) > 1 and self._layer_of(name) > self._layer_of(target) else
                                  (0 if len(inputs) > 1 else None))))
            prev = out
            if kind in ("embedding", "layer"):
                entering = out
        level, notes = spec.level, ["scripted capture of the fake backend: no model ran"]
        if level == "layers" or sum(t.output.nbytes + sum(i.nbytes for i in t.inputs) for t in tensors) > spec.max_bytes:
            tensors = [t for t in tensors if t.kind in ("embedding", "layer", "logits")]
            level = "layers"
            notes.append("layer boundaries only")
        return Capture(generations=[], tensors=tensors, level=level, notes=notes, engine={"scripted": True})
