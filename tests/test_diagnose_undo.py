"""diagnose of the trial's real llama.cpp bug report (issue 21, items 9 and 10): a check run with
`--opt cache_prompt=true` at tier 2 with --vary-batch 1,4 FAILs with RUN_VARIANCE (a warm KV cache
moves run 1's logprobs by ~1.9e-5), while its batch 4 vs batch 1 comparison drifts ~2.9e-4 and
passes (tier 2 accepts batch drift). diagnose takes the pack as given (nothing written into it),
probes taking back the user's own cache_prompt=true first, and quotes the divergence's size from the
comparisons that diverged only. Before: the pack was refused (exit 5), the first knob was
threads=1, the passing setting ubatch=1, and the baseline's size 2.9e-4 came from the passing
batch comparison.
"""

from __future__ import annotations

import hashlib

import pytest

from detllm.runfolder.artifacts import read_json
from detllm.core.config import RunConfig
from detllm.diagnose.probes import plan, undo_probes
from detllm.diagnose.ranking import rank_knobs

from .conftest import llama_server_or_fail


@pytest.fixture(scope="module")
def cached_fail(tmp_path_factory):
    """(check folder, its pack): the real llama-server FAIL with the user's cache_prompt=true."""
    from typer.testing import CliRunner

    from detllm.cli import app

    llama_server_or_fail()
    tmp = tmp_path_factory.mktemp("undo")
    run = CliRunner()
    r = run.invoke(app, ["check", "--backend", "llamacpp", "--model", "tiny", "--opt", "cache_prompt=true", "--tier", "2",
                         "--vary-batch", "1,4", "--out", str(tmp / "bug"), "--no-progress", "--json"])
    assert r.exit_code == 1, r.output  # the reported bug: FAIL
    rep = read_json(tmp / "bug" / "report.json", "report")
    assert rep["causes"][0]["code"] == "RUN_VARIANCE"
    r = run.invoke(app, ["pack", str(tmp / "bug"), "-o", str(tmp / "bug.tar.gz")])
    assert r.exit_code == 0, r.output
    return tmp / "bug", tmp / "bug.tar.gz"


def _diagnose(cli, source, out):
    r = cli("diagnose", source, "--out", out)
    assert r.exit_code == 0, r.output
    return read_json(out / "diagnosis.json", "diagnosis"), r.output


@pytest.mark.engine
def test_diagnose_takes_a_pack_and_writes_nothing_into_it(cli, cached_fail, tmp_path):
    _, pack = cached_fail
    before = hashlib.sha256(pack.read_bytes()).hexdigest()
    siblings = sorted(p.name for p in pack.parent.iterdir())
    doc, _ = _diagnose(cli, pack, tmp_path / "d")
    assert doc["source"] == {"kind": "folder", "path": str(pack), "status": "FAIL", "recorded_causes": ["RUN_VARIANCE"]}
    assert doc["baseline"]["diverged"] and doc["baseline"]["kinds"] == ["run"]
    assert hashlib.sha256(pack.read_bytes()).hexdigest() == before
    assert sorted(p.name for p in pack.parent.iterdir()) == siblings


@pytest.mark.engine
def test_the_users_own_setting_is_taken_back_first_and_the_size_is_the_divergences(cli, cached_fail, tmp_path):
    folder, _ = cached_fail
    doc, text = _diagnose(cli, folder, tmp_path / "d")
    base = doc["baseline"]
    diverged = [c for c in base["comparisons"] if c["diverged"]]
    passing = [c for c in base["comparisons"] if not c["diverged"]]
    assert {c["kind"] for c in diverged} == {"run"} and [c["name"] for c in passing] == ["batch 4 vs batch 1"]
    # the size is the diverged comparisons' (~1.9e-5), never the passing batch drift's (~2.9e-4)
    assert base["max_abs_logprob_diff"] == max(c["max_abs_logprob_diff"] for c in diverged)
    assert base["passing_max_abs_logprob_diff"] == passing[0]["max_abs_logprob_diff"]
    assert base["max_abs_logprob_diff"] < passing[0]["max_abs_logprob_diff"]
    # the first probe takes back the user's cache_prompt=true; it vanishes and passes every confirmation
    first = doc["probes"][0]
    assert (first["name"], first["evidence"]["undoes"], first["outcome"]) == ("cache_prompt=false", {"cache_prompt": "true"}, "vanish")
    assert doc["passing_settings"]["settings"] == {"cache_prompt": "false"}
    assert doc["passing_settings"]["fresh_process_passes"] == 3
    assert doc["knobs"][0]["knob"] == "cache_prompt" and doc["knobs"][0]["verdict"] == "vanishes"
    assert "takes back your own --opt cache_prompt=true" in doc["knobs"][0]["summary"]
    assert "ubatch" not in {p["knob"] for p in doc["probes"]}  # a new, slower setting is not needed
    assert "your own --opt cache_prompt=true taken back" in doc["conclusion"]
    # a vanished divergence is not given a size: the drift left is said to be accepted
    assert "no divergence left (the drift left, max |dlogprob| 0.000" in doc["knobs"][0]["summary"]


def test_every_user_option_away_from_the_default_is_undone_first_and_inert_ones_are_not():
    cfg = RunConfig(backend="llamacpp", model="tiny", options=(("cache_prompt", "true"), ("kv_type", "f16"), ("port", "8123"),
                                                               ("startup_timeout", "60"), ("ubatch", "64")))
    undo = undo_probes(cfg)
    assert [p.name for p in undo] == ["cache_prompt=false", "kv_type=default", "ubatch=default"]
    ub = undo[2]
    assert ub.unset == ("ubatch",) and "ubatch" not in ub.apply(cfg).option_dict() and ub.apply(cfg).option_dict()["port"] == "8123"
    probes, _ = plan(cfg, ["run"], tier=2)
    assert [p.name for p in probes[:3]] == [p.name for p in undo]
    assert [p.name for p in probes].count("cache_prompt=false") == 1  # the plan's own cache knob is the same probe
    # a value equal to the default is no setting of the user's; the fake's options are its script
    assert undo_probes(RunConfig(backend="llamacpp", model="tiny", options=(("cache_prompt", "false"),))) == []
    assert undo_probes(RunConfig(backend="fake", model="tiny", options=(("batch_drift", "0.5"),))) == []


def test_an_undo_ranks_above_a_new_setting_with_the_same_verdict():
    def result(name, knob, undoes=None):
        ev = {"max_abs_logprob_diff": None, "passing_max_abs_logprob_diff": 3e-4, "first": None}
        if undoes:
            ev["undoes"] = undoes
        return {"name": name, "knob": knob, "kind": "check", "status": "ran", "outcome": "vanish", "evidence": ev}

    knobs = rank_knobs([result("ubatch=1", "ubatch"), result("cache_prompt=false", "cache_prompt", {"cache_prompt": "true"})],
                       {"max_abs_logprob_diff": 1.9e-5})
    assert [(k["knob"], k["rank"]) for k in knobs] == [("cache_prompt", 1), ("ubatch", 2)]
