"""`detllm replay`: re-run a pack here and diff against it. Refuses changed packs (6), packs
without prompt text (2) and changed weights (7) before anything is written; the backend is
loaded once and its weights checked before a token is generated."""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import pytest

import detllm
from detllm.backends.fake import FakeBackend
from detllm.runfolder.integrity import seal

from .conftest import assert_valid_run

replay_mod = importlib.import_module("detllm.commands.replay")  # the module; `detllm.replay` is the function


@pytest.fixture(scope="module")
def fake_pack(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("replaysrc") / "run"
    detllm.check(backend="fake", tier=2, vary_batch=(1, 2), out=out)
    return detllm.create_pack(out, out.parent / "run.tar.gz")


@pytest.fixture
def sampled_run(tmp_path) -> Path:
    out = tmp_path / "sampled"
    detllm.check(backend="fake", temperature=0.8, top_k=5, seed=3, out=out)
    return out


@pytest.fixture
def spy(monkeypatch):
    """Counts backend creations and generate() calls made by replay."""
    calls = {"create": 0, "generate": 0}
    real_create, real_generate = replay_mod.create_backend, FakeBackend.generate

    def create(config):
        calls["create"] += 1
        return real_create(config)

    def generate(self, *a, **k):
        calls["generate"] += 1
        return real_generate(self, *a, **k)

    monkeypatch.setattr(replay_mod, "create_backend", create)
    monkeypatch.setattr(FakeBackend, "generate", generate)
    return calls


def test_replay_of_a_pack_passes_and_writes_a_sealed_folder(cli, fake_pack, tmp_path, spy):
    out = tmp_path / "replayed"
    r = cli("replay", fake_pack, "--out", out, "--no-progress")
    assert r.exit_code == 0, r.output
    assert "detllm replay: PASS" in r.stdout
    report = assert_valid_run(out)
    assert report["command"] == "replay" and report["status"] == "PASS"
    names = [c["name"] for c in report["comparisons"]]
    assert names == [f"pack::run_{i}@batch_1 vs replay::run_{i}@batch_1" for i in range(3)] + \
        ["pack::run_0@batch_2 vs replay::run_0@batch_2"]
    assert json.loads((out / "run_config.json").read_text())["command"] == "replay"
    r = cli("verify", out)
    assert r.exit_code == 0
    assert "verdict not re-derived: a replay's verdict is a diff against the pack it replayed" in r.stdout
    assert spy["create"] == 1, "the backend is loaded once"


def test_replay_of_a_folder_matches_replay_of_its_pack(fake_pack, tmp_path):
    with detllm.runfolder.artifacts.open_run_path(fake_pack) as folder:
        o = detllm.replay(folder, out=tmp_path / "r")
    assert o.status == "PASS" and o.exit_code == 0


def test_no_prompt_text_pack_is_refused_with_a_clear_line(cli, tmp_path, spy):
    src = tmp_path / "hidden"
    detllm.check(backend="fake", record_prompt_text=False, out=src)
    r = cli("replay", src, "--out", tmp_path / "r")
    assert r.exit_code == 2 and "recorded with --no-prompt-text" in r.stderr
    assert not (tmp_path / "r").exists() and spy["create"] == 0


def test_a_tampered_pack_is_not_replayed(cli, fake_pack, tmp_path, spy):
    with detllm.runfolder.artifacts.open_run_path(fake_pack) as folder:
        shutil.copytree(folder, tmp_path / "run")
    ls = (tmp_path / "run" / "trace.jsonl").read_bytes().splitlines(keepends=True)
    (tmp_path / "run" / "trace.jsonl").write_bytes(b"".join(ls[:-1]))
    r = cli("replay", tmp_path / "run", "--out", tmp_path / "r")
    assert r.exit_code == 6 and "trace.jsonl" in r.stderr
    assert not (tmp_path / "r").exists() and spy["create"] == 0


def test_bad_out_is_refused_before_the_model_loads(cli, fake_pack, tmp_path, spy):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "mine.txt").write_text("user file")
    r = cli("replay", fake_pack, "--out", tmp_path / "r")
    assert r.exit_code == 2 and spy["create"] == 0
    with detllm.runfolder.artifacts.open_run_path(fake_pack) as folder:
        shutil.copytree(folder, tmp_path / "run")
    r = cli("replay", tmp_path / "run", "--out", tmp_path / "run")
    assert r.exit_code == 2 and "is the pack being replayed" in r.stderr
    assert cli("verify", tmp_path / "run").exit_code == 0, "the pack was not touched"


def test_edited_seed_passes_verify_and_is_caught_by_replay(cli, sampled_run, tmp_path):
    """A forger (or an accident) that edits the seed and recomputes the manifest passes an unsigned
    verify; replay regenerates with the edited seed and the recorded tokens no longer follow."""
    rc = json.loads((sampled_run / "run_config.json").read_text())
    rc["config"]["seed"] = 4
    (sampled_run / "run_config.json").write_text(json.dumps(rc, indent=2) + "\n")
    seal(sampled_run)
    assert cli("verify", sampled_run).exit_code == 0
    r = cli("replay", sampled_run, "--out", tmp_path / "r", "--no-progress")
    assert r.exit_code == 1, r.output
    report = assert_valid_run(tmp_path / "r", failed=True)
    assert report["status"] == "FAIL" and report["first_divergence"]["kind"] == "token"


def _change_recorded_weights(folder: Path) -> None:
    rc = json.loads((folder / "run_config.json").read_text())
    rc["model"]["weights"][0]["sha256"] = "0" * 64
    rc["model"]["weights_sha256"] = "1" * 64
    (folder / "run_config.json").write_text(json.dumps(rc, indent=2) + "\n")
    seal(folder)


def test_model_change_is_refused_before_generating(cli, tmp_path, spy):
    src = tmp_path / "run"
    detllm.check(backend="fake", out=src)
    _change_recorded_weights(src)
    spy["create"] = spy["generate"] = 0
    r = cli("replay", src, "--out", tmp_path / "r")
    assert r.exit_code == 7, r.output
    assert "fake.weights" in r.stderr and "--allow-model-change" in r.stderr
    assert not (tmp_path / "r").exists()
    assert spy == {"create": 1, "generate": 0}, "loaded once, refused before a token was generated"
    r = cli("replay", src, "--out", tmp_path / "r", "--allow-model-change", "--no-progress")
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert "MODEL_MISMATCH" in json.dumps(report["info"]), "the weight difference is still reported"


# ---------------------------------------------------------------- the real tiny model


@pytest.mark.engine
def test_weights_substituted_under_the_same_path(cli, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.numpy")
    np = pytest.importorskip("numpy")
    model = tmp_path / "tiny"
    assert cli("models", "export", "tiny", model).exit_code == 0
    src = tmp_path / "run"
    r = cli("check", "--model", model, "--runs", "2", "--max-new-tokens", "6", "--tier", "2", "--out", src, "--no-progress")
    assert r.exit_code == 0, r.output
    pack = detllm.create_pack(src, tmp_path / "run.tar.gz")
    # same path, different weights
    weights = next(model.glob("*.safetensors"))
    tensors = st.load_file(str(weights))
    rng = np.random.default_rng(0)
    tensors = {k: (v + rng.normal(0, 0.5, v.shape)).astype(v.dtype) for k, v in tensors.items()}
    st.save_file(tensors, str(weights), metadata={"format": "pt"})
    created = []
    real_create = replay_mod.create_backend
    monkeypatch.setattr(replay_mod, "create_backend", lambda config: (created.append(config), real_create(config))[1])
    r = cli("replay", pack, "--out", tmp_path / "r")
    assert r.exit_code == 7 and weights.name in r.stderr, r.output
    assert created == [], "the local weights are checked from their files, before any engine loads them"
    assert not (tmp_path / "r").exists()
    r = cli("replay", pack, "--out", tmp_path / "r", "--allow-model-change", "--no-progress")
    assert r.exit_code == 1, r.output
    report = assert_valid_run(tmp_path / "r", failed=True)
    assert report["category"] == "MODEL_MISMATCH"


def test_replay_never_takes_code_executing_options_from_a_pack():
    from detllm.core.config import RunConfig
    from detllm.core.errors import UsageError
    from detllm.commands.replay import pack_options

    cfg = RunConfig(backend="llamacpp", options=(("bin", "/tmp/evil"), ("slots", "4")))
    assert pack_options(cfg).options == (("slots", "4"),), "a binary path is dropped: the local llama-server runs"
    assert pack_options(cfg, allow=("bin",)).options == cfg.options
    served = RunConfig(backend="openai", options=(("api_key_env", "AWS_SECRET"), ("base_url", "http://evil.example/v1")))
    assert pack_options(served, allow=()).options == ()
    for key, value in (("trust_remote_code", "true"), ("attn_implementation", "flash_attention_2"),
                       ("attn_implementation", "my_kernels.attn")):
        hf = RunConfig(backend="hf", options=((key, value),))
        with pytest.raises(UsageError, match=f"the pack sets --opt {key}="):
            pack_options(hf)
        assert pack_options(hf, allow=(key,)).options == ((key, value),)
    for safe in (("trust_remote_code", "false"), ("attn_implementation", "sdpa"), ("attn_implementation", "eager")):
        assert pack_options(RunConfig(backend="hf", options=(safe,))).options == (safe,)
    with pytest.raises(UsageError, match="is not an option replay guards"):
        pack_options(cfg, allow=("slots",))


def test_replay_of_a_pack_asking_for_remote_code_is_refused_before_anything_runs(cli, fake_pack, tmp_path, spy):
    from detllm.runfolder.archive import extract

    folder = extract(fake_pack, tmp_path / "x")
    rc = json.loads((folder / "run_config.json").read_text())
    rc["config"]["options"] = {"trust_remote_code": "true"}
    (folder / "run_config.json").write_text(json.dumps(rc, indent=2) + "\n")
    seal(folder)  # a pack its author sealed this way: verify passes
    assert cli("verify", folder).exit_code == 0
    r = cli("replay", folder, "--out", tmp_path / "r")
    assert r.exit_code == 2 and "the pack sets --opt trust_remote_code='true'" in r.stderr, r.output
    assert "--allow-pack-option trust_remote_code" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert spy["create"] == 0 and not (tmp_path / "r").exists()
    r = cli("replay", folder, "--out", tmp_path / "r", "--allow-pack-option", "trust_remote_code")
    assert r.exit_code == 2 and "unknown --opt 'trust_remote_code' for backend 'fake'" in r.stderr, "taken, then judged by the backend"


def test_replay_refuses_a_pack_whose_verdict_was_forged(cli, tmp_path, spy):
    failed = detllm.check(backend="fake", options={"diverge": "prompt=1,pos=3,run=1"}, out=tmp_path / "fail").out_dir
    rep = json.loads((failed / "report.json").read_text())
    rep.update(status="PASS", category="PASS", first_divergence=None, causes=[])
    (failed / "report.json").write_text(json.dumps(rep, indent=2) + "\n")
    seal(failed)  # re-sealed without a key: every byte checks out
    r = cli("replay", failed, "--out", tmp_path / "r")
    assert r.exit_code == 6 and "report.json: status is 'PASS', but the sealed trace gives 'FAIL'" in r.stderr, r.output
    assert spy["create"] == 0 and not (tmp_path / "r").exists()
