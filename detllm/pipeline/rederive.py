"""Re-derive a sealed folder's verdict from its own trace, so a report cannot be forged.

Owns one question `verify` asks after the bytes check out: do report.json's tier, status,
category and first divergence follow from the sealed trace under the recorded settings
(run_config.json: batch sizes, runs, atol, dtype, tier, mode; determinism_applied.json: the
capabilities and applied settings; from schema_version 3 all bound by the chain's genesis)?
The tier is gated again from the request and the capabilities; the verdict is made by the
function the runner called (checkverdict.check_verdict), never an engine. Folders without a
trace (diff --out), replays (their verdict is a diff against the pack, which is not in the
folder) and folders written under an earlier schema_version are reported as not re-derived,
in plain words.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..runfolder.artifacts import APPLIED, REPORT, RUN_CONFIG, TRACE
from ..core.errors import IntegrityError
from ..core.hashing import canonical_json
from ..core.versions import verdict_rule_versions
from ..runfolder.schema_io import finite

CHECKED_FIELDS = ("status", "category", "first_divergence")


def rederive_verdict(folder: Path) -> str:
    """Raise IntegrityError naming report.json's first field that does not follow from the
    trace; return what was done, in words, for `verify` to print."""
    if not (folder / REPORT).is_file():
        return "no report.json: no verdict to re-derive"
    report = _read(folder / REPORT)
    if not (folder / TRACE).is_file() or not (folder / RUN_CONFIG).is_file():
        return "verdict not re-derived: the folder holds no trace (a diff folder); its report is as sealed"
    run_config, applied = _read(folder / RUN_CONFIG), _read(folder / APPLIED)
    versions = {d.get("schema_version") for d in (report, run_config, applied)}
    if not versions <= verdict_rule_versions():
        old = sorted(str(v) for v in versions if v not in verdict_rule_versions())
        return (f"verdict not re-derived: written under schema_version {', '.join(map(str, old))}; "
                f"only the bytes and the hash chain were checked")
    command = run_config.get("command")
    if report.get("command") != command:
        raise IntegrityError(f"{REPORT}: command is {report.get('command')!r}, but {RUN_CONFIG} records {command!r}",
                             hint="the report does not belong to this run")
    if command == "replay":
        return "verdict not re-derived: a replay's verdict is a diff against the pack it replayed, which is not in the folder"
    tier = expected_tier(run_config, applied)
    got = report.get("tier") or {}
    if (got.get("requested"), got.get("effective")) != (run_config["config"]["tier"], tier):
        raise IntegrityError(f"{REPORT}: tier is {got}, but the chained request and the recorded capabilities give "
                             f"{{'requested': {run_config['config']['tier']}, 'effective': {tier}}}", hint=_EDITED)
    expected = expected_verdict(folder, run_config, applied, command, tier)
    earlier = ""
    for name in CHECKED_FIELDS:
        if as_written(report.get(name)) != as_written(expected[name]):
            if name == "category" and report.get(name) == "BATCH_VARIANCE" and _earlier_busy_rule(folder):
                earlier = (f"; its category BATCH_VARIANCE follows detllm's earlier rule (busy-slot counts its own "
                           f"in-flight requests explain); today's rule gives {expected[name]}")
                continue
            raise IntegrityError(
                f"{REPORT}: {name} is {_show(report.get(name))}, but the sealed trace gives {_show(expected[name])}",
                hint=_EDITED)
    return f"verdict re-derived from the trace: {expected['status']}" + \
        (f" ({expected['category']})" if expected["status"] == "FAIL" and not earlier else "") + earlier


_EDITED = "the verdict was edited after the run; re-run the check"


def expected_tier(run_config: dict[str, Any], applied: dict[str, Any]) -> int:
    """The effective tier, re-derived the way the runner gated it (tiergate.gate_tier) from the
    chained request (run_config: tier, mode) and the capabilities the backend declared; raises
    IntegrityError when determinism_applied.json says otherwise."""
    from .tiergate import gate_tier, recorded_capabilities
    from ..core.config import RunConfig
    from ..core.errors import TierUnsupportedError

    config = RunConfig.from_json(run_config["config"])
    try:
        tier, _ = gate_tier(config, recorded_capabilities(applied))
    except TierUnsupportedError as exc:
        raise IntegrityError(f"{APPLIED}: records a run that strict mode refuses ({exc.message})", hint=_EDITED) from exc
    recorded = (applied["tier_requested"], applied["tier_effective"], applied["mode"], applied["downgraded"])
    if recorded != (config.tier, tier, config.mode, tier != config.tier):
        raise IntegrityError(
            f"{APPLIED}: tier_requested/tier_effective/mode/downgraded are {list(recorded)}, but the chained request "
            f"(tier {config.tier}, mode {config.mode}) under the recorded capabilities gives "
            f"{[config.tier, tier, config.mode, tier != config.tier]}", hint=_EDITED)
    return tier


def expected_verdict(folder: Path, run_config: dict[str, Any], applied: dict[str, Any], command: str, tier: int) -> dict[str, Any]:
    """{status, category, first_divergence} as `run`/`check` computes them from this trace at the
    effective tier `tier` (expected_tier), by the function the runner called (checkverdict.check_verdict:
    a plain check or a cache probe)."""
    if command == "run":
        return {"status": "RECORDED", "category": "RECORDED", "first_divergence": None}
    from .checkverdict import check_verdict
    from ..compare.divergence import run_noise_floor
    from ..compare.trace import load_records
    from ..core.config import RunConfig

    config = RunConfig.from_json(run_config["config"])
    floor = run_noise_floor(config.dtype, applied["settings"], run_config["model"].get("quantization"))
    records, _ = load_records(folder / TRACE)
    # status, category and first divergence do not read the drift aggregation: skipped
    report = check_verdict(config, records, tier=tier, floor=floor, summary={}, drift=False)
    return {name: report[name] for name in CHECKED_FIELDS}


def _earlier_busy_rule(folder: Path) -> bool:
    """The trace holds two selections (run, batch size) of a served run whose sampled busy counts
    differ only by what their own in-flight requests explain: the case detllm's earlier served-batch
    rule named BATCH_VARIANCE and today's does not (compare.causes.variance.served_busy_rule_changed)."""
    from ..compare.causes.variance import server_batching, served_busy_rule_changed
    from ..compare.trace import load_records

    records, _ = load_records(folder / TRACE)
    by_selection: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in records:
        by_selection.setdefault((r["run_index"], r["batch_size"]), []).append(r)
    served = [server_batching(rs) for rs in by_selection.values()]
    return any(served_busy_rule_changed({"left": a, "right": b}) for i, a in enumerate(served) for b in served[i + 1:]
               if a and b)


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_bytes())  # verify has validated every file against its schema already


def as_written(value: Any) -> bytes:
    """A value as write_json puts it on disk (NaN/inf are null), canonical: how a sealed field and its
    re-derivation are compared (this verdict's, the fleet's and a diff folder's)."""
    return canonical_json(finite(value))


def _show(value: Any) -> str:
    if isinstance(value, dict):
        where = {k: value[k] for k in ("comparison", "prompt_index", "token_index") if k in value}
        return f"a divergence at {where}" if where else "a divergence"
    return repr(value)


# ------------------------------------------------------------------ on the other core


AHEAD_MIN_BYTES = 1 << 24  # a trace this large: re-derive in a second process while verify hashes and scans


class Ahead:
    """rederive_verdict(folder) started now in another process (`python -m detllm.rederive`),
    so that it runs on the other core while verify checks the bytes; `result()` is what
    rederive_verdict would return or raise. verify asks for it only once the bytes check out,
    so it names the first problem as before. Anything unexpected from the child (it died, it
    printed no answer) is answered by rederive_verdict here instead. The child dies with us
    (PR_SET_PDEATHSIG) and is killed by `close()`; it writes nothing but its answer."""

    def __init__(self, proc: Any, folder: Path) -> None:
        self.proc, self.folder = proc, folder

    @classmethod
    def start(cls, folder: Path) -> "Ahead | None":
        import subprocess
        import sys

        from ..compare.pairs import usable_cpus

        try:
            if (folder / TRACE).stat().st_size < AHEAD_MIN_BYTES or usable_cpus() < 2 or not sys.executable:
                return None
        except OSError:
            return None
        from ..core.children import death_signal_hook

        try:
            proc = subprocess.Popen([sys.executable, "-m", "detllm.pipeline.rederive", str(folder)], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, preexec_fn=death_signal_hook())
        except OSError:
            return None
        return cls(proc, folder)

    def result(self) -> str:
        from ..core import errors

        out, _ = self.proc.communicate()
        try:
            got = json.loads(out)
            if "ok" in got:
                return str(got["ok"])
            cls = getattr(errors, got["error"], None)
            if isinstance(cls, type) and issubclass(cls, errors.DetllmError):
                raise cls(got["message"], hint=got.get("hint"))
        except (ValueError, KeyError, TypeError):
            pass
        return rederive_verdict(self.folder)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # verify stopped at an earlier problem: its answer is not needed
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _main(argv: list[str]) -> int:
    from ..compare import pairs, trace
    from ..core.errors import DetllmError

    pairs.WORKER_MIN_BYTES = trace._WARM_MIN_BYTES = 1 << 62  # verify's own process has the other core
    try:
        answer: dict[str, Any] = {"ok": rederive_verdict(Path(argv[0]))}
    except DetllmError as exc:
        answer = {"error": type(exc).__name__, "message": exc.message, "hint": exc.hint}
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(_main(sys.argv[1:]))
