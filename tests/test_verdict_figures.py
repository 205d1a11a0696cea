"""Issue 20: a verdict's labels and figures never contradict what was recorded or what ran. A
repeat that stopped a token earlier is a length divergence at every tier, never "tokens equal"
(R7); a tier-3 check compares a second batch size or is refused (R4); a figure names its quantity
and a maximum is never below a difference shown beside it; a share with flips is never printed as
100% (R16)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from detllm.compare.engine import compare
from detllm.core.hashing import canonical_json, sha256_bytes
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
    from detllm.core.errors import UsageError

    with pytest.raises(UsageError):
        detllm.check(backend="fake", tier=3, vary_batch=(1,), prompts=["hi"], out=tmp_path / "one")
    outcome = detllm.check(backend="fake", options={"batch_invariant": "true"}, tier=3, vary_batch=(1, 2),
                           prompts=["hi", "there"], max_new_tokens=4, out=tmp_path / "two")
    rep = json.loads((outcome.out_dir / "report.json").read_text())
    assert rep["tier"]["effective"] == 3
    assert any(c["kind"] == "batch" and c["required"] for c in rep["comparisons"])


# ------------------------------------------------------------------ figures: named, and no maximum below a difference beside it


def _render_all(report: dict, folder: Path) -> dict[str, str]:
    from detllm.render.html import render_outcome
    from detllm.render.issue import render_issue
    from detllm.render.markdown import render_markdown
    from detllm.render.text import render_text

    return {"txt": render_text(report), "md": render_markdown(report), "html": render_outcome(report, folder),
            "issue": render_issue(report, folder)}


def _diff_report(tmp_path: Path, left: list[dict], right: list[dict]) -> tuple[dict, Path]:
    from detllm.commands.diff import diff
    from tests.test_fast_diff import _folder

    lf, rf = _folder(tmp_path, "left", left), _folder(tmp_path, "right", right)
    out = tmp_path / "d"
    got = diff(lf, rf, tier=2, out=out)
    return got.report, out


def _named_records() -> tuple[list[dict], list[dict]]:
    """Prompt 0: the chosen tokens' logprobs equal, a top-k entry (id 6) moved by 8.77e-05 at step 0;
    prompt 1: the chosen token's logprob moved by 1.86e-05 at step 1 (its top-k entry with it)."""
    from tests.test_fast_diff import _record

    def tops(lps, second=-2.5):
        return [[[5 + j, lp], [40 + j, second], [41 + j, -3.0]] for j, lp in enumerate(lps)]

    lps = [-0.1, -0.2, -0.3]
    a0, a1 = _record(0, [5, 6, 7], lps, tops(lps)), _record(1, [5, 6, 7], lps, tops(lps))
    b0 = json.loads(json.dumps(a0))
    b0["top_logprobs"][0][1][1] = -2.5 - 8.77e-05
    b1 = json.loads(json.dumps(a1))
    b1["logprobs"][1] += 1.86e-05
    b1["top_logprobs"][1][0][1] = b1["logprobs"][1]
    return [a0, a1], [b0, b1]


def test_each_figure_names_its_quantity_and_no_maximum_sits_below_a_difference(tmp_path):
    """The issue's case: `max |dlogprob| 1.86e-05` printed above a first divergence
    `|logprob difference| 8.77e-05` with both chosen logprobs printed equal. The difference is a
    top-k entry's; the drift's maximum is the chosen tokens'. Every renderer names both, and shows
    the top-k entries' difference beside the chosen maximum it exceeds."""
    left, right = _named_records()
    report, folder = _diff_report(tmp_path, left, right)
    d = report["first_divergence"]
    assert d["prompt_index"] == 0 and d["logprob_abs_diff"] == pytest.approx(8.77e-05)
    assert report["comparisons"][0]["drift"]["max_abs_logprob_diff"] == pytest.approx(1.86e-05)
    out = _render_all(report, folder)
    assert "max |dlogprob| of chosen tokens 1.86e-05, of top-k entries >=8.77e-05" in out["txt"]
    named = "8.77e-05, of a top-k entry id 40's logprob: -2.5 vs -2.50009 (right - left = -8.77e-05); the chosen token's logprob is equal"
    assert f"|logprob difference| {named}" in out["txt"]
    assert f"\\|logprob difference\\| {named}" in out["md"]
    assert "1.86e-05 (top-k entries ≥8.77e-05)" in out["md"]
    assert "of top-k entries &gt;=8.77e-05" in out["html"] and "of a top-k entry id 40&#x27;s logprob" in out["html"]
    assert named in out["issue"]
    for text in out.values():  # the unnamed figures once printed
        assert "diverged  max |dlogprob| 1.86e-05  " not in text and "difference| 8.77e-05\n" not in text
        assert "at this step (chosen token and top-k)" not in text and "largest |logprob difference| at this step:" not in text


def test_a_chosen_token_difference_is_named_and_within_the_maximum(tmp_path):
    left, right = _named_records()
    report, folder = _diff_report(tmp_path, left[1:], right[1:])
    assert report["first_divergence"]["logprob_abs_diff"] == pytest.approx(1.86e-05)
    out = _render_all(report, folder)
    assert "|logprob difference| 1.86e-05, of the chosen token's logprob" in out["txt"]
    assert "max |dlogprob| of chosen tokens 1.86e-05  " in out["txt"] and "top-k entries" not in out["txt"]


def test_a_share_with_flips_is_never_printed_as_100_percent():
    """R16: 5 argmax flips over 60,000 top-k steps is a same-top-1 share of 99.992%, once printed
    "100.0%" beside "argmax flips 5"."""
    from detllm.render.text import drift_summary

    line = drift_summary({"available": True, "same_top1_share": (60000 - 5) / 60000, "argmax_flips": 5})
    assert "same top-1 99.9%" in line and "100.0%" not in line

    from detllm.render.figures import share

    assert share(1.0) == "100.0%" and share(0.99996) == "99.9%" and share(0.00004) == "<0.1%" and share(0.0) == "0.0%"
    assert share(0.5) == "50.0%"


def test_a_check_with_two_late_flips_in_12000_steps_does_not_print_100_percent(tmp_path):
    """R16 through a real check: two prompts of twenty flip at their last step of 600, so the same
    top-1 share is 99.98%; report.txt and report.md print it beside "argmax flips 2" as 99.9%."""
    import detllm

    out = detllm.check(backend="fake", options={"diverge": "prompt=3,pos=599,run=1;prompt=11,pos=599,run=1"}, tier=2, runs=2,
                       prompts=[f"prompt {i}" for i in range(20)], max_new_tokens=600, out=tmp_path / "c")
    drift = out.report["comparisons"][0]["drift"]
    assert drift["argmax_flips"] == 2 and 0.9995 <= drift["same_top1_share"] < 1.0
    for name in ("report.txt", "report.md"):
        text = (out.out_dir / name).read_text()
        assert "same top-1 99.9%" in text and "100.0%" not in text, name
