"""`detllm --help`, `report`, `models` and `env` never import torch or transformers; no command imports
pydantic (typer 0.29 coerces every option through it: ~7 MiB and ~80 ms that a check never uses, so
pyproject.toml keeps typer below 0.29)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import detllm

PROBE = """
import sys
from typer.testing import CliRunner
from detllm.cli import app
r = CliRunner().invoke(app, {args!r})
heavy = sorted(m for m in ("torch", "transformers", "vllm", "numpy", "pydantic") if m in sys.modules)
print("EXIT", r.exit_code, "HEAVY", ",".join(heavy) or "-")
"""


def run_probe(args: list[str]) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE.format(args=args)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lazy") / "run"
    detllm.check(backend="fake", out=out)
    return out


@pytest.mark.parametrize("args", [["--help"], ["check", "--help"], ["models"], ["env"], ["env", "--json"]])
def test_light_commands_do_not_import_heavy_modules(args):
    assert run_probe(args) == "EXIT 0 HEAVY -"


def test_report_does_not_import_torch(fake_run):
    assert run_probe(["report", str(fake_run)]) == "EXIT 0 HEAVY -"


def test_fake_backend_check_does_not_import_torch(tmp_path):
    assert run_probe(["check", "--backend", "fake", "--out", str(tmp_path / "r")]) == "EXIT 0 HEAVY -"


def test_the_probe_can_fail():
    """The probe sees torch when a command really loads it (so the tests above can fail)."""
    probe = "import sys, detllm.backends.hf.backend as h; h._torch(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "True"


def test_diff_and_verify_of_small_folders_import_nothing_heavy(fake_run, tmp_path):
    """diff reads payloads as arrays (numpy) only when they are large (compare/trace.FAST_PATH_MIN_BYTES)."""
    import json
    import shutil

    other = tmp_path / "other"
    shutil.copytree(fake_run, other)
    lines = (other / "trace.jsonl").read_text().splitlines()
    rec = json.loads(lines[0])
    rec["logprobs"] = [lp + 1e-3 for lp in rec["logprobs"]]  # differing payloads: the pair is compared, not skipped
    (other / "trace.jsonl").write_text("\n".join([json.dumps(rec, separators=(",", ":")), *lines[1:]]) + "\n")
    assert run_probe(["diff", str(fake_run), str(other), "--tier", "2"]) == "EXIT 1 HEAVY -"
    assert run_probe(["verify", str(fake_run)]) == "EXIT 0 HEAVY -"


def test_importing_the_cli_loads_no_engine_code():
    """`import detllm` resolves its public names on first use (PEP 562), so the CLI's start-up
    (`detllm --help`) does not load the runner, the integrity checks or the comparison engine."""
    probe = ("import sys, detllm.cli; print(','.join(sorted(m for m in ('detllm.api', 'detllm.pipeline.runner', 'detllm.runfolder.integrity', "
             "'detllm.compare.engine', 'jsonschema') if m in sys.modules)) or '-')")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "-"


def test_the_lazy_package_exports_the_public_api():
    """Every name in __all__ resolves, and importing every module of the package afterwards changes none
    of them: no module or package may take the name of a public export (importing it would bind the
    module on `detllm` and shadow the function, as `detllm.diff` once did)."""
    probe = ("import detllm, importlib, pkgutil\n"
             "before = {n: getattr(detllm, n) for n in detllm.__all__}\n"
             "mods = [m.name for m in pkgutil.walk_packages(detllm.__path__, 'detllm.') if m.name != 'detllm.__main__']\n"
             "for name in mods: importlib.import_module(name)\n"
             "changed = [n for n in detllm.__all__ if getattr(detllm, n) is not before[n]]\n"
             "clash = sorted(set(detllm.__all__) & {m.split('.')[1] for m in mods})\n"
             "print(len(mods) > 150, changed, clash, set(detllm.__all__) <= set(dir(detllm)))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True [] [] True"
