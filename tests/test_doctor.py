"""`detllm doctor`: what works here and how to fix what does not. It must never download or
build anything, so these tests run it with no network, on this machine's real packages."""

from __future__ import annotations

import json

from detllm.commands.doctor import diagnose_machine, render_doctor


def test_doctor_json_names_every_backend(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = cli("doctor", "--json", env={"HF_HUB_OFFLINE": "1", "DETLLM_CACHE": str(tmp_path / "cache")})
    assert r.exit_code == 0, r.output
    found = json.loads(r.output)
    assert set(found["backends"]) >= {"hf", "vllm", "llamacpp", "fake"}
    for name, b in found["backends"].items():
        assert b["usable"] or (b["why"] and b["fix"]), name
    assert found["backends"]["fake"]["usable"] and found["backends"]["fake"]["max_tier"] >= 2
    assert found["torch"]["installed"] is True and isinstance(found["torch"]["cuda_available"], bool)
    assert found["artifacts"]["writable"] is True
    if found["backends"]["hf"]["usable"]:  # the built-in model is not built in this empty cache: not checked, not built
        assert found["backends"]["hf"]["max_tier"] is None and "not built yet" in found["backends"]["hf"]["tier_note"]
    assert not (tmp_path / "cache").exists(), "doctor built or downloaded something"
    assert not (tmp_path / "artifacts").exists(), "doctor wrote something"


def test_doctor_names_the_fix_for_a_missing_llama_server(cli, tmp_path):
    r = cli("doctor", env={"DETLLM_LLAMA_BIN": str(tmp_path / "nowhere")})
    assert r.exit_code == 0, r.output
    line = next(x for x in r.output.splitlines() if x.startswith("llamacpp"))
    assert "unavailable" in line and "scripts/build_llamacpp.sh" in line


def test_unwritable_artifacts_folder_is_reported(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    found = diagnose_machine(blocked / "artifacts")
    assert found["artifacts"]["writable"] is False and "--out" in found["artifacts"]["fix"]
    assert "NOT writable" in render_doctor(found)
