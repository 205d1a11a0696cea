"""Issue 20: a verdict's labels and figures never contradict what was recorded. A repeat that
stopped a token earlier is a length divergence at every tier, never "tokens equal" (R7); a
figure names its quantity and a maximum is never below a difference shown beside it; a share
with flips is never printed as 100% (R16)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from detllm.compare.engine import compare
from detllm.hashing import canonical_json, sha256_bytes
from tests.test_openai_stub import Stub


def rec(i: int, ids: list[int], lps=None, tops=None, finish: str = "length") -> dict:
    input_ids = [1, 2, 3]
    return {
        "schema_version": "2", "artifact_type": "trace_record", "run_index": 0, "batch_size": 1, "batch_position": 0,
        "prompt_index": i, "prompt_id": f"{i:064x}", "prompt_text": f"p{i}", "input_ids": input_ids,
        "input_ids_sha256": sha256_bytes(canonical_json(input_ids)), "token_ids": ids,
        "token_texts": [chr(65 + t % 26) for t in ids], "text": "".join(chr(65 + t % 26) for t in ids),
        "logprobs": lps, "top_logprobs": tops, "finish_reason": finish,
    }


def comp(left, right, **kw):
    return compare(left, right, name="c", kind="run", left_label="L", right_label="R", required=True,
                   noise_floor=1e-4, **kw)


# ------------------------------------------------------------------ R7: a length divergence is not "tokens equal"


def test_a_repeat_that_stopped_earlier_is_a_length_divergence_at_tier_2():
    """Logprob 0 moved by 1e-6, then the right stopped one token earlier: at tier 2 the first
    difference found is the logprob's, but the tokens are not equal, so the label is the length
    divergence that follows (as a later token flip labels an earlier logprob divergence)."""
    lps = [-0.5, -0.25, -0.75, -0.1, -0.2, -0.3]
    a = rec(0, [5, 6, 7, 8, 9, 10], lps)
    b = rec(0, [5, 6, 7, 8, 9], [lps[0] + 1e-6, *lps[1:5]], finish="stop")
    tier2 = comp([a], [b], check_logprobs=True)
    tier1 = comp([a], [b], check_logprobs=False)
    d = tier2["first_divergence"]
    assert d["kind"] == "logprob" and d["token_index"] == 0
    assert d["magnitude"]["label"] == "length" and d["magnitude"]["token_index"] == 5
    assert tier2["magnitude"]["label"] == tier1["magnitude"]["label"] == "length"
    assert tier2["drift"]["per_prompt"][0]["tokens_equal"] is False


class _EarlyStop(Stub):
    """The stub's second answer to a prompt moves logprob 0 by 1e-6 and stops one token earlier
    (finish_reason "stop"): a warm repeat ending at another step."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}
        super().__init__()

    def answer(self, body: dict) -> dict:
        doc = super().answer(body)
        key = hashlib.sha256(str(body["prompt"]).encode()).hexdigest()
        self.seen[key] = self.seen.get(key, 0) + 1
        if self.seen[key] > 1 and body.get("logprobs") is not None:
            c = doc["choices"][0]
            lp = c["logprobs"]
            lp["token_logprobs"][0] += 1e-6
            t0 = lp["tokens"][0]
            lp["top_logprobs"][0] = {t: (v + 1e-6 if t == t0 else v) for t, v in lp["top_logprobs"][0].items()}
            for key2 in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                lp[key2] = lp[key2][:-1]
            c["text"], c["finish_reason"] = "".join(lp["tokens"]), "stop"
        return doc


def test_a_served_repeat_that_stopped_earlier_is_not_tokens_equal(cli, tmp_path):
    stub = _EarlyStop()
    try:
        out = tmp_path / "eo"
        res = cli("check", "--backend", "openai", "--base-url", stub.url, "--model", "stub-model", "--tier", "2",
                  "--runs", "2", "--prompt", "an eos prompt", "--max-new-tokens", "6", "--out", out, "--no-progress")
    finally:
        stub.close()
    assert res.exit_code == 1, res.output
    rep = json.loads((out / "report.json").read_text())
    assert rep["first_divergence"]["magnitude"]["label"] == "length"
    assert rep["magnitude"]["label"] == "length"
    assert "tokens equal" not in (out / "report.txt").read_text()


# ------------------------------------------------------------------ R4: tier 3 compares a second batch size


@pytest.mark.parametrize("args", [
    ["--vary-batch", "1"],
    ["--batch-size", "4"],
    ["--backend", "openai", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--concurrency", "1"],
])
def test_tier3_without_a_second_batch_size_is_refused_before_anything_is_written(cli, tmp_path, args):
    """`check --tier 3 --vary-batch 1` once PASSed "tier 3" with no batch comparison at all: tier 3
    promises batch invariance, so a tier-3 check whose sizes hold one batch size is refused (exit 2,
    one line) before a backend starts or a file is written."""
    out = tmp_path / "out"
    backend = [] if "--backend" in args else ["--backend", "fake"]
    r = cli("check", *backend, "--tier", "3", "--prompt", "hi", *args, "--out", out, "--no-progress")
    assert r.exit_code == 2, r.output
    assert "comparing no second batch size" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output
    assert not out.exists()


def test_tier3_with_two_batch_sizes_runs_and_compares_them(tmp_path):
    import detllm
    from detllm.errors import UsageError

    with pytest.raises(UsageError):
        detllm.check(backend="fake", tier=3, vary_batch=(1,), prompts=["hi"], out=tmp_path / "one")
    outcome = detllm.check(backend="fake", options={"batch_invariant": "true"}, tier=3, vary_batch=(1, 2),
                           prompts=["hi", "there"], max_new_tokens=4, out=tmp_path / "two")
    rep = json.loads((outcome.out_dir / "report.json").read_text())
    assert rep["tier"]["effective"] == 3
    assert any(c["kind"] == "batch" and c["required"] for c in rep["comparisons"])
