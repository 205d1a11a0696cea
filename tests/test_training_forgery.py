"""Forged training packs, resealed with the project's own seal as a forger would (no key is needed
for an unsigned pack), on real training of `tiny`: what verify and replay accept must be what was
trained (issue 31 §1, the review's C1-C4 and C7). Each test would have passed the forgery before.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from detllm.runfolder.integrity import seal
from detllm.training.check import train_check

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    """tpA: 4 steps, PASS, a checkpoint at every boundary; tpG: run 1's gradient of one parameter
    changed at step 1 (grad_add), FAIL. One repeat each, in this process, one thread."""
    root = tmp_path_factory.mktemp("forgery")
    a = train_check(out=root / "tpA", steps=4, threads=1, repeats=1, fresh_process=0)
    g = train_check(out=root / "tpG", steps=4, threads=1, repeats=1, fresh_process=0,
                    test_options={"grad_add": {"run": 1, "step": 1, "parameter": "model.layers.1.mlp.up_proj.weight", "value": 1e-3}})
    assert a.exit_code == 0 and g.exit_code == 1
    return root / "tpA", root / "tpG"


def _copy(src, root):
    """A copy under `root` by the same name, so checkpoints.json's `location` finds its checkpoints."""
    dest = root / src.name
    shutil.copytree(src, dest)
    shutil.copytree(src.parent / (src.name + ".checkpoints"), dest.parent / (dest.name + ".checkpoints"))
    return dest


def _reseal(pack):
    (pack / "manifest.json").unlink()
    seal(pack)


def _jl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _wjl(path, recs):
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in recs))


def _report(pack, edit):
    rep = json.loads((pack / "train_report.json").read_text())
    edit(rep)
    (pack / "train_report.json").write_text(json.dumps(rep, indent=2))
    _reseal(pack)


def _no_comparisons(rep):
    rep.update(comparisons=[], verdict="PASS", first_divergence=None, summary="PASS: forged")


def _run_1_is_run_0(rep):
    rep["runs"][1]["file"], rep["runs"][1]["head"] = "steps.jsonl", rep["runs"][0]["head"]
    rep.update(comparisons=[{"run": 1, "equal": True, "first_divergence": None}], verdict="PASS", first_divergence=None,
               summary="PASS: 2 runs bitwise equal at every one of 4 steps (gradients, parameters, losses, RNG state, batches)")


def _both(key, value):
    def edit(rep):
        rep["comparisons"][0]["first_divergence"][key] = value
        rep["first_divergence"][key] = value
    return edit


def _top_level_step(rep):
    rep["first_divergence"].update(step=3, where="value", parameter="lm_head.weight")


def _null_divergence(rep):
    rep["comparisons"][0]["first_divergence"] = None
    rep["first_divergence"] = None


@pytest.mark.parametrize("edit,says", [
    (_no_comparisons, "every repeat the pack holds must be compared once"),                     # C1
    (_run_1_is_run_0, "run 1 is recorded in 'steps.jsonl', but run 1's steps file is 'repeats/run_1.jsonl'"),  # C1
    (_both("cause", "numerics"), "says cause 'numerics'; its steps file gives 'test_option'"),   # C7
    (_both("detail", "forged: kernels"), "says detail 'forged: kernels'"),                      # C7
    (_both("max_abs_diff", 1e-30), "max |Δ| 1e-30 of model.layers.1.mlp.up_proj.weight is outside what the records allow"),  # C7
    (_top_level_step, "the top-level first_divergence is not the earliest"),                     # C7
    (_null_divergence, "is recorded as none, but its steps file shows a first difference at step 1"),  # C7
])
def test_an_edited_report_of_a_fail_pack_is_refused(packs, tmp_path, cli, edit, says):
    pack = _copy(packs[1], tmp_path)
    _report(pack, edit)
    res = cli("verify", pack)
    assert res.exit_code == 6, res.output
    assert says in res.output, res.output


def test_a_summary_or_report_txt_relabelled_pass_is_refused(packs, tmp_path, cli):
    pack = _copy(packs[1], tmp_path)
    txt = pack / "report.txt"
    txt.write_text("PASS: 2 runs bitwise equal at every one of 4 steps\n" + txt.read_text().split("\n", 1)[1])
    _reseal(pack)
    res = cli("verify", pack)
    assert res.exit_code == 6 and "report.txt: its first line is not train_report.json's summary" in res.output, res.output


def _redo_descriptor(pack, b, name):
    """The file's sha256 and size written into its descriptor, the descriptor's into the index, resealed."""
    ck = pack.parent / (pack.name + ".checkpoints") / f"boundary_{b:06d}"
    desc = json.loads((ck / "checkpoint.json").read_text())
    for f in desc["files"]:
        if f["path"] == name:
            data = (ck / name).read_bytes()
            f["sha256"], f["size"] = hashlib.sha256(data).hexdigest(), len(data)
    (ck / "checkpoint.json").write_text(json.dumps(desc, indent=2))
    idx = json.loads((pack / "checkpoints.json").read_text())
    for c in idx["checkpoints"]:
        if c["boundary"] == b:
            c["descriptor_sha256"] = hashlib.sha256((ck / "checkpoint.json").read_bytes()).hexdigest()
    (pack / "checkpoints.json").write_text(json.dumps(idx, indent=2))
    _reseal(pack)
    return ck


def test_verify_recomputes_r_of_each_rng_json_and_says_the_optimizer_is_not_bound(packs, tmp_path, cli):
    """C4: an rng.json whose R is not its descriptor's rng_sha256 fails verify (no torch needed), as
    replay refuses it; verify says plainly that nothing it checks binds the optimizer state."""
    pack = _copy(packs[0], tmp_path)
    ck = pack.parent / "tpA.checkpoints" / "boundary_000002"
    rng = json.loads((ck / "rng.json").read_text())
    rng["state"]["python"]["internal"][5] ^= 1
    (ck / "rng.json").write_text(json.dumps(rng, indent=2))
    _redo_descriptor(pack, 2, "rng.json")
    res = cli("verify", pack)
    assert res.exit_code == 6 and "boundary_000002/rng.json: R = SHA256(JCS(state)) of the file is not the descriptor's" in res.output
    res = cli("verify", packs[0])
    assert res.exit_code == 0 and "5 of 5 checked by digest down to H(θ) and R" in res.output
    assert "the optimizer state (optimizer.safetensors, the descriptor's extra) is checked against its descriptor only" in res.output


def _fork(src, dest):
    """The review's C2 forgery: boundary 2's RNG state replaced by boundary 0's (steps 2 and 3 redraw
    the batches of steps 0 and 1), training continued from it with detllm's own loop, the new records
    and checkpoints spliced in, run 1 made equal to run 0, resealed."""
    from detllm.models import resolve_model
    from detllm.training.digest import rng_digest
    from detllm.training.loop import RunRequest, run_steps

    pack = _copy(src, dest)
    dest = pack
    ck = pack.parent / (pack.name + ".checkpoints")
    b2 = ck / "boundary_000002"
    rng2 = json.loads((b2 / "rng.json").read_text())
    rng2["state"] = json.loads((ck / "boundary_000000" / "rng.json").read_text())["state"]
    (b2 / "rng.json").write_text(json.dumps(rng2))
    desc = json.loads((b2 / "checkpoint.json").read_text())
    desc["rng_sha256"] = rng_digest(rng2["state"]).hex()
    (b2 / "checkpoint.json").write_text(json.dumps(desc, indent=2))
    _redo_descriptor(pack, 2, "rng.json")
    config = json.loads((pack / "train_config.json").read_text())
    got = run_steps(RunRequest(config=config, model_path=str(resolve_model("tiny").path), run=0, seed=0, stop=4,
                               steps_file=str(dest.parent / "fork.jsonl"), resume={"dir": str(b2)}, checkpoints=str(dest.parent / "fork_ck")))
    new = {r["step"]: r for r in got.records if r["artifact_type"] == "train_step"}
    for name, run in (("steps.jsonl", 0), ("repeats/run_1.jsonl", 1)):
        _wjl(pack / name, [r if r["artifact_type"] == "train_genesis" or r["step"] < 2 else {**new[r["step"]], "run": run}
                           for r in _jl(pack / name)])
    idx = json.loads((pack / "checkpoints.json").read_text())
    by_b = {c["boundary"]: c for c in got.checkpoints}
    for c in idx["checkpoints"]:
        if c["boundary"] in by_b:
            shutil.rmtree(ck / c["dir"])
            shutil.copytree(dest.parent / "fork_ck" / c["dir"], ck / c["dir"])
            c.update(by_b[c["boundary"]])
    (pack / "checkpoints.json").write_text(json.dumps(idx, indent=2))
    _report(pack, lambda rep: [r.update(head=new[3]["h"]) for r in rep["runs"]])
    return pack, new


def test_a_data_order_forged_at_a_boundary_is_caught_by_the_segment_that_ends_there(packs, tmp_path, cli):
    """C2: the forged pack verifies (nothing offline can tell), but the segment ending at the forged
    boundary, re-run from genesis, stops on another RNG state than the one recorded there. With N/N
    and with the one segment 1/N draws, the forgery is named; the other segment lands."""
    pack, new = _fork(packs[0], tmp_path)
    first = {r["step"]: r["samples"] for r in _jl(packs[0] / "steps.jsonl")[1:]}
    assert new[2]["samples"] == first[0]  # the forgery redrew step 0's batch at step 2
    assert cli("verify", pack).exit_code == 0
    res = cli("replay", pack, "--sample", "2/2", "--out", tmp_path / "r", "--json")
    assert res.exit_code == 1, res.output
    seg = {s["start"]: s for s in json.loads(res.output)["segments"]}
    assert seg[0]["from"] == "genesis" and seg[0]["landed"] and seg[0]["records_equal"]
    assert seg[0]["end_state"] == {"boundary": 2, "equal": False, "differs": ["rng"]}
    assert seg[2]["landed"] and seg[2]["end_state"]["equal"]  # the forged segment itself is self-consistent


def test_an_optimizer_state_forged_at_a_boundary_is_caught_where_a_segment_ends(packs, tmp_path, cli):
    """C4/C2: the AdamW moments at boundary 2 scaled (bound by its descriptor only): verify passes and
    says so; the segment ending at boundary 2 names the optimizer, not the honest training record."""
    from safetensors.torch import load_file, save_file

    pack = _copy(packs[0], tmp_path)
    ck = pack.parent / "tpA.checkpoints" / "boundary_000002"
    opt = load_file(ck / "optimizer.safetensors")
    key = sorted(opt)[0]
    opt[key] = opt[key] * 100
    save_file(opt, ck / "optimizer.safetensors")
    _redo_descriptor(pack, 2, "optimizer.safetensors")
    assert cli("verify", pack).exit_code == 0
    res = cli("replay", pack, "--sample", "2/2", "--out", tmp_path / "r", "--json")
    seg = {s["start"]: s for s in json.loads(res.output)["segments"]}
    assert res.exit_code == 1
    assert seg[0]["landed"] and seg[0]["records_equal"] and seg[0]["end_state"]["differs"] == ["optimizer"]
    assert not seg[2]["landed"]  # re-run from the forged moments, the honest records are not reproduced


def test_a_full_replay_compares_every_field_of_every_record(packs, tmp_path, cli):
    """C3: every loss, samples list, gradient norm and gradient L2 forged (h untouched) and resealed:
    the whole replay lands on every h but FAILs naming the batch and listing the forged fields."""
    pack = _copy(packs[0], tmp_path)
    for name in ("steps.jsonl", "repeats/run_1.jsonl"):
        recs = _jl(pack / name)
        for r in recs[1:]:
            r.update(loss=0.125, samples=[0, 1, 2, 3], grad_norm=0.5)
            for t in r["tensors"].values():
                t["grad_l2"] = 0.01
        _wjl(pack / name, recs)
    _reseal(pack)
    assert cli("verify", pack).exit_code == 0  # not in the chain: only a replay can tell
    res = cli("replay", pack, "--out", tmp_path / "r", "--json")
    assert res.exit_code == 1, res.output
    seg = json.loads(res.output)["segments"][0]
    assert seg["landed"] and not seg["records_equal"]
    assert seg["first_divergence"]["step"] == 0 and seg["first_divergence"]["where"] == "batch"
    assert {"loss", "samples", "grad_norm", "tensors.lm_head.weight.grad_l2"} <= set(seg["fields"])
    assert "h" not in seg["fields"]
    res = cli("replay", packs[0], "--out", tmp_path / "honest", "--json")
    assert res.exit_code == 0 and json.loads(res.output)["segments"][0]["records_equal"]
