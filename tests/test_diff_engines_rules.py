"""The right cause first, on real engines (issue 9): two real runs that differ in one
real-world way, diffed. transformers for the kernel path (ATEN_CPU_CAPABILITY) and a
cosmetic config re-save; llama-server for runs that differ only in batch size."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

import detllm
from detllm.runfolder.artifacts import validate

pytestmark = pytest.mark.engine


def codes(report: dict, key: str = "causes") -> list[str]:
    return [c["code"] for c in report[key]]


HF = ["--backend", "hf", "--model", "tiny", "--tier", "2", "--max-new-tokens", "8"]


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """An hf run in this process, as this machine picks kernels and threads."""
    return detllm.run(backend="hf", model="tiny", tier=2, max_new_tokens=8, out=tmp_path_factory.mktemp("hf") / "native").out_dir


def child_run(out, **env_vars) -> None:
    """`detllm run` in a child process: these variables are read when torch loads."""
    proc = subprocess.run([sys.executable, "-m", "detllm", "run", *HF, "--out", str(out)],
                          env={**os.environ, **env_vars}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_threads_the_machine_chose_are_never_configuration(native, tmp_path):
    """No --threads on either side: torch's default here vs OMP_NUM_THREADS=1 (what another
    machine's core count does). Not CONFIG_MISMATCH: ENV evidence, or a PASS."""
    child_run(tmp_path / "one", OMP_NUM_THREADS="1")
    r = detllm.diff(native, tmp_path / "one").report
    validate(r, "report")
    found = codes(r) + codes(r, "info")
    assert "CONFIG_MISMATCH" not in found and found == ["ENV_MISMATCH"], found
    fields = {d["field"] for d in (r["causes"] or r["info"])[0]["evidence"]["differences"]}
    assert "determinism_applied.settings.threads.value (chosen by the machine)" in fields or os.cpu_count() == 1, fields


def test_torch_cpu_capability_is_recorded_and_leads_as_env(native, tmp_path):
    """One hf run as this machine picks its kernels, one with ATEN_CPU_CAPABILITY=default.
    Seen here: AVX512 vs DEFAULT, tokens equal, logprobs differ by up to ~3e-6."""
    child_run(tmp_path / "default", ATEN_CPU_CAPABILITY="default")
    kernels = [json.loads((d / "env.json").read_text())["kernels"]["torch_cpu_capability"] for d in (native, tmp_path / "default")]
    assert kernels[1] == "DEFAULT" and kernels[0] != "DEFAULT", kernels
    r = detllm.diff(native, tmp_path / "default").report
    validate(r, "report")
    listed = r["causes"] if r["status"] == "FAIL" else r["info"]
    assert codes(r, "causes" if r["status"] == "FAIL" else "info") == ["ENV_MISMATCH"], "never RUN_VARIANCE"
    fields = [d["field"] for d in listed[0]["evidence"]["differences"]]
    assert set(fields[:2]) == {"kernels.torch_cpu_capability", "env_vars.ATEN_CPU_CAPABILITY"}, fields
    if r["status"] == "FAIL":  # the kernels did move the numbers: say how much
        assert r["magnitude"]["label"] in ("tokens_equal_logprobs_differ", "tie_flip", "confident_flip")


def test_a_config_resaved_with_another_transformers_version_is_no_model_mismatch(tmp_path):
    """And a chat template added to tokenizer_config.json is no tokenizer difference: none is applied."""
    from detllm.models import local_folder, resolve_model

    folder = tmp_path / "tiny-copy"
    shutil.copytree(local_folder(resolve_model("tiny"), None), folder)
    a = detllm.run(backend="hf", model=str(folder), tier=2, max_new_tokens=6, out=tmp_path / "a").out_dir
    for name in ("generation_config.json", "config.json"):
        doc = json.loads((folder / name).read_text())
        doc["transformers_version"] = "9.99.0"  # what a re-save by a newer transformers changes
        (folder / name).write_text(json.dumps(doc, indent=4, sort_keys=True))
    tok = json.loads((folder / "tokenizer_config.json").read_text())
    tok["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # never applied to prompts
    (folder / "tokenizer_config.json").write_text(json.dumps(tok))
    b = detllm.run(backend="hf", model=str(folder), tier=2, max_new_tokens=6, out=tmp_path / "b").out_dir
    r = detllm.diff(a, b).report
    validate(r, "report")
    assert r["status"] == "PASS" and codes(r, "info") == [], "neither MODEL_MISMATCH nor TOKENIZER_MISMATCH"
    assert {"run_config.model.config_files_sha256", "run_config.model.chat_template_sha256"} <= {
        d["field"] for d in r["inert_differences"]}
    doc = json.loads((folder / "generation_config.json").read_text())
    doc["eos_token_id"] = 7  # a field that changes the computation is still a model difference
    (folder / "generation_config.json").write_text(json.dumps(doc))
    c = detllm.run(backend="hf", model=str(folder), tier=2, max_new_tokens=6, out=tmp_path / "c").out_dir
    assert "MODEL_MISMATCH" in codes(detllm.diff(a, c).report, "info") + codes(detllm.diff(a, c).report)


def test_llamacpp_runs_differing_only_in_batch_size(tmp_path):
    """Batch 1 vs batch 4 (slots, -np and -c follow it), the second from a copy of the GGUF at
    another path and another port: batch evidence only, never CONFIG or BACKEND."""
    from detllm.backends.llamacpp import resolve_gguf

    try:
        gguf = resolve_gguf("tiny")
        from detllm.backends.llamacpp import find_server

        find_server(None)
    except detllm.DetllmError as exc:  # pragma: no cover - only without the llama.cpp build
        pytest.skip(f"llama.cpp not available: {exc}")
    copy = tmp_path / "copy" / "model.gguf"
    copy.parent.mkdir()
    shutil.copy(gguf, copy)
    a = detllm.run(backend="llamacpp", model="tiny", tier=2, max_new_tokens=8, batch_size=1, out=tmp_path / "np1").out_dir
    b = detllm.run(backend="llamacpp", model=str(copy), tier=2, max_new_tokens=8, batch_size=4, out=tmp_path / "np4").out_dir
    envs = [json.loads((d / "env.json").read_text()) for d in (a, b)]
    assert "AVX2" in envs[0]["kernels"]["cpu_features"], "llama.cpp's CPU backend features are recorded as kernel facts"
    argv = [e["backend"]["argv"] for e in envs]
    assert argv[0] != argv[1], "-np, -c and -m differ in the server's argv"
    r = detllm.diff(a, b, tier=3).report  # logprobs across batch sizes too
    validate(r, "report")
    found = codes(r) + codes(r, "info")
    assert found == ["BATCH_VARIANCE"], found
    ev = (r["causes"] or r["info"])[0]["evidence"]
    assert {d["field"] for d in ev.get("derived", [])} >= {"settings.slots.value"}
