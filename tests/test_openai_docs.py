"""docs/backends/openai.md's first example, run as written against the real llama-server (issue 21,
item 14): export the GGUF, start llama-server with the documented line, run both documented checks.
Only the port (a free one) and the run folder (--out) are added; before the docs named `--alias`,
the check was refused: the server served the model as its file path, not as `tiny`."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from .conftest import assert_valid_run, llama_server_or_fail

pytestmark = pytest.mark.engine
DOC = Path(__file__).resolve().parent.parent / "docs" / "backends" / "openai.md"


def _first_bash_block() -> list[list[str]]:
    block = re.search(r"```bash\n(.*?)```", DOC.read_text(), re.S).group(1)
    lines = block.replace("\\\n", " ").splitlines()
    return [shlex.split(ln.split("#", 1)[0].strip().rstrip("&").strip()) for ln in lines if ln.strip()]


def test_the_documented_llama_server_example_runs_as_written(cli, tmp_path, monkeypatch):
    from detllm.backends.llamacpp import Server, free_port

    cmds = _first_bash_block()
    assert [c[:2] for c in cmds] == [["detllm", "models"], ["llama-server", "-m"], ["detllm", "check"], ["detllm", "check"]], cmds
    monkeypatch.chdir(tmp_path)  # the documented relative paths (gguf-tiny/...) land here
    export = cli(*cmds[0][1:])
    assert export.exit_code == 0, export.output
    port = str(free_port())
    serve = [str(llama_server_or_fail())] + [port if a == "8080" else a for a in cmds[1][1:]]
    srv = Server(serve + ["--no-webui", "-t", "2"], int(port), 60.0)
    try:
        srv.wait_ready(60.0)
        for i, cmd in enumerate(cmds[2:]):
            args = [a.replace(":8080/", f":{port}/") for a in cmd[1:]] + ["--out", str(tmp_path / f"run{i}"), "--no-progress"]
            res = cli(*args)
            assert "does not serve model" not in res.output, res.output
            report = assert_valid_run(tmp_path / f"run{i}", failed=res.exit_code == 1)
            # the documented line ran to a verdict, and the exit code is that verdict's
            assert res.exit_code == {"PASS": 0, "FAIL": 1}[report["status"]], res.output
            served = json.loads((tmp_path / f"run{i}" / "env.json").read_text())["backend"]["models"]
            assert [m["id"] for m in served] == ["tiny"]
    finally:
        srv.stop()
