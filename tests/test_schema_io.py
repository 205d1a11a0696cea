"""schema_io.to_json writes json.dumps(indent=2)'s bytes whichever way it indents."""

from __future__ import annotations

import json

import pytest

from detllm import schema_io


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
