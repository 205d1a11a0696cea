"""The artifact stack imports one way at module level: schema_io <- records <- artifacts <-
pack <- integrity (and env builds on schema_io). A cycle here once made import order matter."""

from __future__ import annotations

import ast
from pathlib import Path

import detllm

PKG = Path(detllm.__file__).parent
STACK = ("schema_io", "records", "env", "artifacts", "pack", "integrity")


def top_level_imports(module: str) -> set[str]:
    """detllm modules named by `from .x import` / `from . import x` outside any function."""
    tree = ast.parse((PKG / f"{module}.py").read_text())
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(a.name for a in node.names)
    return found


def test_artifact_stack_has_no_import_cycle():
    graph = {m: top_level_imports(m) & set(STACK) for m in STACK}
    order: list[str] = []
    while len(order) < len(STACK):
        ready = [m for m in STACK if m not in order and graph[m] <= set(order)]
        assert ready, f"import cycle among {sorted(set(STACK) - set(order))}: {graph}"
        order += ready
    assert graph["schema_io"] == set(), "schema_io is the bottom module"
    assert "artifacts" not in graph["records"] | graph["env"]


def test_old_artifacts_names_still_import():
    from detllm import artifacts, pack

    assert artifacts.open_run_path is pack.open_run_path
    for name in ("stamp", "validate", "write_json", "atomic_write_text", "dumps", "utc_now", "check_header", "load_schema"):
        assert callable(getattr(artifacts, name)), name
