"""`detllm report --format issue`: the markdown for an engine's bug template. Unit tests on
the fake backend; one real test proves the raw llama.cpp call it prints reproduces the
recorded trace bit for bit (the real llama-server binary, the shared smollm2 runs)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import time
import urllib.request

import pytest

import detllm
from detllm.commands.report import render_path


@pytest.fixture(scope="module")
def fake_fail(tmp_path_factory):
    o = detllm.check(backend="fake", prompts=["alpha", "beta"], runs=2, tier=2, options={"diverge": "prompt=1,pos=2,run=1"},
                     out=tmp_path_factory.mktemp("issue") / "c")
    assert o.status == "FAIL"
    return o


def test_issue_has_verdict_divergence_env_and_reproduction(cli, fake_fail):
    r = cli("report", fake_fail.out_dir, "--format", "issue")
    assert r.exit_code == 0, r.output
    md = r.output
    d = fake_fail.report["first_divergence"]
    assert f"### [detllm] check FAIL {fake_fail.report['category']}: fake, prompt 1 diverges at generated token 2" in md
    assert f"id {d['left']['token_id']} {d['left']['token_text']!r}" in md and f"id {d['right']['token_id']}" in md
    for section in ("#### Describe the bug", "#### Your current environment", "#### Reproduce", "Determinism settings applied"):
        assert section in md
    assert "detllm replay pack.tar.gz" in md and "detllm pack [temp]/c -o pack.tar.gz" in md  # the folder is pytest's
    env = json.loads((fake_fail.out_dir / "env.json").read_text())
    assert f"Python: {env['python']['version']}" in md and env["cpu"]["model"] in md


def test_issue_keeps_secrets_redacted(fake_fail, tmp_path):
    """A pack from elsewhere may hold a secret its writer did not redact: the issue hides it anyway."""
    folder = tmp_path / "c"
    shutil.copytree(fake_fail.out_dir, folder)
    env = json.loads((folder / "env.json").read_text())
    secret = "hf_" + "a1B2c3D4e5F6g7H8i9J0"
    env["env_vars"].update({"HF_HOME": "/data", "HF_AUTH": "plain", "TORCH_X": f"https://user:{secret}@host"})
    env["backend"] = {**(env["backend"] or {}), "note": "x"}
    (folder / "env.json").write_text(json.dumps(env))
    md = render_path(folder, "issue")
    assert secret not in md and "plain" not in md
    assert "HF_HOME=/data" in md and "HF_AUTH=<redacted>" in md


def test_issue_of_a_run_and_of_a_bare_diff(cli, tmp_path):
    run = detllm.run(backend="fake", prompts=["alpha"], out=tmp_path / "r")
    md = render_path(run.out_dir, "issue")
    assert md.splitlines()[1] == "### [detllm] run RECORDED: fake"
    other = detllm.run(backend="fake", prompts=["alpha"], options={"diverge": "prompt=0,pos=1,run=0"}, out=tmp_path / "o")
    shutil.copy(run.out_dir / "trace.jsonl", tmp_path / "a.jsonl")
    r = cli("diff", tmp_path / "a.jsonl", other.out_dir / "trace.jsonl", "--out", tmp_path / "d")
    assert r.exit_code == 1, r.output
    md = render_path(tmp_path / "d", "issue")
    assert "#### Reproduce" in md and "(env.json of left is not at hand)" in md


def _code_block(md: str, after: str, lang: str) -> str:
    start = md.index(f"```{lang}\n", md.index(after)) + len(lang) + 4
    return md[start:md.index("\n```", start)]


@pytest.mark.engine
def test_raw_llamacpp_call_reproduces_the_trace(smollm2_sides, tmp_path):
    """Run exactly the llama-server command and /completion body the issue prints: same tokens, same logprobs."""
    from detllm.backends.llamacpp import find_server, free_port

    _, ll = smollm2_sides
    md = render_path(ll, "issue")
    assert md.startswith("<!-- llama.cpp's bug template")
    assert "llama.cpp version: version:" in md and "llama-server sha256:" in md
    server_line, curl = _code_block(md, "Raw llama.cpp call", "bash").split(" &\n", 1)
    argv = [os.path.expanduser(a) for a in shlex.split(server_line)]  # as a shell reads it: the model path is shown from ~
    assert argv[0] == "llama-server"
    argv[0] = str(find_server())
    port = free_port()
    argv[argv.index("--port") + 1] = str(port)
    body = shlex.split(curl.replace("\\\n", " "))[-1]
    srv = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline and srv.poll() is None, "llama-server did not start"
                time.sleep(0.3)
        req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=body.encode(), headers={"Content-Type": "application/json"})
        out = json.loads(urllib.request.urlopen(req, timeout=120).read())
    finally:
        srv.terminate()
        srv.wait(timeout=30)
    rec = json.loads((ll / "trace.jsonl").read_text().splitlines()[0])
    assert out["tokens"] == rec["token_ids"]
    assert [p["logprob"] for p in out["completion_probabilities"]] == rec["logprobs"]


@pytest.mark.parametrize("fmt", ["issue", "html"])
def test_report_formats_import_no_engine(fake_fail, fmt):
    """A maintainer renders a stranger's pack without torch, transformers or vLLM being imported."""
    import sys

    code = ("import sys\nfrom detllm.cli import main\nsys.argv = ['detllm', 'report', sys.argv[1], '--format', sys.argv[2]]\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
            "print(sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules), file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", code, str(fake_fail.out_dir), fmt], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == "[]"


def test_raw_call_seed_keys_a_repeated_prompt_by_its_occurrence(tmp_path):
    """The seed rule keys a request by (prompt id, occurrence): the raw call of the second copy of a
    prompt must use occurrence 1, as the run did."""
    from detllm.render.issue import _record

    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello\nWorld\nHello\n")
    detllm.run(backend="fake", prompts=prompts, temperature=0.8, max_new_tokens=4, out=tmp_path / "r")
    first, second = _record(tmp_path / "r", 0, 1, 0), _record(tmp_path / "r", 0, 1, 2)
    assert first[0]["prompt_id"] == second[0]["prompt_id"]
    assert (first[1], second[1]) == (0, 1)
