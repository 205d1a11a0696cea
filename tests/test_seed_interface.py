"""The seed's interface, verbatim: the README of detllm 0.1 on PyPI (the project this tool is
named after) is the spec. Its commands and Python examples run unchanged, with the model
swapped to the built-in `tiny` (real transformers); the seed's flags behave as it documents
(or say plainly why they cannot), and its older on-disk layout is refused in one line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import detllm
from detllm.core.errors import UsageError

from .conftest import assert_valid_run

SEED_PROMPT = "Choose one: A or B. Answer with a single letter."


# ------------------------------------------------------------------ the README, verbatim


def test_readme_quickstart_cli(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # detllm check --backend hf --model <model_id> --prompt "..." --tier 1 --runs 5 --batch-size 1
    r = cli("check", "--backend", "hf", "--model", "tiny", "--prompt", SEED_PROMPT, "--tier", "1", "--runs", "5", "--batch-size", "1")
    assert r.exit_code == 0, r.output
    (folder,) = (tmp_path / "artifacts").iterdir()
    report = assert_valid_run(folder)
    assert report["status"] == "PASS" and report["summary"]["runs"] == 5 and report["summary"]["prompts"] == 1
    trace = [json.loads(x) for x in (folder / "trace.jsonl").read_text().splitlines()]
    assert {t["prompt_text"] for t in trace} == {SEED_PROMPT}


def test_readme_python_api(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    from detllm import check, run

    run(
        backend="hf",
        model="tiny",
        prompts=["Hello"],
        tier=1,
        out_dir="artifacts/run1",
    )

    report = check(
        backend="hf",
        model="tiny",
        prompts=["Hello"],
        runs=3,
        batch_size=1,
        out_dir="artifacts/check1",
    )

    print(report.status, report.category)
    assert capsys.readouterr().out == "PASS PASS\n"
    assert report.out_dir == Path("artifacts/check1")
    assert report.details["summary"]["runs"] == 3 and report.details["first_divergence"] is None
    assert json.loads(Path("artifacts/run1/run_config.json").read_text())["prompts"] == {
        "source": "inline", "count": 1, "sha256": detllm.core.prompts.inline_prompts(["Hello"]).sha256}
    assert_valid_run(Path("artifacts/check1"))


def test_readme_cli_commands_each_run(cli, tmp_path, monkeypatch):
    """The README's CLI list: env, run, check, diff, report."""
    monkeypatch.chdir(tmp_path)
    assert cli("env").exit_code == 0
    assert cli("run", "--backend", "fake", "--model", "tiny", "--prompt", "Hello", "--out", "a").exit_code == 0
    assert cli("check", "--backend", "fake", "--model", "tiny", "--prompt", "Hello", "--out", "b").exit_code == 0
    r = cli("diff", "--left", "a", "--right", "b::run_1")
    assert r.exit_code == 0, r.output
    r = cli("report", "--in", "b/report.json", "--out", "report.txt")
    assert r.exit_code == 0, r.output
    assert Path("report.txt").read_text().startswith("detllm check: PASS")


def test_issue_check_with_vary_batch_api(tmp_path):
    o = detllm.check(backend="fake", model="tiny", prompts=["Hello", "World"], runs=3, batch_size=1, vary_batch=[1, 2, 8],
                     out_dir=tmp_path / "c")
    assert o.status == "PASS" and o.details["summary"]["batch_sizes"] == [1, 2, 8]


# ------------------------------------------------------------------ the seed's flags


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two fake runs that differ at one token of prompt 0 (run 0 vs run 1 of one check)."""
    tmp = tmp_path_factory.mktemp("seed")
    a = detllm.run(backend="fake", prompts=["alpha", "beta"], out=tmp / "a").out_dir
    b = detllm.run(backend="fake", prompts=["alpha", "beta"], options={"diverge": "prompt=0,pos=3,run=0"}, out=tmp / "b").out_dir
    return a, b


def test_prompt_file_jsonl_takes_objects_and_strings(cli, tmp_path):
    pf = tmp_path / "prompts.txt"  # the seed's --prompt-file is JSONL whatever the suffix
    pf.write_text('{"prompt": "first"}\n"second"\n\n{"text": "third"}\n')
    r = cli("run", "-b", "fake", "--prompt-file", pf, "--out", tmp_path / "r")
    assert r.exit_code == 0, r.output
    texts = [json.loads(x)["prompt_text"] for x in (tmp_path / "r" / "trace.jsonl").read_text().splitlines()]
    assert texts == ["first", "second", "third"]


def test_repeatable_prompt(cli, tmp_path):
    r = cli("run", "-b", "fake", "--prompt", "one", "--prompt", "two", "--out", tmp_path / "r")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "r" / "run_config.json").read_text())["prompts"]["count"] == 2


@pytest.mark.parametrize("args", [("--prompt", "x", "--prompts", "p.jsonl"), ("--prompt", "x", "--prompt-file", "p.jsonl"),
                                  ("--prompt", "")])
def test_prompt_sources_conflict_or_empty(cli, tmp_path, args):
    r = cli("run", "-b", "fake", *args, "--out", tmp_path / "r")
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "Traceback" not in r.output
    assert not (tmp_path / "r").exists()


def test_redact_env_and_redact_env_var(cli, tmp_path):
    env = {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "1"}
    r = cli("run", "-b", "fake", "--prompt", "x", "--redact-env-var", "OMP_NUM_THREADS", "--validate-schema", "--out", tmp_path / "one", env=env)
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "one" / "env.json").read_text())
    assert doc["env_vars"]["OMP_NUM_THREADS"] == "<redacted>" and doc["env_vars"]["MKL_NUM_THREADS"] == "1"
    r = cli("check", "-b", "fake", "--prompt", "x", "--redact-env", "--out", tmp_path / "all", env=env)
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "all" / "env.json").read_text())
    assert doc["env_vars"] and set(doc["env_vars"].values()) == {"<redacted>"} and doc["volatile"]["hostname"] == "<redacted>"


def test_env_out_writes_a_valid_env_json(cli, tmp_path):
    r = cli("env", "--out", tmp_path / "sub" / "env.json", "--redact-env", "--validate-schema")
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "sub" / "env.json").read_text())
    detllm.runfolder.artifacts.validate(doc, "env")
    assert doc["volatile"]["hostname"] == "<redacted>"
    assert cli("env", "--out", tmp_path).exit_code == 2  # a folder is not a file


def test_api_kwargs_redact_and_validate_schema(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    o = detllm.run(backend="fake", prompts=["x"], out_dir=tmp_path / "r", redact=False, redact_env_vars=["OMP_NUM_THREADS"],
                   validate_schema=False)
    doc = json.loads((o.out_dir / "env.json").read_text())
    assert doc["env_vars"]["OMP_NUM_THREADS"] == "<redacted>"
    with pytest.raises(UsageError, match="different folders"):
        detllm.run(backend="fake", prompts=["x"], out=tmp_path / "a", out_dir=tmp_path / "b")
    with pytest.raises(UsageError, match="list of strings or a file"):
        detllm.run(backend="fake", prompts=42, out=tmp_path / "c")
    with pytest.raises(UsageError, match="does not exist") as err:
        detllm.run(backend="fake", prompts="Hello", out=tmp_path / "c")
    assert "pass a list" in err.value.one_line() and not (tmp_path / "c").exists()


def test_top_k_is_the_sampling_filter_in_cli_and_api(cli, tmp_path):
    o = detllm.run(backend="fake", prompts=["x"], top_k=7, logprobs=3, out=tmp_path / "api")
    cfg = json.loads((o.out_dir / "run_config.json").read_text())["config"]
    assert cfg["decoding"]["top_k"] == 7 and cfg["logprobs"] == 3
    r = cli("run", "-b", "fake", "--prompt", "x", "--top-k", "7", "--logprobs", "3", "--out", tmp_path / "cli")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "cli" / "run_config.json").read_text())["config"] == cfg
    rec = json.loads((tmp_path / "cli" / "trace.jsonl").read_text().splitlines()[0])
    assert all(len(step) == 3 for step in rec["top_logprobs"])


def test_tokenizer_revision(cli, tmp_path):
    r = cli("run", "-b", "fake", "--prompt", "x", "--revision", "main", "--tokenizer-revision", "v2", "--out", tmp_path / "r")
    assert r.exit_code == 2 and "--tokenizer-revision" in r.output and not (tmp_path / "r").exists()
    r = cli("run", "-b", "fake", "--prompt", "x", "--tokenizer-revision", "v2", "--out", tmp_path / "r")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "r" / "run_config.json").read_text())["config"]["revision"] == "v2"


# ------------------------------------------------------------------ diff --left/--right, report --in


def test_diff_left_right_trace_file_of_a_run_folder_is_the_folder(cli, two_runs):
    a, b = two_runs
    r = cli("diff", "--left", a / "trace.jsonl", "--right", b / "trace.jsonl", "--json")
    assert r.exit_code == 1, r.output
    rep = json.loads(r.output)
    assert rep["summary"]["left"]["backend"] == "fake"  # read as a folder: every cause can be known
    assert rep["category"] == "CONFIG_MISMATCH"  # the diverge option differs between the two runs


def test_diff_bare_trace_files(cli, two_runs, tmp_path):
    a, b = two_runs
    shutil.copy(a / "trace.jsonl", tmp_path / "left.jsonl")
    shutil.copy(b / "trace.jsonl", tmp_path / "right.jsonl")
    r = cli("diff", "--left", tmp_path / "left.jsonl", "--right", tmp_path / "right.jsonl", "--out", tmp_path / "d")
    assert r.exit_code == 1, r.output
    rep = json.loads((tmp_path / "d" / "report.json").read_text())
    assert rep["summary"]["bare_traces"] is True and rep["first_divergence"]["token_index"] == 3
    assert rep["category"] == "RUN_VARIANCE"
    assert rep["causes"][0]["evidence"]["recorded_differences"].startswith("unknown: bare trace files")
    assert "unknown (bare trace file)" in r.output
    same = cli("diff", "--left", tmp_path / "left.jsonl", "--right", a / "trace.jsonl")
    assert same.exit_code == 0, same.output


def test_diff_sides_given_twice_or_not_at_all(cli, two_runs):
    a, b = two_runs
    for args in (("--left", a), (a, "--left", a, "--right", b), ()):
        r = cli("diff", *args)
        assert r.exit_code == 2 and "Traceback" not in r.output


def test_report_in_out_and_format_from_suffix(cli, two_runs, tmp_path):
    a, _ = two_runs
    r = cli("report", "--in", a / "report.json", "--out", tmp_path / "r.md")
    assert r.exit_code == 0 and r.output == ""
    assert (tmp_path / "r.md").read_text().startswith("# detllm run")
    assert cli("report", a, "--in", a).exit_code == 2
    assert cli("report", a, "--format", "pdf").exit_code == 2


# ------------------------------------------------------------------ the seed's on-disk layout is out of scope


@pytest.fixture
def seed_folder(tmp_path):
    """What `detllm check` of detllm 0.1 writes (its cli/main.py): traces/run_N.jsonl rows with
    a `scores` field, and artifacts with schema_version "1.0"."""
    f = tmp_path / "artifacts" / "check"
    (f / "traces").mkdir(parents=True)
    head = {"schema_version": "1.0", "detllm_version": "0.1.1"}
    (f / "run_config.json").write_text(json.dumps({**head, "artifact_type": "run_config", "backend": "hf", "model": "distilgpt2"}))
    (f / "report.json").write_text(json.dumps({**head, "artifact_type": "report", "status": "PASS", "category": "PASS", "details": {}}))
    row = {"prompt_id": "ab", "input_token_ids": [1, 2], "generated_token_ids": [3, 4], "scores": None, "tokenizer_id": "distilgpt2"}
    (f / "traces" / "run_0.jsonl").write_text(json.dumps(row) + "\n")
    return f


def test_seed_layout_refused_in_one_line(cli, seed_folder, two_runs):
    a, _ = two_runs
    for args in (("report", seed_folder), ("report", "--in", seed_folder / "report.json"), ("diff", seed_folder, a),
                 ("verify", seed_folder), ("replay", seed_folder),
                 ("diff", "--left", seed_folder / "traces" / "run_0.jsonl", "--right", a / "trace.jsonl")):
        r = cli(*args)
        assert r.exit_code == 5, (args, r.output)
        assert r.output.count("\n") == 1 and "seed detllm 0.1" in r.output and "out of scope" in r.output


# ------------------------------------------------------------------ help and progress


def test_help_lists_exit_codes_once(cli):
    top = cli("--help").output
    assert top.count("Exit codes") == 1 and "8 backend error" in top
    for cmd in ("check", "run", "diff", "report", "replay"):
        assert "Exit codes" not in cli(cmd, "--help").output, cmd


def test_progress_only_on_a_terminal(tmp_path):
    """Through a pseudo-terminal, stderr shows prompts done/total and tokens/s; through a pipe, nothing."""
    import pty

    cmd = [sys.executable, "-m", "detllm", "check", "-b", "fake", "--runs", "3"]
    piped = subprocess.run(cmd + ["--out", str(tmp_path / "p")], capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0 and piped.stderr == ""
    leader, follower = pty.openpty()
    proc = subprocess.run(cmd + ["--out", str(tmp_path / "t")], stdout=subprocess.PIPE, stderr=follower, timeout=120,
                          env={**os.environ, "COLUMNS": "120", "TERM": "xterm"})
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    os.close(leader)
    assert proc.returncode == 0
    text = seen.decode(errors="replace")
    assert "/12" in text and "prompt runs" in text, text[-500:]
