"""The N-way verdict on fake-backend folders (fast): an outlier named from one folder's repeats, a
split with no majority naming no one, replicas that agree but move with batch size, and the usage
errors of `diff A B C ...` and `check --base-url U1 --base-url U2`. Real servers: test_fleet_servers.py."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import detllm
from detllm.runfolder.artifacts import validate
from detllm.fleet.nway import fleet_diff

PROMPTS = ["alpha beta", "gamma delta", "epsilon zeta"]


def _check(folder: Path, **kw) -> Path:
    detllm.check(backend="fake", model="tiny", prompts=PROMPTS, tier=2, max_new_tokens=8, out=folder, **kw)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    return {
        # run 1 of prompt 1 takes another token at position 3: the odd repeat out
        "one_off": _check(root / "one_off", runs=3, options={"diverge": "prompt=1,pos=3,run=1"}),
        # prompt 0 differs on runs 1, 2 and 3, each at its own position: four different outputs
        "all_diff": _check(root / "all_diff", runs=4, options={"diverge": "prompt=0,pos=2,run=1;prompt=0,pos=4,run=2;prompt=0,pos=6,run=3"}),
        # batch size 2 moves prompt 2 (same options in each folder: the same identity)
        **{f"batchy{i}": _check(root / f"batchy{i}", runs=2, vary_batch=(1, 2), options={"diverge": "prompt=2,pos=1,batch=2"})
           for i in range(3)},
    }


def test_outlier_is_the_repeat_that_differs(folders, tmp_path, cli):
    f = folders["one_off"]
    out = tmp_path / "nway"
    r = cli("diff", f"{f}::run_0", f"{f}::run_1", f"{f}::run_2", "--out", out, "--junit", tmp_path / "j.xml", "--html", tmp_path / "f.html")
    assert r.exit_code == 1, r.output
    doc = json.loads((out / "fleet.json").read_text())
    validate(doc, "fleet")
    assert (doc["category"], doc["outliers"], doc["majority"]["replicas"]) == ("OUTLIER", [1], [0, 2])
    assert [p["outliers"] for p in doc["prompts"]] == [[], [1], []]  # only prompt 1 moved
    assert len(doc["identity"]["groups"]) == 1 and not doc["identity"]["mismatched"]
    # a replica is compared with every group it could join: (0, 1) differs, (0, 2) agrees, (1, 2) differs
    assert {(p["left"], p["right"]): p["status"] for p in doc["pairs"]} == {(0, 1): "FAIL", (0, 2): "PASS", (1, 2): "FAIL"}
    bad = [p for p in doc["pairs"] if p["status"] == "FAIL"]
    assert all(p["first_divergence"]["token_index"] == 3 and p["first_divergence"]["prompt_index"] == 1 for p in bad)
    text = (out / "fleet.txt").read_text()
    assert "B*" in text and "outliers: replicas 1" in text
    cases = ET.parse(tmp_path / "j.xml").getroot().findall(".//testcase")
    assert len(cases) == 3 and [c.find("failure") is not None for c in cases] == [False, True, False]
    assert "OUTLIER" in (tmp_path / "f.html").read_text()


def test_all_different_names_no_outlier(folders):
    f = folders["all_diff"]
    doc = detllm.fleet_diff([f"{f}::run_{i}" for i in range(4)]).report  # the public API
    validate(doc, "fleet")
    assert doc["category"] == "NO_MAJORITY" and doc["outliers"] == [] and doc["majority"] is None
    p0 = doc["prompts"][0]
    assert [g["replicas"] for g in p0["groups"]] == [[0], [1], [2], [3]] and p0["majority"] is None
    assert all(len(p["groups"]) == 1 for p in doc["prompts"][1:])  # the other prompts agree
    assert doc["no_majority_prompts"] == [0]


def test_two_two_split_names_no_outlier(folders):
    one, alld = folders["one_off"], folders["all_diff"]
    # two sides equal run 0 at prompt 0, two are alld's runs 1 and 1 again (same selection twice): 2-2 there
    doc = fleet_diff([f"{alld}::run_0", f"{alld}::run_0", f"{alld}::run_1", f"{alld}::run_1"]).report
    assert doc["category"] == "NO_MAJORITY" and doc["outliers"] == []
    assert [g["replicas"] for g in doc["groups"]] == [[0, 1], [2, 3]]
    assert one  # the module's folders are shared


def test_agree_but_each_moves_with_batch(folders, cli):
    sides = [folders[f"batchy{i}"] for i in range(3)]
    r = cli("diff", *sides, "--json")
    assert r.exit_code == 1, r.output
    doc = json.loads(r.output)
    assert doc["category"] == "AGREE_BUT_VARIANT" and doc["outliers"] == [] and len(doc["groups"]) == 1
    assert {v["category"] for v in doc["variance"]} == {"BATCH_VARIANCE"}
    # their batch-2 records agree with each other too (the batch moves every replica alike)
    doc = fleet_diff([f"{s}::batch_2" for s in sides]).report
    assert doc["category"] == "AGREE_BUT_VARIANT" and len(doc["groups"]) == 1


@pytest.mark.parametrize("args, needle", [
    (["--left", "X"], "--left, --right and --plot"),
    (["--plot", "p.png"], "--left, --right and --plot"),
])
def test_nway_diff_refuses_two_side_options(folders, cli, args, needle):
    f = folders["one_off"]
    r = cli("diff", f, f, f, *args)
    assert r.exit_code == 2 and needle in r.output


def test_nway_diff_refuses_a_bare_trace(folders, tmp_path, cli):
    bare = tmp_path / "t.jsonl"
    bare.write_text((folders["one_off"] / "trace.jsonl").read_text())
    r = cli("diff", folders["one_off"], folders["one_off"], bare)
    assert r.exit_code == 2 and "bare trace file" in r.output


@pytest.mark.parametrize("args, needle", [
    (["check", "-b", "hf", "--base-url", "http://a:1/v1", "--base-url", "http://b:1/v1"], "applies to --backend openai"),
    (["run", "-b", "openai", "--base-url", "http://a:1/v1", "--base-url", "http://b:1/v1"], "use `detllm check`"),
    (["check", "-b", "openai", "--base-url", "http://a:1/v1", "--base-url", "http://a:1/v1/"], "given twice"),
    (["check", "-b", "openai", "--base-url", "http://a:1/v1", "--base-url", "ftp://b/v1"], "http:// or https://"),
    (["check", "-b", "openai", "--base-url", "http://a:1/v1", "--base-url", "http://u:p@b:1/v1"], "credential"),
])
def test_fleet_check_refuses_bad_urls_before_writing(cli, tmp_path, args, needle):
    out = tmp_path / "never"
    r = cli(*args, "--out", out)
    assert r.exit_code == 2 and needle in r.output, r.output
    assert not out.exists()


def test_fleet_out_must_be_a_fleet_folder(folders, cli):
    f = folders["one_off"]
    r = cli("diff", f"{f}::run_0", f"{f}::run_1", f"{f}::run_2", "--out", f)
    assert r.exit_code == 2 and "one of the folders being compared" in r.output


def _replicas(sides, unstable):
    from detllm.commands.diff import Selection, load_sides
    from detllm.commands.fleetverdict import Replica, prompt_keys

    loaded = load_sides(*[Selection.parse(s) for s in sides])
    return [Replica(index=i, name=s.label, source=str(a), side=s, keys=prompt_keys(s.records),
                    own={"status": "FAIL" if i in unstable else "PASS", "category": "RUN_VARIANCE" if i in unstable else "PASS",
                         "repeats_differ": i in unstable}) for i, (a, s) in enumerate(zip(sides, loaded))]


def test_unstable_replicas_name_no_outlier(folders):
    from detllm.commands.fleetverdict import fleet_verdict

    f = folders["one_off"]
    sides = [f"{f}::run_0", f"{f}::run_1", f"{f}::run_2"]  # replica 1 differs at prompt 1
    doc = fleet_verdict(_replicas(sides, {0, 1}), command="diff")  # most replicas differ from their own repeats
    validate(doc, "fleet")
    assert doc["category"] == "UNSTABLE" and doc["outliers"] == [] and all(not p["outliers"] for p in doc["prompts"])
    assert [r["unstable"] for r in doc["replicas"]] == [True, True, False]
    doc = fleet_verdict(_replicas(sides, {1}), command="diff")  # one unstable replica among stable ones: still named
    assert doc["category"] == "OUTLIER" and doc["outliers"] == [1] and doc["replicas"][1]["unstable"]


def test_a_replica_without_a_prompt_is_missing_not_an_outlier(tmp_path):
    sides = []
    for name, texts in (("a", PROMPTS), ("b", PROMPTS), ("c", [PROMPTS[0], PROMPTS[2]])):
        detllm.run(backend="fake", model="tiny", prompts=texts, max_new_tokens=4, out=tmp_path / name)
        sides.append(tmp_path / name)
    doc = detllm.fleet_diff(sides).report
    assert doc["category"] == "MISSING_PROMPTS" and doc["status"] == "FAIL" and doc["outliers"] == []
    p1 = doc["prompts"][1]
    assert p1["missing"] == [2] and p1["outliers"] == [] and p1["majority"] == "A" and [g["replicas"] for g in p1["groups"]] == [[0, 1]]
    assert [p["outliers"] for p in (doc["prompts"][0], doc["prompts"][2])] == [[], []]  # aligned by prompt, not position
    assert doc["explanations"][0]["causes"][0]["code"] == "PROMPT_MISMATCH"
