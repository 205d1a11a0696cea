"""Shared test helpers: every folder a test writes is validated against the schemas."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path

import pytest
from typer.testing import CliRunner

from detllm.runfolder.artifacts import validate_folder
from detllm.cli import app

# A test run started in the background of a non-interactive shell (`cmd &`) inherits SIGINT ignored, and so
# would every process it starts: the Ctrl-C tests would then wait forever. Ctrl-C as in a terminal, always.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

REQUIRED = ("env.json", "run_config.json", "determinism_applied.json", "trace.jsonl", "report.json", "report.txt")


def assert_valid_run(folder: Path, *, failed: bool = False) -> dict:
    """All artifacts present and schema-valid; returns report.json."""
    for name in REQUIRED:
        assert (folder / name).is_file(), f"{name} missing from {folder}"
    assert (folder / "diffs" / "first_divergence.json").is_file() == failed
    checked = validate_folder(folder)
    assert "trace.jsonl" in checked and "report.json" in checked
    assert not list(folder.glob("*.partial")) and not list(folder.glob(".*.tmp"))
    return json.loads((folder / "report.json").read_text())


def trace_records(folder: Path) -> list[dict]:
    """The records of a run folder's trace.jsonl, in file order."""
    return [json.loads(line) for line in (folder / "trace.jsonl").read_text().splitlines()]


def llama_server_or_fail() -> Path:
    """The llama-server binary; a missing one fails the test (CI builds it), or skips it with DETLLM_SKIP_LLAMACPP=1."""
    from detllm.backends.llamacpp import find_server
    from detllm.core.errors import BackendUnavailableError

    try:
        return find_server()
    except BackendUnavailableError as exc:
        if os.environ.get("DETLLM_SKIP_LLAMACPP") == "1":
            pytest.skip("llama.cpp binary missing and DETLLM_SKIP_LLAMACPP=1")
        pytest.fail(f"{exc.one_line()} -- CI builds it with scripts/build_llamacpp.sh; "
                    "set DETLLM_SKIP_LLAMACPP=1 to skip these tests", pytrace=False)


@pytest.fixture
def cli():
    runner = CliRunner()

    def invoke(*args: str, env: dict | None = None):
        return runner.invoke(app, [str(a) for a in args], env=env)

    return invoke


def write_prompts(path: Path, texts) -> Path:
    """A --prompts file at `path`: one {"prompt": text} line per text."""
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return path


CROSS_PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):", "Numbers: 1 2 3"]


@pytest.fixture(scope="session")
def cross_prompt_file(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("cross-prompts") / "prompts.jsonl", CROSS_PROMPTS)


@pytest.fixture(scope="session")
def smollm2_sides(tmp_path_factory, cross_prompt_file):
    """A real cross-engine FAIL, made once per session and shared (test_cross_engine, test_html):
    SmolLM2-135M through transformers (dequantised fp32) and through llama-server (Q4_1)."""
    import detllm

    tmp = tmp_path_factory.mktemp("smollm2")
    return tuple(detllm.run(backend=b, model="smollm2-135m", prompts=cross_prompt_file, tier=2, max_new_tokens=12,
                            out=tmp / f"{b}-smollm2-135m").out_dir for b in ("hf", "llamacpp"))


@pytest.fixture(scope="session")
def llama_served():
    """One real llama-server per session for the served-endpoint (openai backend) tests: the tiny
    GGUF, 8 slots, prompt caching as llama-server ships it (on), alias "tiny". Started through
    llamacpp.Server, so it dies with the test process on every exit path."""
    from detllm.backends.llamacpp import find_server
    from detllm.core.errors import BackendUnavailableError

    try:
        binary = find_server()
    except BackendUnavailableError as exc:
        pytest.fail(f"llama-server is required for the openai backend tests: {exc.one_line()}")
    with tiny_llama_server(slots=8, ctx=4096, binary=binary) as srv:
        yield srv


@contextlib.contextmanager
def tiny_llama_server(slots: int, ctx: int, binary: Path | None = None):
    """A real llama-server on 127.0.0.1 serving the tiny GGUF as "tiny" with `slots` slots (`.url` is its /v1);
    started through llamacpp.Server, so it dies with the test process, and stopped on leaving."""
    from detllm.backends.llamacpp import Server, free_port
    from detllm.models import builtin_path

    binary = binary or llama_server_or_fail()
    port = free_port()
    srv = Server([str(binary), "-m", str(builtin_path("tiny", "gguf") / "model.gguf"), "--host", "127.0.0.1", "--port",
                  str(port), "-np", str(slots), "-c", str(ctx), "--alias", "tiny", "--no-webui", "-t", "2"], port, 120.0)
    try:
        srv.wait_ready(120.0)
        srv.url = f"http://127.0.0.1:{port}/v1"
        yield srv
    finally:
        srv.stop()
