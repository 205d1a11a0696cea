"""The schemas are valid draft 2020-12 documents, strict, and ship inside the wheel."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from detllm.runfolder.artifacts import schema_dir

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS = sorted((ROOT / "schemas").glob("*.schema.json"))


def test_every_artifact_has_a_schema():
    names = {p.name.removesuffix(".schema.json") for p in SCHEMAS}
    assert {"env", "run_config", "determinism_applied", "trace_record", "report", "first_divergence", "manifest"} <= names


@pytest.mark.parametrize("path", SCHEMAS, ids=lambda p: p.name)
def test_schema_is_valid_and_strict(path):
    schema = json.loads(path.read_text())
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"].endswith(path.name)
    assert schema.get("additionalProperties") is False, "top level must refuse unknown fields"
    props = schema["properties"]
    if "schema_version" in props:
        assert props["artifact_type"]["const"] == path.name.removesuffix(".schema.json")


def test_source_checkout_reads_the_top_level_schemas():
    assert schema_dir().resolve() == (ROOT / "schemas").resolve()


@pytest.mark.engine
def test_wheel_ships_the_schemas(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0 and "hatchling" in out.stderr:
        out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
                             capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    wheel = next(tmp_path.glob("detllm-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for p in SCHEMAS:
        assert f"detllm/schemas/{p.name}" in names
