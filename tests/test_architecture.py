"""The layers of docs/architecture.md, held: import-linter's contracts (pyproject.toml
[tool.importlinter]) pass, every module sits in exactly one layer, no import circle exists when
every import is counted (function-level ones too), string imports live in two places only, no
module grows past 450 lines, and an upward import planted in a copy of the package is caught."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "detllm"
CONFIG = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
MAX_LINES = 450
STRING_IMPORTS_ALLOWED = {"detllm/__init__.py", "detllm/backends/registry.py"}


def lint(root: Path) -> subprocess.CompletedProcess:
    """import-linter on the package under `root` with this project's contracts (no cache)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, str(REPO / "pyproject.toml"), "--no-cache"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)


def modules() -> list[str]:
    """Every module of the package, dotted (packages by their own name)."""
    out = []
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out.append(".".join(parts))
    return out


def imports_of(path: Path, name: str, names: set[str]) -> set[str]:
    """The detllm modules that `path` (module `name`) imports anywhere in it, at module level or in a
    function: `from X import a` names X.a where that is a module, else X (importing X.a runs X's
    __init__ too, but depends on X.a alone, as import-linter counts it)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            subs = {f"{base}.{a.name}" for a in node.names} & names
            found |= subs if len(subs) == len(node.names) else subs | {base}
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found & names


def test_contracts_hold():
    res = lint(REPO)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "0 broken" in res.stdout


def test_every_module_is_in_exactly_one_layer():
    layers = next(c for c in CONFIG["contracts"] if c["id"] == "layers")["layers"]
    owners = [[m.strip() for m in re.split(r"[|:]", layer)] for layer in layers]
    for mod in modules():
        if mod == "detllm":
            continue  # the package root: re-exports resolved on first use (PEP 562), above every layer
        hits = [i for i, names in enumerate(owners) for n in names if mod == n or mod.startswith(n + ".")]
        assert len(hits) == 1, f"{mod} is in {len(hits)} layers of pyproject's layers contract; put it in exactly one"


def test_no_import_circle_between_modules():
    """Tarjan over the graph of every import (module-level or not) between detllm modules."""
    names = set(modules())
    graph = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mod = ".".join(parts)
        graph[mod] = imports_of(path, mod, names) - {mod}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_string_imports_only_in_the_registry_and_the_package_root():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = str(path.relative_to(REPO))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                if name in ("import_module", "__import__") and rel not in STRING_IMPORTS_ALLOWED:
                    bad.append(f"{rel}:{node.lineno} {name}()")
    assert not bad, "string imports hide dependencies from the contracts: " + ", ".join(bad)


def test_no_module_over_450_lines():
    long = {str(p.relative_to(REPO)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these by responsibility (docs/architecture.md): {long}"


PLANTS = [
    # (file, line planted inside a function, what the report names)
    ("detllm/compare/engine.py", "from ..render.text import render_text", "detllm.compare.engine -> detllm.render.text"),
    ("detllm/runfolder/artifacts.py", "from ..pipeline.runner import execute", "detllm.runfolder.artifacts -> detllm.pipeline.runner"),
    ("detllm/core/config.py", "from ..models import resolve_model", "detllm.core.config -> detllm.models"),
    ("detllm/runfolder/fleetseal.py", "from ..fleet.folder import write_fleet", "detllm.runfolder.fleetseal -> detllm.fleet.folder"),
    # verify reading a fleet folder through fleet/ again: the folder circle commands <-> fleet (the fleet calls diff)
    ("detllm/commands/verify.py", "from ..fleet.endpoints import fleet_check", "- .commands -> .fleet (1 import)"),
    ("detllm/backends/fake.py", "from .hf import HFBackend", "detllm.backends.fake -> detllm.backends.hf"),
    ("detllm/render/junit.py", "from ..backends.vllm import VLLMBackend", "detllm.render.junit -> detllm.backends.vllm"),
]


@pytest.fixture(scope="module")
def copy_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("planted")
    shutil.copytree(PKG, root / "detllm", ignore=shutil.ignore_patterns("__pycache__"))
    return root


@pytest.mark.parametrize("rel,line,named", PLANTS, ids=[p[2] for p in PLANTS])
def test_a_planted_import_breaks_a_contract(copy_root, rel, line, named):
    """An import hidden inside a function, planted in a copy of the package, is reported by name."""
    target = copy_root / rel
    original = target.read_text()
    try:
        target.write_text(original + f"\n\ndef _planted():\n    {line}\n")
        res = lint(copy_root)
    finally:
        target.write_text(original)
    assert res.returncode != 0, res.stdout[-3000:]
    assert named in res.stdout, res.stdout[-3000:]


def test_the_unplanted_copy_passes(copy_root):
    """The copy itself is clean, so the failures above are the planted lines' doing."""
    res = lint(copy_root)
    assert res.returncode == 0, res.stdout[-3000:]


def child_entry_points() -> set[str]:
    """Every `python -m detllm.…` the package starts: the string after "-m" in a call's argument list."""
    found = set()
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.List):
                items = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
                for flag, mod in zip(items, items[1:]):
                    if flag == "-m" and isinstance(mod, str) and mod.startswith("detllm."):
                        found.add(mod)
    return found


def test_every_child_entry_point_starts():
    """The child processes move with their modules: each `python -m` target the package spawns exists
    and runs its main guard (given no work, it stops on its own; what matters is that it was found)."""
    mods = child_entry_points()
    assert {"detllm.pipeline.fresh", "detllm.pipeline.rederive", "detllm.compare.pairs", "detllm.diagnose.worker",
            "detllm.training.child"} <= mods, mods
    for mod in sorted(mods):
        path = PKG.parent / (mod.replace(".", "/") + ".py")
        assert 'if __name__ == "__main__":' in path.read_text(), f"{mod} has no main guard"
        res = subprocess.run([sys.executable, "-m", mod], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                             timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert "No module named" not in res.stderr, res.stderr[-2000:]
