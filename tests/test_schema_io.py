"""schema_io.to_json writes json.dumps(indent=2)'s bytes whichever way it indents."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest

from detllm.runfolder import schema_io
from tests.mutations import mutations


def _report(n: int) -> dict:
    steps = [{"token_id": i, "token_text": f" w{i} é\"\\\n\u2028日本", "logprob": -i / 7 - 1e-7, "top": [[i, -0.0], [i + 1, 1e300]],
              "empty": [], "none": None, "obj": {}, "flag": i % 2 == 0} for i in range(n)]
    return {"status": "FAIL", "divergences": steps, "nested": [[]], "big": 12345678901234567890}


@pytest.mark.parametrize("ensure_ascii", [True, False])
@pytest.mark.parametrize("n", [3, 4000])  # under and over _FORMAT_MIN_CHARS: json's indent, then msgspec's
def test_to_json_is_json_dumps_indent(monkeypatch, n, ensure_ascii):
    obj = _report(n)
    expected = json.dumps(obj, indent=2, ensure_ascii=ensure_ascii)
    assert (len(expected) > schema_io._FORMAT_MIN_CHARS) == (n > 100)
    assert schema_io.to_json(obj, ensure_ascii=ensure_ascii) == expected
    assert schema_io.to_json(obj, indent=None, ensure_ascii=ensure_ascii) == json.dumps(obj, ensure_ascii=ensure_ascii)


def test_dumps_of_an_artifact_turns_non_finite_into_null():
    big = _report(4000)
    big["nan"] = float("nan")
    text = schema_io.dumps(big)
    assert json.loads(text)["nan"] is None
    assert text == json.dumps(schema_io.finite(big), indent=2, ensure_ascii=False)


# ------------------------------------------------------------------ jsonschema-rs agrees with jsonschema

FIXTURES = Path(__file__).parent / "fixtures"


def _artifacts() -> list[tuple[str, dict]]:
    out = []
    for p in sorted(FIXTURES.rglob("*.json")):
        try:
            obj = json.loads(p.read_text())
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(obj, dict) and isinstance(obj.get("artifact_type"), str) and obj.get("schema_version") in schema_io.READABLE_SCHEMA_VERSIONS:
            out.append((str(p.relative_to(FIXTURES)), obj))
    return out


def _mutations(obj: dict, rng: random.Random, n: int) -> list[dict]:
    """n copies of obj, each with one leaf or key changed the ways a bug would change it."""
    return mutations(obj, rng, n, ("type", "delete", "extra", "negative", "float"), ["a string", None, True, [], {}, 2**70],
                     deletes_list_items=True)


def test_jsonschema_rs_agrees_with_jsonschema_on_every_fixture_and_its_mutations():
    rng = random.Random(0)
    checked = invalid = 0
    for name, obj in _artifacts():
        kind, version = obj["artifact_type"], obj["schema_version"]
        fast, reference = schema_io._fast_validator(kind, version), schema_io._validator(kind, version)
        assert fast is not None, f"jsonschema-rs cannot build the {kind} schema of version {version}"
        for y in [obj, *_mutations(obj, rng, 12)]:
            want = reference.is_valid(y)
            try:
                got = fast.is_valid(y)
            except (ValueError, TypeError, OverflowError):
                got = False  # validate() then asks jsonschema
            assert got == want, f"{name}: jsonschema-rs says {got}, jsonschema {want} on {json.dumps(y)[:300]}"
            checked += 1
            invalid += not want
    assert checked > 300 and invalid > 100, (checked, invalid)


def test_validate_names_the_violation_as_jsonschema_does():
    obj = next(o for _, o in _artifacts() if o["artifact_type"] == "report")
    bad = copy.deepcopy(obj)
    bad["status"] = 7
    with pytest.raises(Exception) as got:
        schema_io.validate(bad, "report", where="report.json")
    assert str(got.value).startswith("report.json: schema violation at status: 7 is not one of ['PASS'")  # jsonschema's words
