"""Every bad input: one line on stderr, a documented non-zero exit code, nothing written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

BAD = [
    (["--tier", "4"], 2, "--tier must be 0, 1, 2 or 3"),
    (["--tier", "-1"], 2, "--tier must be 0, 1, 2 or 3"),
    (["--runs", "1"], 2, "check needs --runs of at least 2"),
    (["--batch-size", "0"], 2, "--batch-size must be in [1, 4096], got 0"),
    (["--vary-batch", "1,0"], 2, "--vary-batch sizes must be in [1, 4096], got 0"),
    (["--vary-batch", "1,two"], 2, "--vary-batch expects comma-separated integers"),
    (["--max-new-tokens", "0"], 2, "--max-new-tokens must be in [1, 1000000], got 0"),
    (["--backend", "hff"], 2, "unknown backend 'hff' (did you mean 'hf'?)"),
    (["--backend", "vllmm"], 2, "did you mean 'vllm'?"),
    (["--model", "./no/such/model"], 2, "model path './no/such/model' does not exist"),
    (["--model", "tinyy"], 2, "unknown model 'tinyy'"),
    (["--mode", "lenient"], 2, "--mode must be strict or best-effort"),
    (["--dtype", "fp8"], 2, "--dtype must be one of"),
    (["--opt", "novalue"], 2, "--opt expects key=value"),
    (["--backend", "fake", "--opt", "diverg=prompt=0,pos=1"], 2, "unknown --opt 'diverg' for backend 'fake' (did you mean 'diverge'?)"),
    (["--backend", "fake", "--opt", "max_tier=two"], 2, "--opt max_tier expects int"),
    (["--temperature", "-1"], 2, "--temperature must be in [0, 100], got -1.0"),
    (["--top-p", "0"], 2, "--top-p must be in (0, 1]"),
    (["--logprobs", "0"], 2, "--logprobs must be in [1, 100], got 0"),
    # non-finite floats: refused before anything runs (issue 11), never a schema error at write time
    (["--temperature", "nan"], 2, "--temperature must be a finite number in [0, 100], got nan"),
    (["--temperature", "inf"], 2, "--temperature must be a finite number in [0, 100], got inf"),
    (["--top-p", "nan"], 2, "--top-p must be a finite number in (0, 1], got nan"),
    (["--atol", "nan"], 2, "--atol must be a finite number in [0, 1000], got nan"),
    (["--atol", "-inf"], 2, "--atol must be a finite number in [0, 1000], got -inf"),
    # one seed range for every backend (config.SEED_MAX), and huge integers
    (["--seed", "4294967296"], 2, "--seed must be in [0, 4294967295], got 4294967296"),
    (["--seed", "-1"], 2, "--seed must be in [0, 4294967295], got -1"),
    (["--max-new-tokens", "100000000000000000000"], 2, "--max-new-tokens must be in [1, 1000000]"),
    (["--runs", "99999999999999999999999"], 2, "--runs must be in [1, 1000]"),
    (["--top-k", "-1"], 2, "--top-k must be in [0, 1000000], got -1"),
    (["--threads", "0"], 2, "--threads must be in [1, 1024], got 0"),
    # sloppy lists
    (["--vary-batch", "1,,2"], 2, "--vary-batch expects comma-separated integers like 1,2,8, got '1,,2' (an empty item)"),
    (["--vary-batch", ","], 2, "(an empty item)"),
    (["--vary-batch", ""], 2, "(an empty item)"),
    (["--vary-batch", "1,2,2"], 2, "--vary-batch lists a size twice: '1,2,2'"),
    # backend options declare their ranges (config.Range in each Options dataclass)
    (["--backend", "fake", "--opt", "max_tier=7"], 2, "--opt max_tier must be in [0, 3], got 7"),
    (["--backend", "fake", "--opt", "batch_drift=nan"], 2, "--opt batch_drift must be a finite number in [-100, 100], got nan"),
    (["--backend", "llamacpp", "--opt", "port=99999"], 2, "--opt port must be in [1, 65535], got 99999"),
    (["--backend", "llamacpp", "--opt", "request_timeout=inf"], 2, "--opt request_timeout must be a finite number in (0, 86400], got inf"),
    (["--backend", "llamacpp", "--opt", "startup_timeout=0"], 2, "--opt startup_timeout must be in (0, 86400], got 0.0"),
    (["--backend", "vllm", "--opt", "gpu_memory_utilization=1.5"], 2, "--opt gpu_memory_utilization must be in (0, 1], got 1.5"),
]


@pytest.mark.parametrize("args,code,message", BAD, ids=[" ".join(a) for a, _, _ in BAD])
def test_bad_flag(cli, tmp_path, args, code, message):
    out = tmp_path / "out"
    r = cli("check", *args, "--out", out)
    assert r.exit_code == code, r.output
    assert message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.output
    assert not out.exists()


def test_device_cuda_without_cuda(cli, tmp_path):
    out = tmp_path / "out"
    r = cli("check", "--device", "cuda", "--out", out)
    assert r.exit_code == 4
    assert "CUDA is not available" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("content,message", [
    (None, "does not exist"),
    (b"", "holds no prompts"),
    (b'{"prompt": "ok"}\n{"prompt": \n', "line 2: not valid JSON"),
    (b'{"text": ""}\n', "line 1: expected an object with a non-empty"),
    (b"\xff\xfe\x00bad", "cannot be read as UTF-8"),
])
def test_bad_prompt_file(cli, tmp_path, content, message):
    p = tmp_path / "prompts.jsonl"
    if content is not None:
        p.write_bytes(content)
    out = tmp_path / "out"
    r = cli("check", "--backend", "fake", "--prompts", p, "--out", out)
    assert r.exit_code == 2 and message in r.stderr, r.output
    assert len(r.stderr.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_prompt_file(cli, tmp_path):
    p = tmp_path / "p.txt"
    p.write_text("hello\n")
    p.chmod(0)
    r = cli("check", "--backend", "fake", "--prompts", p, "--out", tmp_path / "out")
    assert r.exit_code == 2 and "cannot be read" in r.stderr


def test_non_detllm_out_is_refused_without_force(cli, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    r = cli("check", "--backend", "fake", "--out", out)
    assert r.exit_code == 2 and "not a detllm run folder" in r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["thesis.tex"]
    r = cli("check", "--backend", "fake", "--out", out, "--force")
    assert r.exit_code == 0
    assert (out / "thesis.tex").read_text() == "precious"


def test_unknown_builtin_model_export(cli, tmp_path):
    r = cli("models", "export", "smolm2-135m", tmp_path / "x")
    assert r.exit_code == 2 and "did you mean 'smollm2-135m'?" in r.stderr
    assert not (tmp_path / "x").exists()


def test_report_on_a_non_detllm_folder(cli, tmp_path):
    r = cli("report", tmp_path)
    assert r.exit_code == 5 and "has no report.json" in r.stderr


def test_report_with_unknown_schema_version(cli, tmp_path):
    import detllm
    from detllm.runfolder.schema_io import SCHEMA_VERSION

    detllm.check(backend="fake", out=tmp_path / "r")
    p = tmp_path / "r" / "report.json"
    p.write_text(p.read_text().replace(f'"schema_version": "{SCHEMA_VERSION}"', '"schema_version": "99"'))
    r = cli("report", tmp_path / "r")
    assert r.exit_code == 5 and "schema_version '99' is not one this detllm reads" in r.stderr


@pytest.mark.engine
def test_hub_id_that_cannot_be_fetched_is_one_line(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "detllm", "check", "--model", "someorg/not-cached", "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("detllm: error: model 'someorg/not-cached' is not in the hub cache and the hub cannot be reached")
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists()


@pytest.mark.engine
def test_prompt_longer_than_the_context_is_refused(cli, tmp_path):
    p = tmp_path / "long.jsonl"
    p.write_text('{"prompt": "' + "word " * 200 + '"}\n')
    out = tmp_path / "out"
    r = cli("check", "--prompts", p, "--out", out)
    assert r.exit_code == 2
    assert "exceeds the model's context of 512 tokens" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_check_fits():
    from detllm.core.errors import UsageError
    from detllm.pipeline.runner import check_fits

    check_fits([(1, 2, 3)], 5, 8)
    check_fits([(1,) * 100], 5, None)
    with pytest.raises(UsageError, match="prompt 1 has 4 tokens; with --max-new-tokens 5 it exceeds the model's context of 8"):
        check_fits([(1,), (1, 2, 3, 4)], 5, 8)


def test_force_never_overwrites_a_file_of_the_users(cli, tmp_path):
    out = tmp_path / "mine"
    (out / "diffs").mkdir(parents=True)
    (out / "diffs" / "patch.diff").write_text("precious")
    (out / "report.md").write_text("my report")
    r = cli("check", "--backend", "fake", "--out", out, "--force")
    assert r.exit_code == 2 and "holds 'report.md', which detllm would overwrite" in r.stderr
    assert (out / "report.md").read_text() == "my report" and (out / "diffs" / "patch.diff").read_text() == "precious"


@pytest.mark.parametrize("where", ["file/sub", "file"])
def test_out_under_a_file_is_one_line(cli, tmp_path, where):
    (tmp_path / "file").write_text("x")
    r = cli("check", "--backend", "fake", "--out", tmp_path / where)
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output


@pytest.mark.parametrize("target", ["dir", "file/x.xml"])
def test_bad_junit_path_is_refused_before_the_run(cli, tmp_path, target):
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("x")
    out = tmp_path / "run"
    r = cli("check", "--backend", "fake", "--junit", tmp_path / target, "--out", out)
    assert r.exit_code == 2 and "--junit" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_diff_out_never_destroys_a_run_folder(cli, tmp_path):
    import detllm

    a = detllm.check(backend="fake", out=tmp_path / "a").out_dir
    victim = detllm.check(backend="fake", out=tmp_path / "victim").out_dir
    before = sorted(p.name for p in victim.iterdir())
    for extra in ([], ["--force"]):
        r = cli("diff", a, a, "--out", victim, *extra)
        assert r.exit_code == 2 and "is a run folder" in r.stderr
    assert sorted(p.name for p in victim.iterdir()) == before
    r = cli("diff", a, a, "--out", tmp_path / "d")
    assert r.exit_code == 0
    assert cli("diff", a, a, "--out", tmp_path / "d").exit_code == 0, "an earlier diff folder is re-used"
    r = cli("check", "--backend", "fake", "--out", tmp_path / "d")
    assert r.exit_code == 2 and "is a diff folder" in r.stderr


# ------------------------------------------------------------------ the console entry point (issue 11)

def _detllm(*args, env=None, stdout=subprocess.PIPE, cwd=None):
    return subprocess.run([sys.executable, "-m", "detllm", *map(str, args)], stdout=stdout, stderr=subprocess.PIPE,
                          text=True, env={**os.environ, **(env or {})}, cwd=cwd, timeout=120)


@pytest.mark.parametrize("args", [["check", "--out", ""], ["check", "--out="], ["report", ""], ["verify", ""],
                                  ["check", "--prompts", ""]])
def test_an_empty_path_is_a_usage_error(tmp_path, args):
    r = _detllm(*args, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("detllm: error: ") and "is empty" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == [], "nothing written into the current folder"


@pytest.mark.parametrize("env", [{"CI": "1"}, {"CI": ""}], ids=["CI", "not-CI"])
def test_a_bad_option_in_a_real_process_is_one_line(tmp_path, env):
    """The console entry point: the parser's errors are one line in the house form, CI or not."""
    r = _detllm("check", "--qqqqqq", env=env, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr == "detllm: error: `detllm check` has no option --qqqqqq (see `detllm check --help`)\n"
    r = _detllm("check", "--tier", "x", env=env, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr == "detllm: error: --tier must be an integer in [0, 3], got 'x'\n", r.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["report", "check"])
def test_a_closed_pipe_is_a_silent_exit(tmp_path, command):
    import detllm

    run = detllm.check(backend="fake", out=tmp_path / "r").out_dir
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before detllm writes a byte: every write is EPIPE
    try:
        args = ["report", run] if command == "report" else ["check", "-b", "fake", "--out", tmp_path / "c", "--no-progress"]
        r = _detllm(*args, stdout=write_end)
    finally:
        os.close(write_end)
    assert r.stderr == "", r.stderr
    assert r.returncode == 141  # 128 + SIGPIPE, as for any program whose reader went away


def test_non_finite_atol_in_diff_is_refused_before_comparing(cli, tmp_path):
    import detllm

    a = detllm.check(backend="fake", out=tmp_path / "a").out_dir
    for bad in ("nan", "inf", "-1"):
        r = cli("diff", a, a, "--atol", bad)
        assert r.exit_code == 2 and "--atol must be" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output


def test_api_refuses_non_finite_and_huge_numbers(tmp_path):
    import detllm
    from detllm.core.errors import UsageError

    for bad in ({"temperature": float("nan")}, {"seed": 2**64}, {"atol": float("inf")}, {"top_k": 1.5},
                {"vary_batch": (1, 2, 2)}):
        with pytest.raises(UsageError):
            detllm.check(backend="fake", out=tmp_path / "x", **bad)
        assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------ a failure after the first write; two writers (issue 11)

@pytest.fixture
def failing_seal(monkeypatch):
    """The disk fills up while the folder is sealed: the last write of a run fails."""
    import errno

    from detllm.runfolder import integrity  # the seal, the last write of outcome.write_report (imported there when it writes)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "manifest.json")

    monkeypatch.setattr(integrity, "seal", no_space)


def test_a_run_that_fails_late_leaves_a_folder_every_reader_refuses(cli, tmp_path, failing_seal, monkeypatch):
    out = tmp_path / "run"
    r = cli("check", "--backend", "fake", "--out", out)
    assert r.exit_code == 2 and "No space left on device" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert f"{str(out)!r} is left incomplete (detllm.partial)" in r.stderr, "and it says so"
    assert (out / "detllm.partial").is_file() and (out / "report.json").is_file(), "everything but the seal was written"
    monkeypatch.undo()
    good = tmp_path / "good"
    import detllm

    detllm.check(backend="fake", out=good)
    for args in (["report", out], ["report", out / "report.json"], ["verify", out], ["diff", out, good], ["diff", good, out],
                 ["pack", out, "-o", tmp_path / "p.tar.gz"], ["replay", out, "--out", tmp_path / "rp"]):
        r = cli(*args)
        assert r.exit_code == 5, (args, r.output)
        assert "is incomplete: the run that wrote it failed" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "p.tar.gz").exists() and not (tmp_path / "rp").exists()


def test_a_rerun_into_an_incomplete_folder_completes_it(cli, tmp_path, failing_seal, monkeypatch):
    out = tmp_path / "run"
    assert cli("check", "--backend", "fake", "--out", out).exit_code == 2
    monkeypatch.undo()
    assert cli("check", "--backend", "fake", "--out", out).exit_code == 0
    assert not (out / "detllm.partial").exists()
    assert cli("verify", out).exit_code == 0


def test_a_run_killed_right_after_its_first_write_can_be_rerun(cli, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "detllm.partial").write_text("incomplete")
    assert cli("check", "--backend", "fake", "--out", out).exit_code == 0
    assert not (out / "detllm.partial").exists()


HOLD = """
import sys, time
from pathlib import Path
from detllm.runfolder.folderlock import exclusive_writer
with exclusive_writer(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(60)
"""


def test_two_writers_into_one_out_the_second_is_refused(cli, tmp_path):
    out = tmp_path / "run"
    import detllm

    detllm.check(backend="fake", out=out)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for args in (["check", "--backend", "fake", "--out", out], ["run", "--backend", "fake", "--out", out]):
            r = cli(*args)
            assert r.exit_code == 2, r.output
            assert "is being written by another detllm run (pid" in r.stderr and len(r.stderr.strip().splitlines()) == 1
        r = cli("diff", out, out, "--out", tmp_path / "run")
        assert r.exit_code == 2
        after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
        assert after == before, "the refused run cleared or wrote nothing"
    finally:
        holder.kill()
        holder.wait()
    assert cli("check", "--backend", "fake", "--out", out).exit_code == 0, "the lock dies with its holder (SIGKILL)"


def test_the_lock_is_never_written_into_the_folder(tmp_path):
    from detllm.runfolder.folderlock import exclusive_writer, lock_path

    out = tmp_path / "run"
    with exclusive_writer(out):
        assert lock_path(out).exists() and not lock_path(out).is_relative_to(tmp_path)
        assert not out.exists()
    assert not lock_path(out).exists()


# ------------------------------------------------------------------ faults mid-run (issue 11: keep surviving them)

MAIN = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "  # Ctrl-C as in a terminal
        "from detllm.cli import main; main(sys.argv[1:])")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_a_run_interrupted_mid_trace_leaves_no_folder_that_looks_complete(cli, tmp_path, sig):
    prompts = tmp_path / "p.txt"
    prompts.write_text("".join(f"prompt {i}\n" for i in range(20_000)))
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", MAIN, "check", "-b", "fake", "--prompts", str(prompts), "--out", str(out),
                             "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (out / "trace.jsonl.partial").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() is not None else "slow"
            time.sleep(0.02)
        time.sleep(0.2)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and err.strip() == "detllm: interrupted", err
    else:
        assert proc.returncode == -signal.SIGKILL
    assert (out / "detllm.partial").exists() and not (out / "manifest.json").exists()
    assert not (out / "trace.jsonl").exists(), "the trace is only renamed into place when complete"
    for args in (["report", out], ["verify", out], ["diff", out, out]):
        r = cli(*args)
        assert r.exit_code == 5 and "is incomplete" in r.stderr, (args, r.output)
    assert cli("check", "-b", "fake", "--out", out).exit_code == 0, "the folder can be re-used"


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


@pytest.mark.engine
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the server through /proc")
def test_llama_server_killed_mid_run_is_exit_8_in_one_line(tmp_path):
    from detllm.backends.llamacpp import find_server

    find_server()  # llama.cpp is part of the install (scripts/install.sh)
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", MAIN, "check", "-b", "llamacpp", "--max-new-tokens", "400", "--runs", "5",
                             "--out", str(out), "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "trace.jsonl.partial").exists() or not _children(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() is not None else "slow"
            time.sleep(0.05)
        for child in _children(proc.pid):
            os.kill(child, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 8, err
    assert err.startswith("detllm: error: ") and len(err.strip().splitlines()) == 1, err
    assert (out / "detllm.partial").exists() and not (out / "manifest.json").exists()


def test_docs_state_every_declared_range():
    """docs/cli.md's range table is the code's: each declared Range appears, written as Range.text()."""
    import dataclasses
    from pathlib import Path

    from detllm.core.config import Decoding, RunConfig, cli_flag

    docs = (Path(__file__).parent.parent / "docs" / "cli.md").read_text()
    docs = docs.split("**Accepted ranges.**", 1)[1].split("\n\n**", 1)[0]  # the range table only
    rows = {line.split("|")[1].strip(): line for line in docs.splitlines() if line.startswith("| `--")}
    for cls in (Decoding, RunConfig):
        for f in dataclasses.fields(cls):
            if "range" in f.metadata:
                row = next((r for k, r in rows.items() if f"`{cli_flag(f.name)}`" in k), None)
                assert row is not None and f.metadata["range"].text() in row, (f.name, row)
    from detllm.backends.fake import FakeOptions
    from detllm.backends.llamacpp import LlamaCppOptions
    from detllm.backends.openai import OpenAIOptions
    from detllm.backends.vllm import VLLMOptions

    for name, cls in (("fake", FakeOptions), ("llamacpp", LlamaCppOptions), ("vllm", VLLMOptions), ("openai", OpenAIOptions)):
        row = next(line for line in docs.splitlines() if line.startswith(f"| `--opt` `{name}` |"))
        for f in dataclasses.fields(cls):
            if "range" in f.metadata:
                assert f"`{f.name}`" in row and f.metadata["range"].text() in row.split(f"`{f.name}`", 1)[1], (name, f.name)


def test_engine_chatter_on_fd_2_is_kept_off_stderr(capfd):
    """What vLLM's engine start writes on file descriptor 2 (torch's C++ NUMA notice, its logs)
    goes to chatter.captured_stderr's sink, not to detllm's one-line stderr."""
    from detllm.core.chatter import captured_stderr

    with captured_stderr() as captured:
        os.write(2, b"[W utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy\n")
    assert "NUMA binding" in captured()
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "after\n"


def test_bad_typer_option_on_a_terminal_is_one_line_too(tmp_path):
    """On a terminal (stderr a tty, CI unset) as in CI: one line, with the option typer would suggest."""
    import pty

    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    try:
        r = subprocess.run([sys.executable, "-m", "detllm", "check", "--bakend", "hf"], stdout=subprocess.PIPE, stderr=slave,
                           env={**env, "COLUMNS": "100"}, cwd=tmp_path, timeout=60)
        os.close(slave)
        chunks = []
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the terminal's other end is closed and drained
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(master)
    text = b"".join(chunks).decode(errors="replace")
    assert r.returncode == 2
    assert text == "detllm: error: `detllm check` has no option --bakend (did you mean --backend?)\r\n", text


@pytest.mark.parametrize("backend", ["fake", pytest.param("hf", marks=pytest.mark.engine)])
def test_the_largest_seed_runs_on_every_backend(tmp_path, backend):
    """--seed 2**32-1, the top of the one documented range, seeds every RNG (numpy's included) without error."""
    import detllm
    from detllm.core.config import SEED_MAX

    outcome = detllm.check(backend=backend, seed=SEED_MAX, temperature=0.7, max_new_tokens=3, out=tmp_path / "s")
    assert outcome.status == "PASS"


def test_help_into_a_closed_pipe_has_no_traceback(tmp_path):
    """`detllm --help | head -1`: rich stops on the broken pipe; no traceback follows (the vendored
    click of typer 0.2x has no exceptions.Abort, and naming it there crashed the except clause)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        r = _detllm("--help", stdout=write_end, cwd=tmp_path)
    finally:
        os.close(write_end)
    assert r.stderr == "", r.stderr
    assert r.returncode in (1, 141)
