"""diagnose's own comparisons (the needle's trials, prefill vs decode) follow the one NaN rule
of compare/steps.py: a null logprob on one side only is a difference, counted, and never a number
in a maximum or a mean; they never crash on a server's null."""

from __future__ import annotations

from types import SimpleNamespace

from detllm.diagnose.needle import compare_generations
from detllm.diagnose.prefill import compare_scores


def _gen(lps):
    return SimpleNamespace(token_ids=[1, 2, 3], logprobs=lps, top_logprobs=None)


def test_a_null_on_one_side_is_counted_and_diverges_at_tier_3():
    got = compare_generations(_gen([-0.1, None, -0.3]), _gen([-0.1, -0.2, -0.3]), tier=3, atol=0.0)
    assert got["null_logprob_steps"] == 1 and got["max_abs_logprob_diff"] == 0.0 and got["diverged"] is True
    same = compare_generations(_gen([-0.1, None, -0.3]), _gen([-0.1, None, -0.3]), tier=3, atol=0.0)
    assert same["null_logprob_steps"] == 0 and same["diverged"] is False


def test_prefill_scores_with_a_null():
    got = compare_scores([-0.5, None, -0.25], [-0.5, -0.1, -0.125])
    assert got["first_differing_position"] == 1 and got["null_logprob_positions"] == 1
    assert got["max_abs_logprob_diff"] == 0.125 and got["mean_abs_logprob_diff"] == 0.0625
