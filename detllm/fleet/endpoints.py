"""`detllm check --backend openai --base-url U1 --base-url U2 ...`: one ordinary check per endpoint,
all started at once (one thread each; each endpoint's batches are its own requests in flight, so
--concurrency is per endpoint), each into OUT/replica_<i>/ through the normal check path
(runner.execute), then the N-way verdict over them in OUT. An endpoint that fails or times out is
reported with its error and excluded; the others are kept. Traces stream to each replica's folder.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..runfolder.artifacts import default_out_dir
from ..pipeline.cacheprobe import probe_config, wants_probe
from ..core.config import RunConfig
from ..commands.diff import Selection, load_sides
from ..runfolder.env import Redaction
from ..backends.registry import create_backend
from ..core.errors import BackendUnavailableError, DetllmError, UsageError
from ..core.prompts import PromptSet, resolve_prompts
from ..pipeline.runner import execute
from .folder import REPLICA, FleetOutcome, check_fleet_out, prepare_fleet_out, write_fleet
from ..runfolder.fleetseal import begin_fleet, seal_fleet
from .stopping import fewer_collections, run_replicas
from ..commands.fleetverdict import Replica, fleet_verdict, own_check, prompt_keys

Progress = Callable[[int, int, int], None]


def check_urls(urls: Sequence[str]) -> list[str]:
    """Two or more distinct http(s) URLs without credentials, refused before anything runs."""
    urls = [u.rstrip("/") for u in urls]
    if len(urls) < 2:
        raise UsageError("a fleet check needs two or more --base-url")
    for u in urls:
        if not re.match(r"^https?://[^/\s]+", u):
            raise UsageError(f"--base-url must be an http:// or https:// URL, got {u.split('?', 1)[0]!r}")
        if re.match(r"^https?://[^/@\s]+@", u) or "?" in u:
            raise UsageError("a --base-url carries a credential or a query string, which would be recorded in the run folders",
                             hint="drop it from the URL and name the variable holding the key with --api-key-env")
    seen = [u for i, u in enumerate(urls) if u in urls[:i]]
    if seen:
        raise UsageError(f"--base-url {seen[0]!r} is given twice", hint="each replica once")
    return urls


def _error(exc: DetllmError) -> dict[str, Any]:
    """How a replica failed: timeout (the server took the connection and did not answer within
    request_timeout, at the first probe or later), unreachable (nothing answers: exit 4) or error."""
    cause = type(exc.__cause__).__name__ if exc.__cause__ is not None else ""
    kind = "timeout" if "Timeout" in cause else ("unreachable" if exc.exit_code == 4 else "error")
    return {"kind": kind, "exit_code": exc.exit_code, "message": exc.one_line()}


class _Totals:
    """Progress summed over the replicas (each reports its own done/total/tokens)."""

    def __init__(self, n: int, progress: Progress | None) -> None:
        self.each = [(0, 0, 0)] * n
        self.lock, self.progress = threading.Lock(), progress

    def of(self, i: int) -> Progress | None:
        if self.progress is None:
            return None

        def update(done: int, total: int, tokens: int = 0) -> None:
            with self.lock:
                self.each[i] = (done, total, tokens)
                self.progress(*(sum(x[k] for x in self.each) for k in range(3)))  # type: ignore[misc]
        return update


def fleet_check(config: RunConfig, base_urls: Sequence[str], *, prompts: Any = None, prompt_set: PromptSet | None = None,
                out: str | Path | None = None, atol: float | None = None,
                tier: int | None = None, progress: Progress | None = None, redact: bool = False, redact_env_vars: Sequence[str] | None = None,
                reference_url: str | None = None) -> FleetOutcome:
    """Check each endpoint (config with its own base_url) at once, then the N-way verdict. `prompts`
    as in detllm.check (a list of strings or a prompt file; `prompt_set` an already resolved one);
    `out` the fleet folder (default: a new folder under artifacts/). `redact` and `redact_env_vars`
    as in detllm.check (each replica's env.json). `reference_url`: one of `base_urls`, the replica the
    others are judged against (outliers differ from it) instead of the majority. No endpoint answering
    its first probe raises BackendUnavailableError (exit 4) with nothing written; once one has, the
    fleet folder is written, each failed replica marked (exit 8 when none produced a verdict)."""
    names = tuple(redact_env_vars or ())
    redaction = Redaction(all_vars=bool(redact), names=names) if redact or names else None
    if config.backend != "openai":
        raise UsageError(f"several --base-url are endpoints of --backend openai, not {config.backend!r}")
    urls = check_urls(base_urls)
    if wants_probe(config):  # --cache-probe: each replica probes its own cache, with check's run plan (api.check)
        config = probe_config(config)
    configs = [dataclasses.replace(config, options=tuple(sorted({**dict(config.options), "base_url": u}.items()))) for u in urls]
    for cfg in configs:
        cfg.validate(command="check")
    prompt_set = prompt_set or resolve_prompts(prompts)
    out = Path(out) if out is not None else default_out_dir("fleet")
    check_fleet_out(out)
    if reference_url is not None and reference_url.rstrip("/") not in urls:
        raise UsageError(f"--reference-url {reference_url.split('?', 1)[0]!r} is not one of the --base-url",
                         hint="give the reference replica's URL as one of the --base-url too")
    with fewer_collections():
        return _run(configs, urls, prompt_set, out, redaction, progress, config.atol if atol is None else atol, tier, reference_url)


def _run(configs: list[RunConfig], urls: list[str], prompt_set: PromptSet, out: Path, redaction: Redaction | None,
         progress: Progress | None, atol: float, tier: int | None, reference_url: str | None) -> FleetOutcome:
    """fleet_check once its arguments were checked: the first probes, the replicas' checks, the verdict."""
    # the first probe of every endpoint, before anything is written: none answers, nothing is written (exit 4)
    backends = run_replicas(lambda i: _connect(configs[i]), len(urls))
    if not any(b is not None for b, _ in backends):
        first = backends[0][1] or {}
        raise BackendUnavailableError(f"no endpoint of the fleet answered its first probe; replica 0: {first.get('message')}",
                                      hint="nothing was written; check that the servers are up and each --base-url is its /v1 address")
    prepare_fleet_out(out)
    begin_fleet(out)
    totals = _Totals(len(urls), progress)

    def one(i: int) -> tuple[Any, dict[str, Any] | None]:
        backend, err = backends[i]
        if backend is None:
            return None, err
        try:
            return execute(configs[i], command="check", out=out / REPLICA.format(i), prompt_set=prompt_set,
                           progress=totals.of(i), redaction=redaction, backend=backend), None
        except DetllmError as exc:
            return None, _error(exc)
        finally:
            backend.close()

    results = run_replicas(one, len(urls))
    replicas = []
    for i, (url, (outcome, err)) in enumerate(zip(urls, results)):
        folder = out / REPLICA.format(i)
        rep = Replica(index=i, name=REPLICA.format(i), source=url, folder=folder.name if folder.exists() else None, error=err)
        if outcome is not None:
            rep.own = own_check(outcome.report)
            (rep.side,) = load_sides(Selection(folder))
            rep.keys = prompt_keys(rep.side.records or [])
        replicas.append(rep)
    reference = urls.index(reference_url.rstrip("/")) if reference_url is not None else None
    report = fleet_verdict(replicas, command="check", atol=atol, tier=tier, reference=reference)
    write_fleet(out, report)
    seal_fleet(out)
    return FleetOutcome(out, report)


def _connect(config: RunConfig) -> tuple[Any, dict[str, Any] | None]:
    """(backend, None) once the endpoint answered the backend's discovery and capability probe, or
    (None, its error): the first probe, made before anything is written."""
    try:
        return create_backend(config), None
    except DetllmError as exc:
        return None, _error(exc)


__all__ = ["check_urls", "fleet_check"]
