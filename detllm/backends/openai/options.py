"""The `openai` backend's `--opt` settings (`OpenAIOptions`) and the checks that refuse a bad
one before any request, a credential in --base-url first of all (it would be recorded in the
run folder). What each setting does to a request is backend.py's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...core.config import floats, ints, ranged
from ...core.errors import UsageError
from .load import safe_url

KINDS = ("auto", "llamacpp", "vllm", "sglang", "generic")
PROMPT_AS = ("auto", "text", "ids")


@dataclass(frozen=True)
class OpenAIOptions:
    base_url: str | None = None  # the server's OpenAI root, e.g. http://127.0.0.1:8080/v1 (--base-url)
    api_key_env: str | None = None  # NAME of the environment variable holding the key (--api-key-env); the key is never recorded
    chat: bool = False  # /v1/chat/completions with one user message (--chat); else /v1/completions
    prompt_as: str = "auto"  # auto: token ids where the server has /tokenize, else text; or force text / ids
    server: str = "auto"  # server kind for its extra knobs (top_k, ignore_eos, token ids, cache reset); auto: detected
    request_timeout: float = ranged(300.0, floats(0, 86400, lo_open=True))  # seconds one request may take
    connect_timeout: float = ranged(10.0, floats(0, 3600, lo_open=True))  # seconds to open a connection
    retries: int = ranged(2, ints(0, 100))  # resends of a request the server did not take (connection refused, 429, 503), recorded
    sample_interval: float = ranged(0.02, floats(0, 60, lo_open=True))  # seconds between /slots or /metrics samples while a batch is in flight
    cache_probe: bool = False  # each prompt cold, then warm, then after a shared-prefix prompt (check --cache-probe)
    # llama-server's per-request `cache_prompt` field, sent with every request (false: no request reuses a cached
    # prompt prefix); None: as the server is configured. vLLM and SGLang switch their cache where they are started.
    cache_prompt: bool | None = None


def validate(o: OpenAIOptions) -> None:
    if not o.base_url:
        raise UsageError("the openai backend needs --base-url, e.g. http://127.0.0.1:8080/v1")
    if not re.match(r"^https?://[^/\s]+", o.base_url):
        raise UsageError(f"--base-url must be an http:// or https:// URL, got {safe_url(o.base_url)!r}")
    # the URL is recorded in run_config.json: a credential in it would travel with every pack
    if re.match(r"^https?://[^/@\s]+@", o.base_url) or re.search(r"[?&][^=&]*(key|token|secret|sig|passw)[^=&]*=", o.base_url, re.I):
        raise UsageError(f"--base-url {safe_url(o.base_url)!r} carries a credential, which would be recorded in the run folder",
                         hint="drop it from the URL and name the variable holding the key with --api-key-env")
    if o.server not in KINDS:
        raise UsageError(f"--opt server must be one of {', '.join(KINDS)}, got {o.server!r}")
    if o.prompt_as not in PROMPT_AS:
        raise UsageError(f"--opt prompt_as must be one of {', '.join(PROMPT_AS)}, got {o.prompt_as!r}")
    if o.chat and o.prompt_as == "ids":
        raise UsageError("--chat sends messages: --opt prompt_as=ids does not apply")
    if o.request_timeout <= 0 or o.connect_timeout <= 0 or o.sample_interval <= 0:
        raise UsageError("--opt request_timeout, connect_timeout and sample_interval must be positive seconds")
    if o.retries < 0:
        raise UsageError(f"--opt retries must be >= 0, got {o.retries}")
    if o.cache_probe and o.cache_prompt is not None:
        raise UsageError("--cache-probe sets cache_prompt itself (cold, then warm): drop --opt cache_prompt")
    if o.api_key_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", o.api_key_env):
        raise UsageError("--api-key-env takes the NAME of an environment variable, not the key itself")


__all__ = ["KINDS", "OpenAIOptions", "PROMPT_AS", "validate"]
