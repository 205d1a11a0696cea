"""`detllm --help`, `report`, `models` and `env` never import torch or transformers."""

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
heavy = sorted(m for m in ("torch", "transformers", "vllm", "numpy") if m in sys.modules)
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
    probe = "import sys, detllm.backends.hf as h; h._torch(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "True"
