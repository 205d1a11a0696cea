"""Every folder detllm writes is sealed and verify re-derives what it can (issue 32 point 9):
a `diff --out` folder of two run folders (and of two bare traces) is re-derived from the comparison
it records; a verdict edited and resealed with the project's own seal is refused (exit 6); a
written folder verifies, packs, and its pack verifies. Committed fixtures, no engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from detllm.runfolder.integrity import seal

FIX = Path(__file__).parent / "fixtures" / "diff"


def _edit(folder: Path, name: str, change) -> None:
    p = folder / name
    doc = json.loads(p.read_text())
    change(doc)
    p.write_text(json.dumps(doc))
    seal(folder)  # resealed with the project's own seal: only the re-derivation can catch it


@pytest.fixture
def diff_folder(cli, tmp_path):
    out = tmp_path / "d"
    r = cli("diff", FIX / "base", FIX / "run_variance", "--out", out)
    assert r.exit_code == 1, r.output
    return out


def test_diff_folder_round_trip(cli, diff_folder, tmp_path):
    r = cli("verify", diff_folder)
    assert r.exit_code == 0, r.output
    assert "diff verdict FAIL (RUN_VARIANCE) re-derived from the 1 comparison(s) it records" in r.stdout
    assert "not re-derived: the comparison itself and the ranking of causes" in r.stdout
    pack = tmp_path / "d.tar.gz"
    assert cli("pack", diff_folder, "-o", pack).exit_code == 0
    r = cli("verify", pack)
    assert r.exit_code == 0 and "diff verdict FAIL (RUN_VARIANCE) re-derived" in r.stdout, r.output


@pytest.mark.parametrize("name,change,named", [
    ("report.json", lambda d: d.update(status="PASS", category="PASS"), "status is 'PASS', but its recorded comparison gives 'FAIL'"),
    ("report.json", lambda d: d.update(category="BATCH_VARIANCE"), "category is 'BATCH_VARIANCE', but its first cause is 'RUN_VARIANCE'"),
    ("report.json", lambda d: d["comparisons"][0].update(status="PASS"), "status is 'PASS', but its divergences"),
    ("report.json", lambda d: d["first_divergence"].update(token_index=2), "first_divergence is not the one"),
    ("diffs/first_divergence.json", lambda d: d["divergence"].update(token_index=2), "is not report.json's first divergence"),
])
def test_diff_verdict_edited_and_resealed_is_refused(cli, diff_folder, name, change, named):
    _edit(diff_folder, name, change)
    r = cli("verify", diff_folder)
    assert r.exit_code == 6, r.output
    assert named in r.stderr and "Traceback" not in r.output


def test_a_passing_diff_edited_to_fail_is_refused(cli, tmp_path):
    out = tmp_path / "p"
    assert cli("diff", FIX / "base", FIX / "base", "--out", out).exit_code == 0
    assert "diff verdict PASS re-derived" in cli("verify", out).stdout
    _edit(out, "report.json", lambda d: d.update(status="FAIL", category="RUN_VARIANCE"))
    r = cli("verify", out)
    assert r.exit_code == 6 and "status is 'FAIL', but its recorded comparison gives 'PASS'" in r.stderr, r.output


def test_bare_trace_diff_folder_round_trip_and_tamper(cli, tmp_path):
    out = tmp_path / "t"
    r = cli("diff", FIX / "base" / "trace.jsonl", FIX / "run_variance" / "trace.jsonl", "--out", out)
    assert r.exit_code == 1, r.output
    assert cli("verify", out).exit_code == 0
    assert cli("pack", out, "-o", tmp_path / "t.tar.gz").exit_code == 0
    assert "diff verdict FAIL" in cli("verify", tmp_path / "t.tar.gz").stdout
    _edit(out, "report.json", lambda d: d["comparisons"][0].update(prompts_diverged=0))
    r = cli("verify", out)
    assert r.exit_code == 6 and "records 0 prompt(s) diverged, but lists 1" in r.stderr, r.output


# ---------------------------------------------------------------- diagnose --out and sweep --out (runfolder/nestseal.py)

def _edit_nested(folder: Path, name: str, change) -> None:
    from detllm.runfolder.nestseal import seal_nested

    p = folder / name
    doc = json.loads(p.read_text())
    change(doc)
    p.write_text(json.dumps(doc))
    seal_nested(folder)  # resealed with the project's own seal


@pytest.fixture
def diagnosis(tmp_path):
    from detllm.api import make_config
    from detllm.diagnose import diagnose

    cfg = make_config(backend="fake", model="fake", max_new_tokens=6, tier=2, runs=2, vary_batch=(1, 8),
                      options={"diverge": "prompt=0,pos=3,batch=8", "stable_threads": "1"})
    diagnose(cfg, out=tmp_path / "dg", budget=3, fresh_repeats=2)
    return tmp_path / "dg"


def test_diagnosis_folder_round_trip(cli, diagnosis, tmp_path):
    r = cli("verify", diagnosis)
    assert r.exit_code == 0, r.output
    assert "run folder(s) inside verified" in r.stdout and "re-derived: the baseline's status FAIL" in r.stdout
    assert "Not re-derived: each probe's comparisons from its run folder's trace, and the conclusion" in r.stdout
    assert cli("pack", diagnosis, "-o", tmp_path / "dg.tar.gz").exit_code == 0
    r = cli("verify", tmp_path / "dg.tar.gz")
    assert r.exit_code == 0 and "re-derived: the baseline's status FAIL" in r.stdout, r.output


def _flip_check_probe(doc):
    p = next(p for p in doc["probes"] if p["kind"] == "check" and p["status"] == "ran")
    p["outcome"] = "persist" if p["outcome"] == "vanish" else "vanish"


@pytest.mark.parametrize("change,named", [
    (lambda d: d["source"].update(status="PASS"), "source.status is 'PASS', but baseline/report.json"),
    (_flip_check_probe, "records outcome"),
])
def test_diagnosis_edited_and_resealed_is_refused(cli, diagnosis, change, named):
    _edit_nested(diagnosis, "diagnosis.json", change)
    r = cli("verify", diagnosis)
    assert r.exit_code == 6 and named in r.stderr, r.output


def test_a_probe_folder_edited_inside_a_diagnosis_is_named(cli, diagnosis):
    from detllm.runfolder.nestseal import seal_nested

    _edit(diagnosis / "baseline", "report.json", lambda d: d.update(status="PASS", category="PASS"))
    r = cli("verify", diagnosis)
    assert r.exit_code == 6 and "baseline/manifest.json: changed after sealing" in r.stderr, r.output
    seal_nested(diagnosis)  # the outer folder resealed too: the baseline's own re-derivation refuses it
    r = cli("verify", diagnosis)
    assert r.exit_code == 6 and "baseline/report.json: status is 'PASS', but the sealed trace gives 'FAIL'" in r.stderr, r.output


def test_sweep_folder_round_trip_and_tamper(cli, tmp_path):
    out = tmp_path / "s"
    r = cli("sweep", "--backend", "fake", "--model", "fake", "--axis", "batch_size=1,8", "--repeats", "2", "--max-new-tokens", "6",
            "--opt", "diverge=prompt=0,pos=2,batch=8", "--out", out)
    assert r.exit_code == 0, r.output
    r = cli("verify", out)
    assert r.exit_code == 0 and "the 2 cell(s) that ran are run folders inside" in r.stdout, r.output
    assert "Not re-derived: each cell's label" in r.stdout
    assert cli("pack", out, "-o", tmp_path / "s.tar.gz").exit_code == 0
    assert cli("verify", tmp_path / "s.tar.gz").exit_code == 0
    (out / "sweep.txt").write_text("edited\n")
    r = cli("verify", out)
    assert r.exit_code == 6 and "sweep.txt: changed after sealing" in r.stderr, r.output


# ---------------------------------------------------------------- locate --out to a folder of its own

def test_locate_own_folder_is_sealed_round_trip_and_tamper(cli, tmp_path):
    import detllm

    c = tmp_path / "c"
    detllm.check(backend="fake", options={"diverge": "prompt=1,pos=2,batch=4,what=logprob"}, vary_batch=(1, 4), runs=2, tier=2,
                 max_new_tokens=6, out=c)
    out = tmp_path / "lo"
    assert cli("locate", f"{c}::batch_1", f"{c}::batch_4", "--out", out).exit_code == 0
    r = cli("verify", out)
    assert r.exit_code == 0, r.output
    assert "locate.json: first op model.layers.0.mlp.down_proj re-derived from its" in r.stdout
    assert "not re-derived: the captured tensors themselves" in r.stdout
    assert cli("pack", out, "-o", tmp_path / "lo.tar.gz").exit_code == 0
    assert "first op model.layers.0.mlp.down_proj re-derived" in cli("verify", tmp_path / "lo.tar.gz").stdout
    _edit(out, "locate.json", lambda d: d["first_bitwise_op"].update(module="model.layers.1.mlp.down_proj"))
    r = cli("verify", out)
    assert r.exit_code == 6 and "first_bitwise_op is 'model.layers.1.mlp.down_proj', but its recorded rows give" in r.stderr, r.output


def test_an_unsealed_folder_gets_true_advice(cli):
    r = cli("verify", FIX / "base")
    assert r.exit_code == 5 and "every folder this detllm writes is sealed" in r.stderr, r.output
    assert "seal it by running it" not in r.output
