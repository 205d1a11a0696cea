"""The pip install docs/ci.md and README give, without scripts/install.sh: a wheel built from this
repository, installed with a light extra (openai: httpx, no torch) into a fresh venv that sees
nothing of the dev venv, runs `detllm --version` and a check on the fake backend. The hf extra adds
torch, pinned first through constraints.txt; it is too heavy to install again here (the action's
default arguments run hf in tests/test_ci_action.py)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

from detllm.core.versions import CURRENT

ROOT = Path(__file__).resolve().parents[1]


def sh(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_a_built_wheel_installs_with_an_extra_into_a_fresh_venv_and_checks(tmp_path):
    version = metadata.version("detllm")
    built = sh(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp_path / "dist", ROOT, cwd=tmp_path)
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = tmp_path / "dist" / f"detllm-{version}-py3-none-any.whl"
    names = zipfile.ZipFile(wheel).namelist()
    assert "detllm/schemas/report.schema.json" in names, "the schemas ship inside the wheel"
    assert not [n for n in names if n.startswith(("tests/", "scripts/", ".venv/"))]

    venv = tmp_path / "venv"
    assert sh(sys.executable, "-m", "venv", venv, cwd=tmp_path).returncode == 0
    inst = sh(venv / "bin" / "python", "-m", "pip", "install", "-q", "-c", ROOT / "constraints.txt", f"{wheel}[openai]", cwd=tmp_path)
    assert inst.returncode == 0, inst.stderr[-2000:]
    have = sh(venv / "bin" / "python", "-c", "import detllm, httpx, importlib.util as u; print(detllm.__file__, u.find_spec('torch'))", cwd=tmp_path)
    where, torch = have.stdout.split()
    assert Path(where).is_relative_to(venv) and torch == "None", have.stderr

    assert sh(venv / "bin" / "detllm", "--version", cwd=tmp_path).stdout == f"detllm {version} (writes run folders of schema_version {CURRENT})\n"
    check = sh(venv / "bin" / "detllm", "check", "--backend", "fake", "--max-new-tokens", "4", "--out", tmp_path / "run", cwd=tmp_path)
    assert check.returncode == 0 and check.stdout.startswith("detllm check: PASS"), check.stdout + check.stderr
    assert sh(venv / "bin" / "detllm", "verify", tmp_path / "run", cwd=tmp_path).returncode == 0
    # without torch, the hf backend names the install that adds it (not a traceback)
    hf = sh(venv / "bin" / "detllm", "check", "--max-new-tokens", "4", "--out", tmp_path / "hf", cwd=tmp_path)
    assert hf.returncode == 4 and hf.stderr.startswith("detllm: error: the hf backend needs torch") and "Traceback" not in hf.stderr
