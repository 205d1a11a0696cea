"""Issue 21 item 6: a bug report shows what differs. At a logprob divergence every format (txt, md,
issue, html) prints the entry whose difference is the divergence's, both sides' values with enough
digits to differ, and the signed difference right minus left; the HTML highlights that top-k row.
The trial's case (both chosen logprobs printed -0.000849131, the 8.77e-05 in a top-k entry nobody
saw) on synthetic records, then the real batch drift of transformers on the tiny model."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest

FORMATS = ("txt", "md", "issue", "html")
# "<what>: <left> vs <right> (right - left = <signed difference>)", as every format prints the entry
ENTRY = re.compile(r"(the chosen token's logprob|top-k entry id (\d+)'s logprob): (\S+) vs (\S+) "
                   r"\(right - left = ([+-]\S+)\)")


def _record(ids, lps, tops):
    from tests.test_fast_diff import _record as record

    return record(0, ids, lps, tops)


def _rendered(cli, left: list[dict], right: list[dict], tmp_path: Path) -> dict[str, str]:
    from tests.test_fast_diff import _folder

    lf, rf = _folder(tmp_path, "left", left), _folder(tmp_path, "right", right)
    r = cli("diff", lf, rf, "--tier", "2", "--out", tmp_path / "d")
    assert r.exit_code == 1, r.output
    out = {}
    for fmt in FORMATS:
        r = cli("report", tmp_path / "d", "--format", fmt)
        assert r.exit_code == 0, r.output
        out[fmt] = r.stdout
    return out


def _plain(fmt: str, text: str) -> str:
    """The text as read: the HTML's entities unescaped."""
    return html.unescape(text) if fmt == "html" else text


def _hl_rows(page: str) -> list[str]:
    return re.findall(r"<tr class='hl'[^>]*>(.*?)</tr>", page)


def test_a_top_k_entry_difference_is_printed_with_its_values_and_signed_delta(cli, tmp_path):
    """The trial's numbers: the chosen token 348's logprob -0.000849131 on both sides; top-k entry
    263 moved by +8.77e-05. Before, txt/issue printed the chosen logprob twice and no entry value."""
    lp = -0.000849131
    left = _record([348], [lp], [[[348, lp], [263, -7.52046], [395, -9.50739]]])
    right = json.loads(json.dumps(left))
    right["top_logprobs"][0][1][1] = -7.52046 + 8.77e-05
    right["top_logprobs"][0][2][1] = -9.50739 + 2e-05
    out = _rendered(cli, [left], [right], tmp_path)
    entry = "top-k entry id 263's logprob: -7.52046 vs -7.52037 (right - left = +8.77e-05)"
    assert entry in out["txt"] and entry in out["md"] and entry in out["issue"]
    assert entry in _plain("html", out["html"])
    for fmt, text in out.items():
        assert "the chosen token's logprob is equal" in _plain(fmt, text)
    # the HTML highlights the entry's row on both sides, each with its own value
    rows = _hl_rows(out["html"])
    assert len(rows) == 2 and all(">263<" in r for r in rows)
    assert "-7.52046" in rows[0] and "-7.52037" in rows[1]
    assert "**-7.52046** ◀" in out["md"] and "**-7.52037** ◀" in out["md"]  # the md top-k cells mark it too


def test_two_chosen_logprobs_that_differ_never_print_alike(cli, tmp_path):
    """A chosen logprob that moved by 3e-13: six digits print both as -0.000849131; every format
    prints as many digits as it takes for them to differ."""
    lp = -0.000849131
    left = _record([348], [lp], [[[348, lp], [263, -7.5]]])
    right = json.loads(json.dumps(left))
    right["logprobs"][0] = right["top_logprobs"][0][0][1] = lp - 3e-13
    out = _rendered(cli, [left], [right], tmp_path)
    for fmt, text in out.items():
        m = ENTRY.search(_plain(fmt, text))
        assert m is not None and m.group(1) == "the chosen token's logprob", (fmt, text)
        lv, rv = m.group(3), m.group(4)
        assert lv != rv and float(lv) == pytest.approx(lp, abs=1e-15) and float(rv) == pytest.approx(lp - 3e-13, abs=1e-15)
        assert float(m.group(5)) == pytest.approx(-3e-13, rel=1e-2)
        assert "logprob -0.000849131 " not in text and "(logprob -0.000849131)" not in text, fmt  # the token lines too
    assert "(logprob -0.0008491310000)" in out["issue"] and "(logprob -0.0008491310003)" in out["issue"]


def test_a_step_where_one_side_recorded_no_top_k_names_it(cli, tmp_path):
    """An infinite difference (no finite figure): before, no format said what differed at all."""
    left = _record([5, 6], [-0.5, -0.25], [[[5, -0.5], [7, -1.5]], [[6, -0.25], [7, -2.0]]])
    right = json.loads(json.dumps(left))
    right["top_logprobs"] = None
    out = _rendered(cli, [left], [right], tmp_path)
    for fmt, text in out.items():
        assert "the top-k: recorded on the left, none on the right" in text, fmt
        assert "right - left = +0" not in text


@pytest.mark.engine
def test_real_batch_drift_shows_the_differing_entry_in_every_format(cli, tmp_path):
    """transformers on the tiny model, batch 1 vs batch 4: the logprobs drift. Whatever entry moved
    most at the first divergence (found here from the trace, independently of the renderers), every
    format names it, prints its two recorded values apart and its signed difference, and the HTML
    highlights its row."""
    import detllm
    from detllm.compare.trace import load_records

    run = detllm.run(backend="hf", model="tiny", vary_batch=(1, 4), max_new_tokens=6, out=tmp_path / "r")
    r = cli("diff", f"{run.out_dir}::run_0@batch_1", f"{run.out_dir}::run_0@batch_4", "--tier", "3", "--out", tmp_path / "d")
    assert r.exit_code == 1, r.output
    report = json.loads((tmp_path / "d" / "report.json").read_text())
    d = report["first_divergence"]
    assert d["kind"] == "logprob"
    recs, _ = load_records(run.out_dir / "trace.jsonl", keep=lambda h: h["prompt_index"] == d["prompt_index"])
    by_batch = {r["batch_size"]: dict(r.load()) for r in recs}
    i = d["token_index"]
    a, b = by_batch[1], by_batch[4]
    moved = {None: (a["logprobs"][i], b["logprobs"][i])}
    tb = dict(map(tuple, b["top_logprobs"][i]))
    moved.update({tid: (v, tb[tid]) for tid, v in a["top_logprobs"][i] if tid in tb})
    biggest = max(abs(y - x) for x, y in moved.values())
    assert biggest > 0
    for fmt in FORMATS:
        text = cli("report", tmp_path / "d", "--format", fmt).stdout
        m = ENTRY.search(_plain(fmt, text))
        assert m is not None, (fmt, text)
        key = None if m.group(2) is None else int(m.group(2))
        left_value, right_value = moved[key]
        assert abs(right_value - left_value) == biggest, fmt  # the entry that moved most
        assert m.group(3) != m.group(4), fmt
        assert float(m.group(3)) == pytest.approx(left_value, rel=1e-5) and float(m.group(4)) == pytest.approx(right_value, rel=1e-5)
        assert m.group(5) == f"{right_value - left_value:+.3g}", fmt
        if fmt == "html":
            shown_id = d["left"]["token_id"] if key is None else key
            rows = _hl_rows(text)
            assert rows and all(f">{shown_id}<" in row for row in rows)
