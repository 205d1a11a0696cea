"""Every script in benchmarks/ is started at its smallest size (tiny model, a few prompts and tokens, one
repeat), so an API change cannot break a benchmark silently. Each must exit 0 and print its first figure;
nothing here looks at a timing. The two vLLM scripts are only imported and argument-parsed: one vLLM
engine costs 16-25 s of import and 36-65 s of start on a 2-core CPU machine, over this test's whole
budget on its own; tests/test_openai_vllm.py and test_locate_vllm.py run the same paths on the session engine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"

# script[#mode]: (its smallest arguments, a line its output must hold: its first figure or verdict); "#mode" starts
# the same script a second way
SMOKE = {
    "bench_scale.py": (["--sizes", "2", "--tokens", "2"], "prompts/s"),
    "bench_diff.py": (["--prompts", "4", "--tokens", "10", "--repeat", "1", "--cases", "1"],
                      "first divergence (2, 7, 'token')"),
    "bench_verify.py": (["--prompts", "4", "--tokens", "8", "--repeats", "1", "--drift"],
                        "verdict re-derived from the trace: FAIL"),
    "bench_startup.py": (["--repeat", "1"], "detllm verify"),
    "bench_ray.py": (["--nodes", "2", "--prompts", "1", "--tokens", "2"], "driver_rss_mib"),
    "bench_fleet.py": (["--sleep", "0", "--prompts", "2", "--runs", "2", "--real", "0", "--profile", "--base", "HEAD", "--pairs", "1"],
                       "wall time, 8 x 2 vs 1 x 2"),
    "bench_check.py": (["--model", "tiny", "--runs", "2", "--vary-batch", "1", "--max-new-tokens", "2", "--repeat", "1",
                        "--threads", "1", "--decode-tokens", "2"], "[PASS]"),
    "bench_check_llamacpp.py": (["--model", "tiny", "--runs", "2", "--vary-batch", "1", "--max-new-tokens", "2",
                                 "--repeat", "1", "--threads", "1"], "[PASS]"),
    "bench_openai.py": (["--levels", "1", "--tokens", "2", "--slots", "1", "--rounds", "1", "--threads", "1"], "llama-server tiny"),
    "bench_fresh_process.py": (["--models", "tiny", "--max-new-tokens", "2", "--repeat", "1"], "extra cost of a fresh repeat"),
    "bench_locate.py": (["--model", "tiny", "--cases", "1"], "1/1 named"),
    # the capture overhead against a worktree of this commit, each locate a fresh process
    "bench_locate.py#cost": (["--model", "tiny", "--cost", "1", "--base", "HEAD"], "HEAD  re-runs without capture"),
    "bench_fleet.py#asyncio": (["--sleep", "0", "--prompts", "2", "--runs", "2", "--real", "0", "--stub", "asyncio"],
                               "wall time, 8 x 2 vs 1 x 2"),
    "bench_training_capture.py": (["--model", "tiny", "--pairs", "1", "--batch-size", "1", "--seq-len", "8", "--threads", "1",
                                   "--grouped", "--profile"], "taken apart"),
    "bench_batch_invariant.py": (["--model", "tiny", "--tokens", "2", "--batches", "1,2", "--repeat", "1", "--threads", "1"],
                                 "invariant"),
    # against this commit's own worktree: the comparison machinery, not a regression, is what is smoked here
    "bench_vs_base.py": (["HEAD", "bench_diff.py", "--pairs", "1", "--", "--prompts", "4", "--tokens", "10", "--repeat", "1",
                          "--cases", "1"], "HEAD/base"),
    "bench_vs_seed.py": (["--models", "tiny", "--pairs", "1", "--runs", "2", "--max-new-tokens", "2", "--api"],
                         "tiny detllm API (no typer)/0.1.1"),
}
IMPORT_ONLY = {"bench_check_vllm.py", "bench_locate_vllm.py"}  # why: the docstring above
HELPERS = {"_overhead.py"}  # imported by bench_check*.py, started with them
LLAMACPP = {"bench_check_llamacpp.py", "bench_openai.py"}


def _run(script: str, args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # this tree's detllm, whatever the venv's install points at
    return subprocess.run([sys.executable, str(BENCH / script), *args], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)


def test_every_benchmark_is_started_here():
    scripts = {p.name for p in BENCH.glob("*.py")}
    assert scripts == {k.split("#")[0] for k in SMOKE} | IMPORT_ONLY | HELPERS, \
        "a benchmark without a smoke entry (or an entry without a script)"


@pytest.mark.parametrize("script", sorted(IMPORT_ONLY))
def test_benchmark_imports_and_parses(script):
    proc = _run(script, ["--help"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage:" in proc.stdout


@pytest.mark.engine
@pytest.mark.parametrize("script", sorted(SMOKE))
def test_benchmark_runs_at_its_smallest_size(script):
    args, expect = SMOKE[script]
    script = script.split("#")[0]
    if script in LLAMACPP:
        from tests.conftest import llama_server_or_fail

        llama_server_or_fail()
    if "--base" in args or script == "bench_vs_base.py":
        if shutil.which("git") is None or not (REPO / ".git").exists():
            pytest.skip(f"{script} {' '.join(args)} needs a git checkout to make a worktree from")
    if script == "bench_vs_seed.py":
        seed = Path(os.environ.get("DETLLM_SEED_PYTHON") or Path.home() / ".cache/detllm/seed-venv/bin/python")
        if not seed.exists():
            pytest.skip(f"bench_vs_seed.py needs detllm 0.1.1 in a venv of its own at {seed} (see the script's docstring)")
    proc = _run(script, args)
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert expect in proc.stdout, proc.stdout[-3000:]
