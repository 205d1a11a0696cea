"""`openai`: drive any OpenAI-compatible server (vLLM serve, SGLang, llama-server, TGI, Ollama,
a hosted endpoint) over HTTP, as a client. A batch of N requests is N requests in flight at once,
so the server's own scheduler batches them; what it reports about that batch is recorded.

Owns the request bodies (completions or chat, decoding knobs per server kind, the seed rule),
reading logprobs and token ids out of the answers, server and model identity, the capability
probe, and the cold/warm/after-prefix sequence of the cache probe. HTTP, concurrency, retries and
error translation live in load.py; reading logprobs and ids out of the answers in answers.py; the
cache probe's verdict in detllm/cacheprobe.py.
"""

from __future__ import annotations

import hashlib
import os
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from ...core.config import Decoding, RunConfig
from ...runfolder.env import dist_version
from ...core.errors import BackendError, BackendUnavailableError, UsageError
from ...core.overlap import NOT_ENGAGED, served_group
from ...models.gguf import FLOAT_TYPES as FLOAT_GGUF
from ..base import Applied, Backend, Capabilities, Generation, Installed, ModelIdentity, Request, parse_options, request_seed
from .answers import cached_tokens as _cached_tokens, choice as _choice, plain_steps as _plain_steps, shape as _answers_shape, steps as _steps
from .load import Endpoint, NoAnswer, Reply, safe_url as _safe_url
from .options import OpenAIOptions, validate

REMOTE = "weights not hashed: remote"
# How each server kind's prompt (prefix) cache is switched: only llama-server takes it per request.
SERVER_CACHE = {
    "llamacpp": "per request: the `cache_prompt` field (--opt cache_prompt=false)",
    "vllm": "server-level: --enable-prefix-caching / --no-enable-prefix-caching where it is started; POST /reset_prefix_cache "
            "(VLLM_SERVER_DEV_MODE=1) empties it for every client at once",
    "sglang": "server-level: --disable-radix-cache where it is started; POST /flush_cache empties it for every client at once",
}


class OpenAIBackend(Backend):
    name = "openai"
    uses_torch = False
    Options = OpenAIOptions

    def __init__(self, model: str, options: OpenAIOptions, *, threads: int | None = None) -> None:
        validate(options)
        self.options = o = options
        self.model = model
        self.threads = threads
        key = None
        if o.api_key_env:
            key = os.environ.get(o.api_key_env)
            if not key:
                raise UsageError(f"--api-key-env names {o.api_key_env!r}, which is not set or empty",
                                 hint=f"export {o.api_key_env}=... before running")
        self.endpoint = Endpoint(o.base_url or "", api_key=key, timeout=o.request_timeout,
                                 connect_timeout=o.connect_timeout, retries=o.retries)
        self.kind = o.server if o.server != "auto" else self._detect()
        self._refuse_cache_switch()
        self.served = self._check_model()
        self.path = "/chat/completions" if o.chat else "/completions"
        self.prompt_as = "chat" if o.chat else self._prompt_as()
        self.has_logprobs, self.ids_known, self.probe_note = self._probe()
        self._stash: dict[tuple[str, int], list[Generation]] = {}  # cache probe: warm answers waiting for their run
        self.dtype_asked = "auto"  # --dtype: recorded; a server's dtype is set where it was started

    @classmethod
    def from_config(cls, config: RunConfig) -> "OpenAIBackend":
        opts = parse_options(OpenAIOptions, config.options, "openai")
        if config.decoding.top_k and opts.server == "generic":
            raise UsageError("--top-k is not part of the OpenAI API and this server was declared generic",
                             hint="drop --top-k, or pass --opt server=vllm|sglang|llamacpp")
        backend = cls(config.model, opts, threads=config.threads)
        backend.dtype_asked = config.dtype
        return backend

    # -- discovery, before anything is written --

    def _detect(self) -> str:
        status, props, _ = self.endpoint.get("/props", root=True)
        if status == 0 and isinstance(props, NoAnswer):  # it took the connection and said nothing: a timeout (exit 4)
            raise self.endpoint.unreachable(_safe_url(self.endpoint.url("/props", root=True)), props)
        if status == 0:  # nothing answers there: say so (exit 4), not what a server of unknown kind cannot do
            status, doc, _ = self.endpoint.get("/models", timeout=self.options.connect_timeout + 5)
            if status == 0:
                raise self.endpoint.unreachable(_safe_url(self.endpoint.url("/models")), doc)
        if status == 200 and isinstance(props, dict) and ("build_info" in props or "total_slots" in props):
            return "llamacpp"
        status, info, _ = self.endpoint.get("/get_server_info", root=True)
        if status == 200 and isinstance(info, dict):
            return "sglang"
        status, ver, _ = self.endpoint.get("/version", root=True)
        if status == 200 and isinstance(ver, dict) and "version" in ver:
            return "vllm"
        status, models, _ = self.endpoint.get("/models")  # the last word: who owns the models it lists
        owners = {str(m.get("owned_by")) for m in (models or {}).get("data", []) if isinstance(m, dict)} if isinstance(models, dict) else set()
        return next((k for k in ("llamacpp", "vllm", "sglang") if k in owners), "generic")

    def _refuse_cache_switch(self) -> None:
        """--opt cache_prompt is llama-server's per-request field; elsewhere it would be sent and ignored."""
        if self.options.cache_prompt is None or self.kind == "llamacpp":
            return
        raise UsageError(f"--opt cache_prompt is llama-server's per-request field; this {self.kind} server takes no such field: "
                         + SERVER_CACHE.get(self.kind, "no per-request cache switch is known for it"),
                         hint="drop --opt cache_prompt; switch the cache where the server is started")

    def _check_model(self) -> list[str]:
        """The names the server lists; a model it does not list is refused here (a server that
        serves one model, like llama-server, would otherwise answer for any name)."""
        status, doc, _ = self.endpoint.get("/models", timeout=self.options.connect_timeout + 5)
        if status == 0:
            raise self.endpoint.unreachable(_safe_url(self.endpoint.url("/models")), doc)
        if status in (401, 403):
            from .load import http_error

            raise http_error(_safe_url(self.endpoint.url("/models")), status, doc)
        names = [str(m.get("id")) for m in (doc or {}).get("data", []) if isinstance(m, dict)] if status == 200 and isinstance(doc, dict) else []
        aliases = set(names) | {n.rsplit("/", 1)[-1] for n in names}
        if names and self.model not in aliases:
            raise UsageError(f"the server at {_safe_url(self.endpoint.base_url)} does not serve model {self.model!r}",
                             hint=f"it serves: {', '.join(names[:10])}")
        self._models_doc = doc if status == 200 else None
        return names

    def _prompt_as(self) -> str:
        if self.options.prompt_as == "text":
            return "text"
        ids = self._tokenize("probe") if self.kind in ("llamacpp", "vllm", "sglang") else None
        if ids is None and self.options.prompt_as == "ids":
            raise UsageError("--opt prompt_as=ids needs a server with a /tokenize endpoint (llama-server, vLLM, SGLang)")
        return "ids" if ids is not None else "text"

    def _probe(self) -> tuple[bool, bool, str]:
        """One 1-token request with logprobs: does the server answer, and with logprobs and ids?"""
        req = Request(0, tuple(self._tokenize("Hello") or ()) if self.prompt_as == "ids" else (), "Hello", "probe")
        body = self._body(req, Decoding(max_new_tokens=1), seed=0, n_logprobs=1, logprobs=True)
        try:
            reply = self.endpoint.post(self.path, body, what="the capability probe")
        except UsageError as exc:
            if "logprob" not in exc.message.lower():
                raise
            self.endpoint.post(self.path, self._body(req, Decoding(max_new_tokens=1), seed=0, n_logprobs=1, logprobs=False),
                               what="the capability probe")
            return False, False, f"the server rejected logprobs: {exc.message}"
        self._refuse_other_api(reply.doc)
        steps = _steps(_choice(reply.doc).get("logprobs"))
        if not steps:
            return False, False, "the server answered without logprobs"
        ids = all(s.id is not None for s in steps) and all(t[1] is not None for s in steps for t in s.top)
        return True, ids, ""

    def _refuse_other_api(self, doc: Any) -> None:
        """An answer without OpenAI `choices` means --base-url is not the OpenAI root: llama-server
        answers its native API (`content`, `tokens`) at the root too (exit 4, before anything is written)."""
        if isinstance(doc, dict) and "choices" in doc:
            return
        url = _safe_url(self.endpoint.url(self.path))
        if isinstance(doc, dict) and "content" in doc and not self.endpoint.base_url.endswith("/v1"):
            raise BackendUnavailableError(f"{url} answered with llama-server's native API, not the OpenAI one",
                                          hint=f"use --base-url {_safe_url(self.endpoint.base_url)}/v1")
        raise BackendUnavailableError(f"{url} did not answer like an OpenAI completion ({_answers_shape(doc)})",
                                      hint="--base-url must be the OpenAI-compatible root, e.g. http://host:port/v1")

    def _tokenize(self, text: str, *, special: bool = True, fault: bool = False) -> list[int] | None:
        """The server's token ids for `text`, or None where it has no /tokenize. With `fault` (the
        run's prompts: /tokenize answered before the run) a failure is the backend's (exit 8)."""
        if self.kind == "llamacpp":
            status, doc = self.endpoint.try_post("/tokenize", {"content": text, "add_special": special, "parse_special": special}, root=True)
        elif self.kind in ("vllm", "sglang"):
            status, doc = self.endpoint.try_post("/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": special}, root=True)
        else:
            return None
        if status != 200 or not isinstance(doc, dict) or not isinstance(doc.get("tokens"), list):
            if not fault:
                return None
            url = _safe_url(self.endpoint.url("/tokenize", root=True))
            if status == 0:  # the server tokenized the probe, and now nothing listens: it went away
                raise BackendError(f"the server went away while tokenizing the prompts: {url} could not be reached ({doc})",
                                   hint="the server was stopped or crashed; nothing of this run is complete: start it again and rerun")
            raise BackendError(f"{url} failed while tokenizing the prompts (HTTP {status}) although it tokenized before the run",
                               hint="a server fault; nothing of this run is complete (--opt prompt_as=text lets the server tokenize)")
        toks = doc["tokens"]
        return [int(t["id"]) if isinstance(t, dict) else int(t) for t in toks]

    # -- Backend interface --

    def capabilities(self) -> Capabilities:
        notes = ["a served engine's batch invariance cannot be enforced by a client; --concurrency measures it"]
        if not self.has_logprobs:
            notes.insert(0, self.probe_note + ": tier 2 needs per-token logprobs")
        return Capabilities(max_tier=2 if self.has_logprobs else 1, logprobs=self.has_logprobs, sampling=True,
                            batch_invariant=False, notes=tuple(notes))

    def tokenize(self, text: str) -> list[int]:
        if self.prompt_as != "ids":
            return []  # the server tokenizes text (or renders chat messages) itself; nothing to record
        ids = self._tokenize(text, fault=True)
        assert ids is not None  # fault=True raises instead
        return ids

    def generate(self, requests: Sequence[Request], decoding: Decoding, *, seed: int, n_logprobs: int, logprobs: bool) -> list[Generation]:
        want = logprobs and self.has_logprobs
        if self.options.cache_probe:
            return [self._probe_one(r, decoding, seed, n_logprobs, want) for r in requests]
        bodies = [self._body(r, decoding, seed=seed, n_logprobs=n_logprobs, logprobs=want and not r.is_filler, filler=r.is_filler)
                  for r in requests]
        attempts: list[dict[str, Any]] = []
        while True:  # a group shown not engaged is sent again (at most twice more, connections opened first)
            replies, ev = self.endpoint.send_batch(self.path, bodies, sample=self._sample_source(),
                                                   interval=self.options.sample_interval, preconnect=bool(attempts))
            batch = ev.to_json(len(requests))
            if self._slots() is not None:
                batch["server_slots"] = self._slots()
            gens = [self._generation(r, rep, b, want, batch) for r, rep, b in zip(requests, replies, bodies)]
            answer, why = served_group([g.evidence or {} for g in gens])
            few_slots = (batch.get("server_slots") or len(requests)) < len(requests)  # sending again cannot help
            if len(requests) < 2 or answer != NOT_ENGAGED or len(attempts) == 2 or few_slots:
                break
            attempts.append({"answer": answer, "why": why})  # recorded: the verdict reads the last attempt
        if attempts:
            batch["earlier_attempts"] = attempts
        return gens

    def close(self) -> None:
        self.endpoint.close()  # the connections kept from batch to batch, and their loop (load.py)

    def _slots(self) -> int | None:
        """llama-server's total slots (/props), read once: fewer than a group's requests cannot compute it together."""
        if not hasattr(self, "_total_slots"):
            self._total_slots = None
            if self.kind == "llamacpp":
                _, props, _ = self.endpoint.get("/props", root=True)
                n = props.get("total_slots") if isinstance(props, dict) else None
                self._total_slots = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None
        return self._total_slots

    def model_identity(self) -> ModelIdentity:
        path = None
        if self.kind == "llamacpp":
            _, props, _ = self.endpoint.get("/props", root=True)
            path = props.get("model_path") if isinstance(props, dict) else None
        elif isinstance(self._models_doc, dict):
            for m in self._models_doc.get("data", []):
                if isinstance(m, dict) and self.model in (m.get("id"), str(m.get("id", "")).rsplit("/", 1)[-1]):
                    path = m.get("root") if isinstance(m.get("root"), str) else None
        ftype = self._ftype()
        return ModelIdentity(id=self.model, path=path, revision=None, format="remote", weights=(), weights_sha256=None,
                             tokenizer_sha256=None, quantization=ftype if ftype and ftype not in FLOAT_GGUF else None, config_sha256=None,
                             remote=f"{REMOTE} (served by {self.kind} at {_safe_url(self.endpoint.base_url)})")

    def _ftype(self) -> str | None:
        """llama-server's weight type from /v1/models meta.ftype ("all F32", "Q4_1"...), else None."""
        for m in (self._models_doc or {}).get("data", []) if isinstance(self._models_doc, dict) else []:
            meta = m.get("meta") if isinstance(m, dict) else None
            if isinstance(meta, dict) and isinstance(meta.get("ftype"), str):
                return meta["ftype"].removeprefix("all ").removeprefix("mostly ").strip().upper() or None
        return None

    @contextmanager
    def determinism(self, *, tier: int, seed: int, threads: int | None) -> Iterator[list[Applied]]:
        self.endpoint.running = True  # from here a refused connection means the server went away mid-run
        knobs = self._knobs(Decoding(), filler=False)
        ftype = self._ftype()
        in_effect = FLOAT_GGUF.get(ftype or "") or ftype
        dtype = Applied("dtype", self.dtype_asked, in_effect == self.dtype_asked, in_effect,
                        f"the server's weights are {ftype} (/v1/models meta.ftype)" if ftype else
                        "set where the server was started, not visible to a client: --dtype names it for the noise floor")
        yield [
            dtype,
            Applied("seed", seed, True, "request_seed(seed, request) & 0x7FFFFFFF per request",
                    "sent as `seed`; whether the server honours it shows only in repeats (a repeat that differs at temperature 0 "
                    "and concurrency 1 is reported as RUN_VARIANCE)"),
            Applied("threads", threads, threads is None, None, "a server's threads are set where it is started, not by its clients"),
            Applied("server_knobs", None, True, knobs, f"sent with every request to this {self.kind} server"),
            Applied("prompt_as", self.options.prompt_as, True, self.prompt_as,
                    {"ids": "prompts posted as token ids from the server's /tokenize", "text": "prompts posted as text",
                     "chat": "chat messages: the server renders the prompt; the rendered prompt is not visible"}[self.prompt_as]),
            Applied("token_ids", None, self.ids_known, "ids" if self.ids_known else "strings",
                    "token ids from the server" if self.ids_known else "the server gives token strings only: traces hold token strings"),
            Applied("prefix_cache", self.options.cache_prompt, True, self._cache_state(),
                    ("as the server is configured" if self.options.cache_prompt is None or self.options.cache_probe
                     else f"cache_prompt: {str(self.options.cache_prompt).lower()} sent with every request")
                    + ("; cold side of --cache-probe: " + self._reset_how() if self.options.cache_probe else "")),
            Applied("retries", self.options.retries, True, self.options.retries,
                    "only for requests the server did not take (connect refused, 429, 503); each record's evidence counts them"),
        ]

    @classmethod
    def installed(cls) -> Installed:
        httpx = dist_version("httpx")
        if httpx is None:
            return Installed(False, why="httpx is not installed", fix="pip install 'detllm[openai]'")
        # a client of a running server (docs/backends/openai.md): the server decides the tier, so doctor asks none
        return Installed(True, engine=f"httpx {httpx}, a client: point --base-url at a running server",
                         tier_note="set by the server: 2 where it returns logprobs, else 1")

    def env_info(self) -> dict[str, Any]:
        e = self.endpoint
        info: dict[str, Any] = {"name": self.name, "server": self.kind, "base_url": _safe_url(e.base_url),
                                "api_key_env": self.options.api_key_env,
                                "cache_switch": SERVER_CACHE.get(self.kind, "none known for a server of unknown kind")}
        _, models, headers = e.get("/models")
        info["models"] = [{k: m.get(k) for k in ("id", "root", "owned_by", "max_model_len", "meta") if k in m}
                          for m in (models or {}).get("data", []) if isinstance(m, dict)] if isinstance(models, dict) else None
        info["headers"] = {k: v for k, v in (headers or {}).items() if k.lower() in ("server", "x-powered-by", "openai-version")}
        if self.kind == "llamacpp":
            _, props, _ = e.get("/props", root=True)
            if isinstance(props, dict):
                tmpl = props.get("chat_template")
                info["props"] = {"build_info": props.get("build_info"), "model_path": props.get("model_path"),
                                 "total_slots": props.get("total_slots"),
                                 "n_ctx": (props.get("default_generation_settings") or {}).get("n_ctx"),
                                 "chat_template_sha256": hashlib.sha256(tmpl.encode()).hexdigest() if isinstance(tmpl, str) else None}
        for path in ("/version", "/get_server_info", "/info", "/api/version"):
            status, doc, _ = e.get(path, root=True)
            if status == 200 and isinstance(doc, dict):
                info[path.strip("/").replace("/", "_")] = {k: v for k, v in doc.items() if isinstance(v, (str, int, float, bool))}
        status, metrics, _ = e.get("/metrics", root=True)
        if status == 200 and isinstance(metrics, str):
            info["metrics_info"] = sorted({ln.split(" ")[0] for ln in metrics.splitlines() if "_info{" in ln and not ln.startswith("#")})[:20]
        return info

    # -- requests --

    def _body(self, req: Request, decoding: Decoding, *, seed: int, n_logprobs: int, logprobs: bool, filler: bool = False,
              cache: bool | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": decoding.max_new_tokens, "temperature": decoding.temperature,
                                "top_p": decoding.top_p, "seed": request_seed(seed, req) & 0x7FFFFFFF, "n": 1, "stream": False}
        if self.options.chat:
            body["messages"] = [{"role": "user", "content": req.text}]
            if logprobs:
                body["logprobs"], body["top_logprobs"] = True, n_logprobs
        else:
            body["prompt"] = list(req.input_ids) if self.prompt_as == "ids" and req.input_ids else req.text
            if logprobs:
                body["logprobs"] = n_logprobs
        body.update(self._knobs(decoding, filler=filler, cache=cache))
        return body

    def _knobs(self, decoding: Decoding, *, filler: bool, cache: bool | None = None) -> dict[str, Any]:
        """Server-specific settings sent explicitly, so that nothing runs on a hidden default
        (llama-server samples with top_k 40, min_p 0.05 and repeat_penalty 1.1 unless told)."""
        k: dict[str, Any] = {}
        if self.kind == "llamacpp":
            k = {"top_k": decoding.top_k, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0, "return_tokens": True}
            cache = self.options.cache_prompt if cache is None else cache  # the cache probe sets its own sides
            if cache is not None:
                k["cache_prompt"] = cache
        elif self.kind in ("vllm", "sglang"):
            k = {"top_k": decoding.top_k or -1, "min_p": 0.0, "repetition_penalty": 1.0}
            if self.kind == "vllm":
                k["return_tokens_as_token_ids"] = True
        elif decoding.top_k:
            k = {"top_k": decoding.top_k}
        if filler and self.kind != "generic":
            k["ignore_eos"] = True  # a filler keeps its slot busy for the whole generation
        return k

    def _sample_source(self) -> str | None:
        return {"llamacpp": "/slots", "vllm": "/metrics", "sglang": "/metrics"}.get(self.kind)

    def _cache_state(self) -> Any:
        if self.kind == "llamacpp" and self.options.cache_prompt is not None and not self.options.cache_probe:
            return {"cache_prompt": self.options.cache_prompt, "sent": "with every request"}
        if self.kind == "llamacpp":
            _, props, _ = self.endpoint.get("/props", root=True)
            dgs = (props or {}).get("default_generation_settings", {}) if isinstance(props, dict) else {}
            params = dgs.get("params", dgs)
            return {"cache_prompt": params.get("cache_prompt", "server default")}
        return "server default (not visible to a client)"

    def _reset_how(self) -> str:
        return {"llamacpp": "cache_prompt:false on slot 0", "vllm": "POST /reset_prefix_cache (served with VLLM_SERVER_DEV_MODE=1)",
                "sglang": "POST /flush_cache"}.get(self.kind, "no reset: the first request of each prompt is taken as cold")

    # -- answers --

    def _generation(self, req: Request, reply: Reply, body: dict[str, Any], want: bool, batch: dict[str, Any] | None,
                    extra: dict[str, Any] | None = None) -> Generation:
        choice = _choice(reply.doc)
        text = (choice.get("message") or {}).get("content") or "" if self.options.chat else choice.get("text") or ""
        finish = "length" if choice.get("finish_reason") == "length" else "stop"
        plain = _plain_steps(choice.get("logprobs")) if want else None  # most servers' layout, read without step objects
        steps = _steps(choice.get("logprobs")) if want and plain is None else None
        ev: dict[str, Any] = {"route": self.path, "prompt_as": self.prompt_as, "seed": body["seed"], "retries": reply.retries,
                              "timing_ms": [round(reply.started_ms, 1), round(reply.finished_ms, 1)]}
        if batch is not None:
            ev["server_batch"] = batch
        usage = reply.doc.get("usage") if isinstance(reply.doc, dict) else None
        cached = _cached_tokens(reply.doc)
        if cached is not None:
            ev["cached_prompt_tokens"] = cached
        for key in ("prompt_tokens", "completion_tokens"):  # completion_tokens > len(token_ids): the server left steps out
            if isinstance(usage, dict) and isinstance(usage.get(key), int):
                ev[key] = usage[key]
        timings = reply.doc.get("timings") if isinstance(reply.doc, dict) else None
        if isinstance(timings, dict) and isinstance(timings.get("predicted_ms"), (int, float)):
            # llama-server: the time the server spent on this request; overlapping ones add up to more than the wall time
            ev["server_ms"] = round(float(timings.get("prompt_ms") or 0) + float(timings["predicted_ms"]), 3)
        if isinstance(reply.doc, dict) and reply.doc.get("system_fingerprint"):
            ev["system_fingerprint"] = str(reply.doc["system_fingerprint"])
        ev.update(extra or {})
        if plain is not None:  # token texts, no ids: what the steps below give for such an answer
            ev["tokens_as"] = "strings"
            return Generation(plain[0], plain[1], text, finish, plain[2], plain[3], evidence=ev)
        if steps:
            use_ids = all(s.id is not None for s in steps) and all(t[1] is not None for s in steps for t in s.top)
            ev["tokens_as"] = "ids" if use_ids else "strings"
            ids: list[Any] = [s.id if use_ids else s.token for s in steps]
            tops = [[(t[1] if use_ids else t[0], t[2]) for t in s.top] for s in steps]
            return Generation(ids, [s.token for s in steps], text, finish, [s.logprob for s in steps], tops, evidence=ev)
        retok = self._tokenize(text, special=False) if text and self.kind != "generic" else None
        ev["tokens_as"] = "retokenized text" if retok is not None else "whole text"
        ids = retok if retok is not None else ([text] if text else [])
        return Generation(ids, [] if retok is None else [""] * len(retok), text, finish, evidence=ev)

    # -- cache probe: cold, warm, after a shared-prefix prompt, in a row --

    def _probe_one(self, req: Request, decoding: Decoding, seed: int, n: int, want: bool) -> Generation:
        key = (req.prompt_id, req.occurrence)
        if self._stash.get(key):
            return self._stash[key].pop(0)
        if key in self._stash:  # runs past the third: warm again
            return self._single(req, decoding, seed, n, want, cache=True, side="warm")
        cold = self._single(req, decoding, seed, n, want, cache=False, side="cold")
        warm = self._single(req, decoding, seed, n, want, cache=True, side="warm")
        text = req.text + " and then, a little later, the story went on"
        ids = tuple(self.tokenize(text)) if self.prompt_as == "ids" else ()
        shared = Request(-1, ids, text, "prefix:" + req.prompt_id)
        self._single(shared, decoding, seed, n, False, cache=True, side="shared_prefix")
        after = self._single(req, decoding, seed, n, want, cache=True, side="after_shared_prefix")
        self._stash[key] = [warm, after]
        return cold

    def _single(self, req: Request, decoding: Decoding, seed: int, n: int, want: bool, *, cache: bool, side: str) -> Generation:
        extra: dict[str, Any] = {"cache": {"side": side}}
        if not cache:
            reset = {"vllm": "/reset_prefix_cache", "sglang": "/flush_cache"}.get(self.kind)
            if reset:
                status, _ = self.endpoint.try_post(reset, None, root=True)
                extra["cache"]["reset"] = f"POST {reset}: HTTP {status}" if status else f"POST {reset}: unreachable"
            elif self.kind == "llamacpp":
                extra["cache"]["reset"] = "cache_prompt:false"
            else:
                extra["cache"]["reset"] = "none available: first request of the prompt"
        body = self._body(req, decoding, seed=seed, n_logprobs=n, logprobs=want,
                          cache=cache if self.kind == "llamacpp" else None)
        if self.kind == "llamacpp":
            body["id_slot"] = 0  # cold and warm on one slot: its KV cache is what warm reuses
        replies, _ = self.endpoint.send_batch(self.path, [body], sample=None, interval=1.0)
        return self._generation(req, replies[0], body, want, None, extra)
