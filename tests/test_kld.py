"""`report --format kld`: llama-perplexity's --kl-divergence statistics of two runs.

The golden: tests/fixtures/kld/llama-perplexity-kld.txt is real output of the pinned
llama-perplexity (see the README there); our block must have its sections, labels, percentiles
and number formats, line by line. The numbers are held to their definitions: the exact KL when
the whole vocabulary is listed, llama.cpp's percentile and standard error, the positions up to
and including each prompt's first divergent token. The engine test renders hf vs llama.cpp on
smollm2-135m (the session's shared runs).
"""

from __future__ import annotations

import math
import random
import re
import statistics as pystats
from pathlib import Path

import numpy as np
import pytest

from detllm.compare.kld import Position, position, positions, statistics
from detllm.core.errors import UsageError
from detllm.render.kld import block

from .conftest import trace_records

FIXTURE = Path(__file__).parent / "fixtures" / "kld" / "llama-perplexity-kld.txt"
NUMBER = re.compile(r" *-?(?:\d+\.(\d+)|nan|inf)")  # a printf'd number with its padding


def stats_block(text: str) -> list[str]:
    """The statistics block: from llama.cpp's first "======" line to the end, trailing blanks dropped."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("======"))
    return "\n".join(lines[start:]).rstrip("\n").split("\n")


def shape(line: str) -> tuple[str, str]:
    """(label, value format): the label before the first ':' as it is, and the values with each
    number (its padding aside) replaced by its count of decimals, so "± %10.6lf" and "%6.3lf%%" remain."""
    label, colon, values = line.partition(":")
    return label, colon + NUMBER.sub(lambda m: f" <{len(m.group(1) or '')}>", values)


def assert_same_block(ours: list[str]) -> None:
    golden = stats_block(FIXTURE.read_text(encoding="utf-8"))
    assert len(ours) == len(golden), (len(ours), len(golden))
    for mine, theirs in zip(ours, golden):
        assert shape(mine) == shape(theirs), f"\n ours: {mine!r}\n llama: {theirs!r}"


def _dist(rng: random.Random, n: int) -> list[float]:
    logits = [rng.gauss(0, 3) for _ in range(n)]
    top = max(logits)
    lse = top + math.log(sum(math.exp(x - top) for x in logits))
    return [x - lse for x in logits]


def _topk(lps: list[float], k: int) -> list[list[float]]:
    order = sorted(range(len(lps)), key=lambda i: -lps[i])[:k]
    return [[i, lps[i]] for i in order]


# ------------------------------------------------------------------ the golden


def test_the_fixture_is_llama_perplexitys_block():
    golden = stats_block(FIXTURE.read_text(encoding="utf-8"))
    assert golden[0] == "====== Perplexity statistics ======"
    assert "====== KL divergence statistics ======" in golden and "====== Token probability statistics ======" in golden
    assert golden[-1].startswith("Same top p:")


def test_block_has_llama_perplexitys_sections_labels_and_percentiles():
    rng = random.Random(7)
    found = []
    for _ in range(150):
        p, q = _dist(rng, 30), [x + rng.gauss(0, 0.05) for x in _dist(rng, 30)]
        tok = max(range(30), key=lambda i: p[i])
        found.append(position(_topk(p, 5), tok, p[tok], _topk(q, 5), tok, q[tok]))
    assert_same_block(block(statistics(found)))


# ------------------------------------------------------------------ the numbers


def test_whole_vocabulary_listed_gives_the_exact_kl_and_fewer_gives_a_lower_bound():
    rng = random.Random(3)
    for _ in range(20):
        p, q = _dist(rng, 40), _dist(rng, 40)
        tok = rng.randrange(40)
        exact = sum(math.exp(a) * (a - b) for a, b in zip(p, q) if a > -16)
        full = position(_topk(p, 40), tok, p[tok], _topk(q, 40), tok, q[tok])
        assert full.kld == pytest.approx(exact, abs=1e-12)
        assert full.nll == pytest.approx(-q[tok]) and full.nll_base == pytest.approx(-p[tok])
        assert full.p_diff == pytest.approx(math.exp(q[tok]) - math.exp(p[tok]))
        top5 = position(_topk(p, 5), tok, p[tok], _topk(q, 5), tok, q[tok])
        assert 0 <= top5.kld <= exact + 1e-12, "the shared top-k plus one other bucket coarse-grains: KL can only shrink"


def test_reference_token_missing_on_the_right_takes_the_other_bucket():
    p = [math.log(x) for x in (0.6, 0.3, 0.1)]
    q = [math.log(x) for x in (0.2, 0.7, 0.1)]
    pos = position([[0, p[0]], [1, p[1]]], 0, p[0], [[1, q[1]], [2, q[2]]], 1, q[1])
    # shared: token 1 only; P: {1: .3, other: .7}, Q: {1: .7, other: .3}; token 0 sits in Q's other bucket
    assert pos.outside and pos.nll == pytest.approx(-math.log(0.3))
    assert pos.kld == pytest.approx(0.3 * math.log(0.3 / 0.7) + 0.7 * math.log(0.7 / 0.3))
    assert not pos.same_top and pos.p_diff == pytest.approx(0.3 - 0.6)


def _record(i: int, tokens: list[int], inputs=(1, 2, 3)) -> dict:
    lp = math.log(0.5)
    return {"prompt_index": i, "input_ids": list(inputs), "token_ids": tokens, "logprobs": [lp] * len(tokens),
            "top_logprobs": [[[t, lp], [t + 1000, math.log(0.25)]] for t in tokens]}


def test_positions_count_up_to_and_including_the_first_divergent_token():
    left = [_record(0, [5, 6, 7, 8, 9]), _record(1, [1, 2, 3]), _record(2, [4, 4]), _record(3, [1, 2, 3, 4])]
    right = [_record(0, [5, 6, 70, 8, 9]), _record(1, [1, 2, 3]), _record(2, [4, 4], inputs=(9,)), _record(3, [1, 2])]
    found, counts = positions(left, right)
    assert len(found) == 3 + 3 + 2  # prompt 0: tokens 0-2 (2 is the divergent one); 1: all; 2: other inputs; 3: the shorter
    assert counts["prompts"] == 3 and counts["prompts_diverged"] == 1 and counts["prompts_other_input"] == 1
    assert [p.same_top for p in found[:3]] == [True, True, False]


def test_llama_cpps_percentile_median_and_standard_error():
    rng = random.Random(1)
    found = [Position(kld=rng.expovariate(50), nll_base=rng.random(), nll=rng.random(), p_diff=rng.gauss(0, 0.01),
                      same_top=rng.random() < 0.9, outside=False) for _ in range(201)]
    st = statistics(found)
    kld = [p.kld for p in found]
    for fraction, value in st["kld"]["percentiles"]:
        want = np.median(kld) if fraction is None else np.percentile(kld, 100 * fraction)  # numpy's default: linear, as llama.cpp
        assert value == pytest.approx(want, rel=1e-12)
    mean, err = st["kld"]["mean"]
    assert mean == pytest.approx(pystats.fmean(kld)) and err == pytest.approx(pystats.stdev(kld) / math.sqrt(len(kld)))
    assert (st["kld"]["maximum"], st["kld"]["minimum"]) == (max(kld), min(kld))
    same = sum(p.same_top for p in found) / len(found)
    assert st["p_diff"]["same_top"][0] == pytest.approx(same)


def test_runs_without_logprobs_are_refused_in_one_line():
    bare = _record(0, [1, 2])
    bare["logprobs"] = None
    with pytest.raises(UsageError, match="needs both runs recorded with logprobs"):
        positions([bare], [_record(0, [1, 2])])
    with pytest.raises(UsageError, match="no position to compare"):
        statistics([])


def test_cli_refuses_one_run_folder_and_junit(cli, tmp_path):
    run = tmp_path / "run"
    r = cli("run", "--backend", "fake", "--tier", "2", "--max-new-tokens", "4", "--out", run)
    assert r.exit_code == 0, r.output
    r = cli("report", "--format", "kld", run)
    assert r.exit_code == 2 and "pass two run folders, or a diff folder" in r.output
    r = cli("report", "--format", "kld", run, run, "--junit", tmp_path / "j.xml")
    assert r.exit_code == 2 and "no JUnit" in r.output
    r = cli("report", run, run)
    assert r.exit_code == 2 and "--format kld only" in r.output
    r = cli("report", "--format", "kld", run, run)
    assert r.exit_code == 0, r.output
    assert "Mean    KLD:   0.000000 ±   0.000000" in r.output and "Same top p: 100.000 ± 0.000 %" in r.output


# ------------------------------------------------------------------ real runs


@pytest.mark.engine
def test_hf_vs_llamacpp_smollm2_block(smollm2_sides, cli, tmp_path):
    hf, ll = smollm2_sides  # conftest: SmolLM2-135M through transformers (fp32) and llama-server (Q4_1)
    r = cli("report", "--format", "kld", hf, ll)
    assert r.exit_code == 0, r.output
    assert_same_block(stats_block(r.output))
    # the positions counted: each prompt's steps up to and including its first divergent token
    left, right = ({rec["prompt_index"]: rec["token_ids"] for rec in trace_records(f)} for f in (hf, ll))
    want = 0
    for i, a in left.items():
        b = right[i]
        n = min(len(a), len(b))
        first = next((j for j in range(n) if a[j] != b[j]), None)
        want += n if first is None else first + 1
    assert f"positions: {want}," in r.output
    assert "Mean    KLD:   0.000000" not in r.output, "fp32 vs Q4_1 weights: the distributions differ"
    # a diff folder reads the two runs it recorded: the same block
    d = tmp_path / "diff"
    assert cli("diff", hf, ll, "--out", d).exit_code == 1
    again = cli("report", "--format", "kld", d)
    assert again.exit_code == 0 and again.output == r.output


def test_header_says_what_differed_for_a_logprob_only_difference(cli, tmp_path):
    """No token diverges but the logprobs move: the header says so instead of "0 of N prompts diverged"."""
    a, b = tmp_path / "a", tmp_path / "b"
    for out, opts in ((a, []), (b, ["--opt", "diverge=prompt=1,pos=2,what=logprob"])):
        r = cli("run", "--backend", "fake", "--tier", "2", "--max-new-tokens", "4", "--out", out, *opts)
        assert r.exit_code == 0, r.output
    r = cli("report", "--format", "kld", a, b)
    assert r.exit_code == 0, r.output
    assert "no prompt's tokens diverged; logprobs or top-k differ at 1 of 16 positions (a logprob-only difference)" in r.stdout
    assert "0 of 4 prompts diverged" not in r.stdout
