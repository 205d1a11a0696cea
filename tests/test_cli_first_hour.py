"""The small things a first hour trips on (issue 21): a .json prompt array, a path option given an
option, --backend naming openai, flags without a type in --help, and the progress bar counting
prompt runs from the start of the run. Each test makes the real thing happen through the CLI."""

from __future__ import annotations

import io
import json
import re

import pytest

from detllm.backends.registry import BACKENDS


def test_a_json_prompt_array_is_one_prompt_per_item(cli, tmp_path):
    p = tmp_path / "arr.json"
    p.write_text(json.dumps(["What is 2+2?", {"prompt": "Name a color."}]))
    res = cli("run", "--backend", "fake", "--prompts", p, "--max-new-tokens", "2", "--out", tmp_path / "r", "--no-progress")
    assert res.exit_code == 0, res.output
    cfg = json.loads((tmp_path / "r" / "run_config.json").read_text())
    assert cfg["prompts"]["count"] == 2, cfg["prompts"]  # before: 1, the literal text '["What is 2+2?", ...]'


@pytest.mark.parametrize("content, needle", [
    ('{"prompt": "one"}', "holds a JSON array of prompts, got a JSON dict"),
    ('["ok", 3]', "item 1: expected an object"),
    ('["unclosed"', "not valid JSON"),
])
def test_a_json_prompt_file_that_is_no_array_of_prompts_is_refused(cli, tmp_path, content, needle):
    p = tmp_path / "bad.json"
    p.write_text(content)
    res = cli("check", "--backend", "fake", "--prompts", p, "--out", tmp_path / "r")
    assert res.exit_code == 2 and needle in res.stderr, res.output
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "r").exists()


@pytest.mark.parametrize("args, flag, value", [
    (["check", "--html", "--json"], "--html", "--json"),
    (["check", "--out=--force"], "--out", "--force"),
    (["report", "--in", "--json"], "--in", "--json"),
])
def test_a_path_option_given_an_option_is_refused(cli, tmp_path, monkeypatch, args, flag, value):
    monkeypatch.chdir(tmp_path)
    res = cli(*args)
    assert res.exit_code == 2, res.output
    assert res.stderr.strip() == (f"detllm: error: {flag} needs a path, got the option {value!r} "
                                  f"(give {flag} its path; for a file named {value}, write ./{value})")
    assert list(tmp_path.iterdir()) == []  # before: an HTML file named --json (and a run folder) in the cwd


def test_dot_slash_still_names_a_file_that_starts_with_dashes(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = cli("check", "--backend", "fake", "--max-new-tokens", "2", "--out", tmp_path / "r", "--html", "./--json", "--no-progress")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "--json").is_file()


def test_backend_help_and_docs_name_every_backend(cli):
    from pathlib import Path

    help_text = " ".join(cli("check", "--help", env={"COLUMNS": "300"}).stdout.split())
    row = next(ln for ln in (Path(__file__).resolve().parent.parent / "docs" / "cli.md").read_text().splitlines()
               if ln.startswith("| `--backend/-b`"))
    for name in BACKENDS:
        assert re.search(rf"\b{name}\b", help_text), f"--backend help omits {name}"
        assert f"`{name}`" in row, f"docs/cli.md's --backend row omits {name}"


@pytest.mark.parametrize("args", [["check", "--help"], ["--help"], ["report", "--help"], ["models", "export", "--help"]])
def test_flags_show_no_value_type_in_help(cli, args):
    out = cli(*args, env={"COLUMNS": "300"}).stdout
    assert "--help" in out
    assert "<bool>" not in out, [ln for ln in out.splitlines() if "<bool>" in ln][:3]
    if args[0] == "check":
        assert "<int>" in out  # options that take a value still show their type


def test_progress_counts_prompt_runs_and_its_rate_from_the_start(monkeypatch):
    """4 prompts x 4 runs: '1/16 prompt runs' (before: '1/16 prompts'), and the rate counts the time
    the first prompt took (before: the clock started at the first update: ~10^7 tokens/s)."""
    from rich.console import Console

    from detllm.cli import shell

    clock = iter([100.0, 102.0])
    monkeypatch.setattr("time.monotonic", lambda: next(clock))
    monkeypatch.setattr(shell.sys, "stderr", type("Tty", (io.StringIO,), {"isatty": lambda self: True})())
    bar = shell.ProgressBar(True)
    with bar as update:
        update(1, 16, 8)  # the first prompt run: 8 tokens, 2 s after the run began
        con = Console(record=True, width=120, file=io.StringIO())
        con.print(bar.bar.get_renderable())
    text = con.export_text()
    assert "1/16 prompt runs" in text and "4.0 tokens/s" in text, text


def test_report_format_junit_points_to_the_junit_option(cli, tmp_path):
    run = tmp_path / "r"
    assert cli("run", "--backend", "fake", "--max-new-tokens", "2", "--out", run, "--no-progress").exit_code == 0
    res = cli("report", run, "--format", "junit")
    assert res.exit_code == 2
    assert res.stderr.strip() == ("detllm: error: --format must be one of txt, json, md, html, issue, kld, got 'junit' "
                                  "(for JUnit XML pass --junit FILE)"), res.stderr
    ok = cli("report", run, "--junit", tmp_path / "j.xml")  # and the option it names does write JUnit
    assert ok.exit_code == 0 and (tmp_path / "j.xml").read_text().lstrip().startswith("<?xml")


def _mode(path) -> int:
    return path.stat().st_mode & 0o777


def test_a_pack_is_written_like_any_file_asked_for(cli, tmp_path):
    """0666 & ~umask (0644 under the usual 022), not mkstemp's 0600 (before)."""
    import os

    run = tmp_path / "r"
    assert cli("run", "--backend", "fake", "--max-new-tokens", "2", "--out", run, "--no-progress").exit_code == 0
    old = os.umask(0o022)
    try:
        res = cli("pack", run, "-o", tmp_path / "p.tar.gz")
    finally:
        os.umask(old)
    assert res.exit_code == 0, res.output
    assert _mode(tmp_path / "p.tar.gz") == 0o644


def test_an_exported_model_is_written_like_any_file_asked_for(cli, tmp_path, monkeypatch):
    """The cache may hold model.safetensors as 0600 (its writer's choice): the export is 0644 under
    umask 022 all the same (before: copy2 carried the 0600 over)."""
    import os

    from detllm.models import builtin_path

    cache = tmp_path / "cache"
    monkeypatch.setenv("DETLLM_CACHE", str(cache))
    weights = builtin_path("tiny", "hf") / "model.safetensors"
    weights.chmod(0o600)
    old = os.umask(0o022)
    try:
        res = cli("models", "export", "tiny", tmp_path / "out")
    finally:
        os.umask(old)
    assert res.exit_code == 0, res.output
    files = sorted((tmp_path / "out").iterdir())
    assert "model.safetensors" in [f.name for f in files]
    assert {f.name: _mode(f) for f in files} == {f.name: 0o644 for f in files}


def test_a_hub_id_with_the_hub_unreachable_fails_at_once(cli, tmp_path, monkeypatch):
    """A hub id not in the hub cache, with the hub's endpoint refusing connections (a closed loopback
    port): refused in one line naming why, before the hub client's retries (about 50 s offline)."""
    import huggingface_hub.constants as hub

    from detllm.backends.llamacpp import free_port

    endpoint = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setattr(hub, "ENDPOINT", endpoint)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    for var in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    res = cli("run", "--backend", "hf", "--model", "nobody/no-such-model", "--out", tmp_path / "r", "--no-progress")
    assert res.exit_code == 2, res.output
    assert ("model 'nobody/no-such-model' is not in the hub cache and the hub cannot be reached: cannot connect to "
            f"127.0.0.1:{endpoint.rsplit(':', 1)[1]}") in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "r").exists()
