"""schemalite's answers are jsonschema's wherever it gives one: on every committed artifact of every schema
version, a fresh run folder of the current one (PASS and FAIL) and their trace records, and mutations of each.
Its True ends validation, so a True where jsonschema says invalid would let a bad artifact be written."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

import detllm
from detllm.core.errors import ArtifactError
from detllm.runfolder import schema_io
from tests.mutations import mutations
from detllm.runfolder.schemalite import Compiler, _equal

TESTS = Path(__file__).parent
REPO = TESTS.parent


def _plain(obj: dict) -> list[tuple[str, dict]]:
    ok = isinstance(obj, dict) and isinstance(obj.get("artifact_type"), str)
    return [("", obj)] if ok and obj.get("schema_version") in schema_io.READABLE_SCHEMA_VERSIONS else []


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> list[tuple[str, dict]]:
    tmp = tmp_path_factory.mktemp("lite")
    detllm.check(backend="fake", out=tmp / "pass")
    detllm.check(backend="fake", options={"diverge": "prompt=0,pos=2,batch=4"}, vary_batch=(1, 4), out=tmp / "fail")
    out = []
    roots = [TESTS / "fixtures", TESTS / "golden" / "out", tmp]
    for p in sorted(q for root in roots for q in root.rglob("*.json*")):
        try:
            lines = p.read_text().splitlines() if p.suffix == ".jsonl" else [p.read_text()]
            objs = [json.loads(line) for line in lines[:40] if line.strip()]
        except (ValueError, UnicodeDecodeError):
            continue
        out += [(f"{p.name}", o) for obj in objs for _, o in _plain(obj)]
    seen: dict = {}  # at most 10 of each artifact type and version (the golden diff reports are 215)
    return [(n, o) for n, o in out if seen.setdefault((o["artifact_type"], o["schema_version"]), []).append(n) or
            len(seen[(o["artifact_type"], o["schema_version"])]) <= 10]


def _mutations(obj: dict, rng: random.Random, n: int) -> list[dict]:
    """n copies of obj, each with one leaf or key changed the ways a bug (or an odd value) would change it."""
    return mutations(obj, rng, n, ("type", "delete", "extra", "negative", "float", "integral", "string", "empty", "append"),
                     ["a string", None, True, False, 0, [], {}, 2**70, 1e300, (1, 2)])


def test_schemalite_gives_jsonschemas_answer_or_none(artifacts):
    rng = random.Random(0)
    kinds = set()
    checked = decided_invalid = undecided = 0
    for name, obj in artifacts:
        kind, version = obj["artifact_type"], obj["schema_version"]
        kinds.add((kind, version))
        lite, reference = schema_io._lite_validator(kind, version), schema_io._validator(kind, version)
        assert lite(obj) is True, f"{name}: schemalite cannot settle a valid {kind} of version {version}"
        for y in _mutations(obj, rng, 40):
            got, want = lite(y), reference.is_valid(y)
            assert got is None or got == want, f"{name}: schemalite says {got}, jsonschema {want} on {json.dumps(y, default=str)[:300]}"
            checked += 1
            decided_invalid += got is False
            undecided += got is None
    assert {("report", "5"), ("run_config", "5"), ("env", "5"), ("determinism_applied", "5"), ("manifest", "5"),
            ("first_divergence", "5"), ("trace_record", "5")} <= kinds, kinds
    assert checked > 2000 and decided_invalid > checked / 3 and undecided < checked / 5, (checked, decided_invalid, undecided)


def test_json_equality_and_the_cases_left_to_the_others():
    assert _equal(1, 1.0) is True and _equal(True, 1) is False and _equal([1, {"a": None}], [1.0, {"a": None}]) is True
    assert _equal((1,), [1]) is None  # a tuple is no JSON array to jsonschema
    compiler = Compiler({"https://x/s.json": {"$id": "https://x/s.json", "type": "object", "additionalProperties": False,
                          "properties": {"h": {"type": "string", "pattern": "^[0-9a-f]{2}$"},
                                         "n": {"type": "integer", "minimum": 0},
                                         "one": {"oneOf": [{"type": "integer"}, {"type": "number"}]},
                                         "w": {"type": "string", "pattern": "^\\w+$"},
                                         "u": {"$ref": "#/$defs/u"}},
                          "$defs": {"u": {"type": "string", "format": "uri"}}}}.get)
    check = compiler.root("https://x/s.json")
    assert check({"h": "0a", "n": 3}) is True
    assert check({"h": "0a\n"}) is None  # Python's `$` matches before a final newline, ECMA-262's does not
    assert check({"h": "0A"}) is False and check({"n": -1}) is False and check({"x": 1}) is False
    assert check({"n": 2.0}) is None  # an integral float: jsonschema says integer, left to it
    assert check({"one": 1}) is False and check({"one": 1.5}) is True  # 1 is both: oneOf fails
    assert check({"w": "ab"}) is None  # \w reads differently in the two regex dialects
    assert check({"u": "x"}) is None  # a keyword it does not know (format)
    assert check({"h": type("S", (str,), {})("0a")}) is None  # a str subclass (torch's TorchVersion was one)
    assert check({"h": "0a", 1: 2}) is None and check({"h": ("0a",)}) is None  # an int key, a tuple: not plain JSON


def test_a_small_write_or_read_is_settled_without_jsonschema_rs_and_a_bad_one_is_named_by_jsonschema(tmp_path):
    """A fresh process: writing a check's artifacts, and reading two folders back for a diff, loads neither
    jsonschema-rs nor jsonschema; a bad write is still refused with jsonschema's words before anything is
    written, and a bad file read back with jsonschema's words too."""
    probe = """
import json, shutil, sys
from pathlib import Path
import detllm
from detllm.core.errors import ArtifactError
from detllm.runfolder import schema_io
root = Path(sys.argv[1])
o = detllm.check(backend="fake", out=root / "r")
detllm.check(backend="fake", out=root / "s")
d = detllm.diff(root / "r", root / "s")
clean = not any(m in sys.modules for m in ("jsonschema_rs", "jsonschema"))
report = json.loads((root / "r" / "report.json").read_text())
report["status"] = "MAYBE"
try:
    schema_io.write_json(root / "bad", "report.json", report)
    refused = ""
except ArtifactError as err:
    refused = str(err)
shutil.copytree(root / "s", root / "t")
cfg = json.loads((root / "t" / "run_config.json").read_text())
cfg["command"] = "maybe"
(root / "t" / "run_config.json").write_text(json.dumps(cfg))
try:
    detllm.diff(root / "r", root / "t")
    unread = ""
except ArtifactError as err:
    unread = str(err)
print(json.dumps({"status": o.status, "diff": d.status, "clean": clean, "refused": refused, "written": (root / "bad").exists(),
                  "unread": unread}))
"""
    proc = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["status"] == "PASS" and seen["diff"] == "PASS" and seen["clean"], seen
    assert seen["refused"].startswith("report.json: schema violation at status: 'MAYBE' is not one of"), seen
    assert not seen["written"]
    assert "run_config.json: schema violation at command: 'maybe' is not one of" in seen["unread"], seen


def test_what_schemalite_leaves_is_decided_as_before(monkeypatch, tmp_path):
    """What it cannot settle (a str subclass inside) goes to jsonschema-rs and jsonschema, as before; a
    validation without a size never asks it."""
    out = detllm.check(backend="fake", out=tmp_path / "r").out_dir
    obj = json.loads((out / "run_config.json").read_text())
    asked = []
    real = schema_io._fast_validator
    monkeypatch.setattr(schema_io, "_fast_validator", lambda *a: asked.append(a) or real(*a))
    schema_io.validate(obj, "run_config", size=100)
    assert asked == []  # settled by schemalite
    schema_io.validate(obj, "run_config")  # no size: jsonschema-rs as always
    assert len(asked) == 1
    odd = {**obj, "created_at": type("Stamp", (str,), {})(obj["created_at"])}
    assert schema_io._lite_validator("run_config")(odd) is None
    schema_io.validate(odd, "run_config", size=100)  # valid, decided by the others
    assert len(asked) == 2
    with pytest.raises(ArtifactError):
        schema_io.validate({**obj, "artifact_type": "env"}, "run_config", size=100)
