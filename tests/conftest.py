"""Shared test helpers: every folder a test writes is validated against the schemas."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from detllm.artifacts import validate_folder
from detllm.cli import app

REQUIRED = ("env.json", "run_config.json", "determinism_applied.json", "trace.jsonl", "report.json", "report.txt")


def assert_valid_run(folder: Path, *, failed: bool = False) -> dict:
    """All artifacts present and schema-valid; returns report.json."""
    for name in REQUIRED:
        assert (folder / name).is_file(), f"{name} missing from {folder}"
    assert (folder / "diffs" / "first_divergence.json").is_file() == failed
    checked = validate_folder(folder)
    assert "trace.jsonl" in checked and "report.json" in checked
    assert not list(folder.glob("*.partial")) and not list(folder.glob(".*.tmp"))
    return json.loads((folder / "report.json").read_text())


@pytest.fixture
def cli():
    runner = CliRunner()

    def invoke(*args: str, env: dict | None = None):
        return runner.invoke(app, [str(a) for a in args], env=env)

    return invoke
