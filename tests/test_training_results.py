"""The folders the training commands write beside training packs (issue 32, points 9, 10, 14):
`parity --out` and `diff A B --out` of two training packs are sealed, so verify re-derives what
it can and pack takes them; parity speaks RL terms (importance ratio, k3 mismatch KL) and takes
--base-url; train-check and parity write JUnit. Real tiny model, real hf backend, real packs.
"""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET

import pytest

from detllm.runfolder.integrity import seal
from detllm.runfolder.schema_io import validate
from detllm.training.check import train_check
from detllm.training.paritystats import compare_path, rl_terms

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def two_packs(tmp_path_factory):
    """Two 2-step packs of tiny that differ in the seed (one repeat each, in this process)."""
    root = tmp_path_factory.mktemp("result-packs")
    for name, seed in (("A", 0), ("B", 1)):
        assert train_check(out=root / name, steps=2, seed=seed, repeats=1, fresh_process=0, threads=1).exit_code == 0
    return root / "A", root / "B"


@pytest.fixture(scope="module")
def parity_folder(tmp_path_factory):
    from typer.testing import CliRunner

    from detllm.cli import app

    root = tmp_path_factory.mktemp("parity")
    res = CliRunner().invoke(app, ["parity", "--attn-implementation", "eager", "--max-new-tokens", "6", "--out", str(root / "p"),
                                   "--junit", str(root / "p.xml")])
    assert res.exit_code in (0, 1), res.output
    return root / "p", res.output


def test_rl_terms_by_hand():
    """r = exp(logp_trainer - logp_engine); k3 = r - 1 - log r, averaged; the share outside [0.99, 1.01]."""
    d = math.log(1.02)
    got = rl_terms([(-1.0, -1.0), (-1.0 + d, -1.0), (-2.0, -2.0 + 1e-7)])
    assert got["tokens"] == 3 and got["ratio_outside_share"] == pytest.approx(1 / 3)
    assert got["ratio_max"] == pytest.approx(1.02) and got["ratio_min"] == pytest.approx(math.exp(-1e-7))
    want = ((1.02 - 1 - d) + (math.exp(-1e-7) - 1 + 1e-7)) / 3
    assert got["mismatch_kl_k3"] == pytest.approx(want, rel=1e-6)
    assert rl_terms([(-1.0, -1.0)])["mismatch_kl_k3"] == 0.0  # bitwise equal: no mismatch
    assert compare_path([[-1.0, None]], [[-1.0, -0.5]], atol=0.0)["rl"]["tokens"] == 1  # a null logprob has no ratio


def test_parity_folder_is_sealed_and_rederived(parity_folder, cli, tmp_path):
    folder, output = parity_folder
    doc = json.loads((folder / "parity.json").read_text())
    validate(doc, "parity")
    dec = doc["paths"]["decode"]["rl"]
    assert dec["tokens"] == doc["paths"]["decode"]["positions"] > 0 and dec["mismatch_kl_k3"] >= 0
    assert "importance ratio r = exp(logp_trainer - logp_engine)" in output and "mismatch KL(engine || trainer)" in output
    res = cli("verify", folder)
    assert res.exit_code == 0, res.output
    assert "parity verdict" in res.output and "re-derived from the" in res.output
    res = cli("pack", folder, "-o", tmp_path / "p.tar.gz")
    assert res.exit_code == 0, res.output
    assert cli("verify", tmp_path / "p.tar.gz").exit_code == 0
    # a figure edited and the folder re-sealed: the bytes match, the figure no longer follows from the logprobs
    doc["paths"]["decode"]["max_abs_diff"] = doc["paths"]["decode"]["max_abs_diff"] / 2 + 1e-9
    (folder / "parity.json").write_text(json.dumps(doc))
    seal(folder)
    res = cli("verify", folder)
    assert res.exit_code == 6 and "paths.decode.max_abs_diff" in res.output, res.output


def test_parity_junit(parity_folder):
    folder, _ = parity_folder
    suite = ET.parse(folder.parent / "p.xml").getroot().find("testsuite")
    names = [c.get("name") for c in suite.findall("testcase")]
    assert names == ["decode vs trainer (hf)", "prefill vs trainer (hf)"]
    prefill = suite.findall("testcase")[1]
    assert prefill.find("failure") is None  # the same eager kernel: bitwise (test_training_parity)
    assert int(suite.get("failures")) == sum(c.find("failure") is not None for c in suite.findall("testcase"))


def test_parity_base_url_is_the_openai_option(cli, tmp_path, llama_served):
    """`parity --backend openai --base-url URL` against the session's real llama-server, as check takes it."""
    res = cli("parity", "--base-url", llama_served.url, "--out", tmp_path / "x")
    assert res.exit_code == 2 and "--base-url applies to --backend openai" in res.output and not (tmp_path / "x").exists()
    res = cli("parity", "--backend", "openai", "--base-url", llama_served.url, "--model", "tiny", "--max-new-tokens", "8",
              "--attn-implementation", "eager", "--out", tmp_path / "o")
    assert res.exit_code in (0, 1), res.output
    doc = json.loads((tmp_path / "o" / "parity.json").read_text())
    assert doc["engine"]["backend"] == "openai" and doc["paths"]["decode"]["available"], doc["paths"]
    assert doc["paths"]["decode"]["rl"]["tokens"] > 0 and "importance ratio" in res.output


def test_train_diff_folder_is_sealed(two_packs, cli, tmp_path):
    a, b = two_packs
    res = cli("diff", a, b, "--out", tmp_path / "d")
    assert res.exit_code == 1 and "cause: seed" in res.output, res.output
    res = cli("verify", tmp_path / "d")
    assert res.exit_code == 0 and "train_diff verdict FAIL follows from its first divergence" in res.output, res.output
    assert cli("pack", tmp_path / "d", "-o", tmp_path / "d.tar.gz").exit_code == 0
    doc = json.loads((tmp_path / "d" / "train_diff.json").read_text())
    doc["verdict"] = "PASS"
    (tmp_path / "d" / "train_diff.json").write_text(json.dumps(doc))
    seal(tmp_path / "d")
    assert cli("verify", tmp_path / "d").exit_code == 6


def test_train_check_junit(cli, tmp_path):
    res = cli("train-check", "--steps", "2", "--fresh-process", "0", "--threads", "1", "--test-option",
              "repeat_seed=1", "--out", tmp_path / "t", "--junit", tmp_path / "t.xml")
    assert res.exit_code == 1, res.output
    assert "checkpoints: 3 × ~5.51 MB = ~16.5 MB, every step (the default" in res.output  # said before training
    assert json.loads((tmp_path / "t" / "train_config.json").read_text())["checkpoint_every"] == 1
    suite = ET.parse(tmp_path / "t.xml").getroot().find("testsuite")
    case = suite.find("testcase")
    assert case.get("name") == "run 1 (same process) vs run 0" and case.find("failure").get("type") == "TRAIN_SEED"
    assert "first differs at step 0" in case.find("failure").get("message")
    res = cli("train-check", "--steps", "2", "--junit", tmp_path, "--out", tmp_path / "bad")
    assert res.exit_code == 2 and not (tmp_path / "bad").exists()


def test_default_checkpoint_cadence():
    """Before the first step, after the last and every k-th, k the smallest whose checkpoints stay
    under max(2 checkpoints, 2 GB): every step for tiny's 8 steps (its config, H(config) and chain
    head as before), only 0 and K for smollm2-135m's ~1.6 GB checkpoints."""
    from detllm.models import resolve_model
    from detllm.training import cadence
    from detllm.training.check import _parameters
    from detllm.training.loop import boundaries

    for steps, every in ((8, 1), (8, 3), (1000, 3), (8, None), (1, 1)):
        assert cadence.count(steps, every) == len(boundaries({"steps": steps, "checkpoint_every": every}))
    tiny = cadence.checkpoint_bytes(sum(b for _, b in _parameters(resolve_model("tiny").path, "float32")))
    assert 5e6 < tiny < 6e6  # model.safetensors 1.84 MB + optimizer.safetensors 3.68 MB, measured
    assert cadence.default_every(8, tiny) == 1
    k = cadence.default_every(1000, tiny)
    assert k == 3 and cadence.count(1000, 3) * tiny <= cadence.BUDGET_BYTES < cadence.count(1000, 2) * tiny
    assert cadence.default_every(8, 1_610_000_000) is None  # smollm2-135m: 2 checkpoints, not 9 (~14 GB)


def test_train_run_records_one_run_that_verify_takes_and_diff_compares(cli, tmp_path):
    """train-run: run 0 alone, RECORDED (nothing compared, never PASS); verify re-derives it from
    the chain, pack packs it, diff compares two (another seed names the seed); a report edited to
    PASS and re-sealed is refused."""
    for name, seed in (("n1", 0), ("n2", 1)):
        res = cli("train-run", "--steps", "2", "--threads", "1", "--seed", seed, "--out", tmp_path / name)
        assert res.exit_code == 0 and res.output.startswith("checkpoints: 3 ×") and "RECORDED: one run of 2 steps" in res.output, res.output
    report = json.loads((tmp_path / "n1" / "train_report.json").read_text())
    validate(report, "train_report")
    assert report["command"] == "train-run" and [r["run"] for r in report["runs"]] == [0] and report["comparisons"] == []
    assert not (tmp_path / "n1" / "repeats").exists()
    res = cli("verify", tmp_path / "n1")
    assert res.exit_code == 0 and "verdict RECORDED (one run, nothing compared) follows from steps.jsonl" in res.output, res.output
    assert cli("pack", tmp_path / "n1", "-o", tmp_path / "n1.tar.gz").exit_code == 0
    assert cli("verify", tmp_path / "n1.tar.gz").exit_code == 0
    res = cli("diff", tmp_path / "n1", tmp_path / "n2")
    assert res.exit_code == 1 and "cause: seed" in res.output and "max |Δ| at lm_head.weight" in res.output, res.output
    report["verdict"] = "PASS"
    (tmp_path / "n1" / "train_report.json").write_text(json.dumps(report))
    seal(tmp_path / "n1")
    res = cli("verify", tmp_path / "n1")
    assert res.exit_code == 6 and "a train-run report holds run 0 alone" in res.output, res.output
    res = cli("train-run", "--steps", "2", "--out", tmp_path / "bad", "--checkpoint-every", "-1")
    assert res.exit_code == 2 and not (tmp_path / "bad").exists()


def test_diff_of_two_script_packs_takes_script(cli, tmp_path):
    """`diff A B --script`: two --script packs whose scheduler differs (StepLR step 2 vs 3, so the
    rate first differs at step 2): each side re-runs from checkpoint 2 with its own script (its
    batches fast-forwarded, landing on its own commitments), max |Δ| is given and no module is
    blamed for an optimizer difference; without --script it says how; a changed script is refused."""
    from .test_training_script import SCRIPT

    (tmp_path / "a.py").write_text(SCRIPT)
    (tmp_path / "b.py").write_text(SCRIPT.replace("step_size=2", "step_size=3"))
    for name in ("a", "b"):
        res = cli("train-run", "--script", f"{tmp_path / name}.py:make", "--steps", "4", "--out", tmp_path / name)
        assert res.exit_code == 0, res.output
    res = cli("diff", tmp_path / "a", tmp_path / "b")
    assert res.exit_code == 1 and "diff A B --script PATH[:make]" in res.output and "max |Δ| at" not in res.output, res.output
    res = cli("diff", tmp_path / "a", tmp_path / "b", "--script", tmp_path / "a.py", "--script", tmp_path / "b.py", "--out", tmp_path / "d")
    assert res.exit_code == 1 and "first divergent step: step 2" in res.output, res.output
    assert "A re-run from checkpoint boundary 2 to step 2, landed on its commitments; B re-run from checkpoint boundary 2" in res.output
    doc = json.loads((tmp_path / "d" / "train_diff.json").read_text())
    assert doc["at_divergence"]["max_abs_grad_diff"] == 0 and doc["at_divergence"]["max_abs_value_diff"] > 0
    assert doc["at_divergence"]["first_op"]["found"] is None  # every module's output and gradient equal: the optimizer
    res = cli("diff", tmp_path / "a", tmp_path / "b", "--script", tmp_path / "a.py", "--out", tmp_path / "d2")
    assert res.exit_code == 6 and "is not the script the pack was made with" in res.output and not (tmp_path / "d2").exists()
    res = cli("diff", tmp_path / "a", tmp_path / "b", *["--script", tmp_path / "a.py"] * 3)
    assert res.exit_code == 2 and "once for both sides, or twice" in res.output


def test_axes_and_replay_folders_are_sealed(two_packs, cli, tmp_path):
    """train-check --axis and replay of a training pack write sealed folders; verify re-derives what
    the folder holds (the base's repeat from its cells; each segment's head from its records)."""
    res = cli("train-check", "--axis", "threads=1,2", "--steps", "1", "--out", tmp_path / "ax")
    assert res.exit_code == 0, res.output
    res = cli("verify", tmp_path / "ax")
    assert res.exit_code == 0 and "axes verdict PASS (the base repeats itself) re-derived from its cells" in res.output, res.output
    res = cli("replay", two_packs[0], "--out", tmp_path / "rp")
    assert res.exit_code == 0, res.output
    res = cli("verify", tmp_path / "rp")
    assert res.exit_code == 0 and "replay verdict PASS follows from the 1 segments' re-run records" in res.output, res.output
    assert cli("pack", tmp_path / "rp", "-o", tmp_path / "rp.tar.gz").exit_code == 0
    doc = json.loads((tmp_path / "rp" / "train_replay.json").read_text())
    doc["segments"][0]["head"] = doc["segments"][0]["committed_head"] = "0" * 64  # a forged head, re-sealed
    (tmp_path / "rp" / "train_replay.json").write_text(json.dumps(doc))
    seal(tmp_path / "rp")
    assert cli("verify", tmp_path / "rp").exit_code == 6


def test_a_refusal_stays_one_line(cli, tmp_path):
    """The checkpoints' size is said only once every refusal is behind: a bad --out is one line."""
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    res = cli("train-check", "--steps", "2", "--out", tmp_path / "full")
    assert res.exit_code == 2 and res.output.count("\n") == 1 and res.output.startswith("detllm: error: "), res.output
