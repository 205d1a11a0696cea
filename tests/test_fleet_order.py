"""The N-way verdict does not depend on the order of its sides (issue 31, C5 and C6): one tier for
every pair, chosen before grouping; a group whose members all equal each other; the majority of a
prompt over the replicas that have it, a replica without the prompt reported as missing. Each case
is run in every order of its sides (fake-backend folders, as the review reproduced them)."""

from __future__ import annotations

import itertools

import pytest

import detllm
from detllm.fleet.nway import fleet_diff
from detllm.runfolder.artifacts import validate


def _canon(doc: dict, sides: list[str]) -> dict:
    """The verdict with each replica named by its side, not its position."""
    name = {r["index"]: sides[r["index"]] for r in doc["replicas"]}
    named = lambda ids: frozenset(name[i] for i in ids)  # noqa: E731
    return {"category": doc["category"], "status": doc["status"], "tier": doc["tier"]["effective"],
            "outliers": named(doc["outliers"]),
            "groups": frozenset(named(g["replicas"]) for g in doc["groups"]),
            "prompts": {(p["prompt_id"], p["occurrence"]): (frozenset(named(g["replicas"]) for g in p["groups"]),
                                                             named(p["outliers"]), named(p["missing"]),
                                                             named(p.get("chained", [])))
                        for p in doc["prompts"]}}


def _every_order(sides: list[str], **kw) -> dict:
    """The canonical verdict, asserted equal in every permutation of `sides`."""
    seen = []
    for perm in itertools.permutations(sides):
        doc = fleet_diff(list(perm), **kw).report
        validate(doc, "fleet")
        seen.append(_canon(doc, list(perm)))
    assert all(s == seen[0] for s in seen), [s["category"] for s in seen]
    return seen[0]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("order")


def test_c5_one_tier_for_every_pair_in_every_order(root):
    """A tier-2 check whose run 1 moved one logprob, and a tier-1 run of the same identity: at the
    common tier (1, the lowest recorded) every pair agrees, so no order names an outlier."""
    opt = {"diverge": "prompt=0,pos=2,run=1,what=logprob"}
    c = root / "c"
    detllm.check(backend="fake", model="tiny", runs=2, tier=2, options=opt, out=c)
    detllm.run(backend="fake", model="tiny", tier=1, options=opt, out=root / "b")
    v = _every_order([f"{c}::run_0", str(root / "b"), f"{c}::run_1"])
    assert (v["category"], v["tier"], v["outliers"]) == ("AGREE_BUT_VARIANT", 1, frozenset())
    assert len(v["groups"]) == 1
    # --tier 2 compares the logprobs of every pair: c::run_1 is the outlier, whatever the order
    v = _every_order([f"{c}::run_0", str(root / "b"), f"{c}::run_1"], tier=2)
    assert (v["category"], v["tier"], v["outliers"]) == ("OUTLIER", 2, frozenset({f"{c}::run_1"}))


def test_c5_a_chain_within_atol_is_no_group_in_any_order(root):
    """Batch sizes 1, 2, 3 move every logprob by 1e-6 per extra row: at --tier 3 (logprobs across batch
    sizes) within --atol 1.5e-6 batch 1 ~ 2 and
    2 ~ 3, but 1 and 3 differ. Joining the first member would make the groups depend on the order;
    here the three stand alone, each prompt lists them as chained, and no outlier is named."""
    x = root / "x"
    detllm.check(backend="fake", model="tiny", tier=2, vary_batch=(1, 2, 3), options={"batch_drift": 1e-6}, out=x)
    v = _every_order([f"{x}::batch_1", f"{x}::batch_2", f"{x}::batch_3"], atol=1.5e-6, tier=3)
    assert (v["category"], v["outliers"], len(v["groups"])) == ("NO_MAJORITY", frozenset(), 3)
    assert all(chained == {f"{x}::batch_{b}" for b in (1, 2, 3)} for _, _, _, chained in v["prompts"].values())
    v = _every_order([f"{x}::batch_1", f"{x}::batch_2", f"{x}::batch_3"], atol=3e-6, tier=3)  # all within atol: one group
    assert len(v["groups"]) == 1 and v["category"] != "NO_MAJORITY"


def test_c6_majority_over_the_replicas_that_have_the_prompt(root):
    """Three replicas with two prompts split A, A, B on prompt 1; a fourth has only prompt 0. The
    majority on prompt 1 is A (2 of the 3 that have it): m::run_2 is the outlier, and the fourth is
    reported missing there, not as an outlier."""
    opt = {"diverge": "prompt=1,pos=1,run=2"}
    m, m1 = root / "m", root / "m1"
    detllm.check(backend="fake", model="tiny", runs=3, tier=2, prompts=["alpha beta", "gamma delta"], options=opt, out=m)
    detllm.check(backend="fake", model="tiny", runs=2, tier=2, prompts=["alpha beta"], options=opt, out=m1)
    sides = [f"{m}::run_0", f"{m}::run_1", f"{m}::run_2", f"{m1}::run_0"]
    v = _every_order(sides)
    assert (v["category"], v["outliers"]) == ("OUTLIER", frozenset({f"{m}::run_2"}))
    p1 = next(p for k, p in v["prompts"].items() if len(p[0]) == 2)
    assert p1[1] == {f"{m}::run_2"} and p1[2] == {f"{m1}::run_0"}
