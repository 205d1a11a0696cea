"""Issue 21 item 8: nothing private in a bug report. `report --format issue` and the HTML page show a
path under the current folder relative to it, one under a home folder from `~` and one under a
temporary folder as `[temp]/` and its last part, whichever machine wrote the pack; the pack itself
keeps its sealed files as they are, so it still verifies. docs/integrity.md#what-a-bug-report-shows."""

from __future__ import annotations

import json
import os
import shlex
import shutil
from pathlib import Path

import pytest

import detllm
from detllm.render.paths import mask_paths


@pytest.mark.parametrize("text,shown", [
    ("detllm pack /tmp/detllm-pack-64tg4yv_/bug -o x", "detllm pack [temp]/bug -o x"),
    ("-m /home/alice/.cache/detllm/models/tiny-v1-gguf/model.gguf", "-m ~/.cache/detllm/models/tiny-v1-gguf/model.gguf"),
    ("from_pretrained('/Users/bob/models/m')", "from_pretrained('~/models/m')"),
    ("/root/.cache/hf, /var/tmp/pytest-of-carol/x/run.", "~/.cache/hf, [temp]/run."),
    ("/private/var/folders/ab/xyz123/T/tmpq/run", "[temp]/run"),
    (r"C:\Users\dan\AppData\Local\Temp\tmp1\run and C:\Users\dan\m", r"[temp]/run and ~/m"),
    ("/home/alice", "~"),
    # not a home or temporary folder: a path that merely contains the word, a URL, the bare /tmp
    ("/srv/tmp/x /rootfs/y http://host/tmp/z /data/home/alice/m TMPDIR=/tmp", "/srv/tmp/x /rootfs/y http://host/tmp/z /data/home/alice/m TMPDIR=/tmp"),
])
def test_paths_are_masked_by_rule(text, shown):
    assert mask_paths(text) == shown


@pytest.fixture(scope="module")
def bug(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reporter") / "bug"
    o = detllm.check(backend="fake", prompts=["alpha", "beta"], runs=2, tier=2, options={"diverge": "prompt=1,pos=2,run=1"}, out=out)
    assert o.status == "FAIL"
    return out


def _report(cli, path: Path, fmt: str) -> str:
    r = cli("report", path, "--format", fmt)
    assert r.exit_code == 0, r.output
    return r.stdout


def test_a_pack_rendered_shows_no_temporary_folder_and_still_verifies(cli, bug, tmp_path):
    """The trial: the issue rendered from a pack read `detllm pack /tmp/detllm-pack-XXXX/bug`, the
    folder detllm had just unpacked it into."""
    assert cli("pack", bug, "-o", tmp_path / "bug.tar.gz").exit_code == 0
    sealed = {p.name: p.read_bytes() for p in bug.iterdir() if p.is_file()}
    for fmt in ("issue", "html"):
        text = _report(cli, tmp_path / "bug.tar.gz", fmt)
        assert "detllm-pack-" not in text and str(tmp_path) not in text and str(bug) not in text, fmt
    assert "detllm pack [temp]/bug -o pack.tar.gz" in _report(cli, tmp_path / "bug.tar.gz", "issue")
    r = cli("verify", tmp_path / "bug.tar.gz")
    assert r.exit_code == 0, r.output  # the pack keeps what verify needs
    assert {p.name: p.read_bytes() for p in bug.iterdir() if p.is_file()} == sealed


def test_a_run_under_the_current_folder_is_shown_relative(cli, bug, tmp_path, monkeypatch):
    """Rendered by its writer from where they work: the folder relative to it, not its absolute path."""
    shutil.copytree(bug, tmp_path / "runs" / "bug")
    monkeypatch.chdir(tmp_path)
    text = _report(cli, tmp_path / "runs" / "bug", "issue")
    assert "detllm pack runs/bug -o pack.tar.gz" in text and str(tmp_path) not in text


def test_a_pack_from_another_machine_shows_no_home_folder(cli, bug, tmp_path):
    """A pack written on a machine where the model and caches sat under /home/alice and macOS's
    temporary folder: neither the user name nor the temporary names reach the issue or the page."""
    folder = tmp_path / "bug"
    shutil.copytree(bug, folder)
    rc = json.loads((folder / "run_config.json").read_text())
    rc["config"]["model"] = "/home/alice/models/m"
    (folder / "run_config.json").write_text(json.dumps(rc))
    env = json.loads((folder / "env.json").read_text())
    env["env_vars"].update({"HF_HOME": "/Users/alice/.cache/hf", "DETLLM_CACHE": "/private/var/folders/ab/x1y2/T/tmpq9/cache"})
    (folder / "env.json").write_text(json.dumps(env))
    issue, page = _report(cli, folder, "issue"), _report(cli, folder, "html")
    for text in (issue, page):
        assert "alice" not in text and "x1y2" not in text and "tmpq9" not in text
    assert "HF_HOME=~/.cache/hf" in issue and "DETLLM_CACHE=[temp]/cache" in issue
    assert "~/models/m" in page


@pytest.mark.engine
def test_a_real_llamacpp_pack_shows_the_model_path_from_home_and_the_command_still_runs(cli, tmp_path):
    """The trial's llama.cpp issue: `llama-server -m <the reporter's home>/.cache/detllm/models/...`.
    The model file sits under this machine's home folder (or a temporary one): the issue shows
    neither, and its command line, read by a shell (`~` expanded), names the same file."""
    from detllm.models import builtin_path

    run = detllm.run(backend="llamacpp", model="tiny", prompts=["Once upon a time"], max_new_tokens=4, out=tmp_path / "lc")
    assert cli("pack", run.out_dir, "-o", tmp_path / "lc.tar.gz").exit_code == 0
    issue = _report(cli, tmp_path / "lc.tar.gz", "issue")
    gguf = builtin_path("tiny", "gguf") / "model.gguf"
    assert str(gguf) not in issue and str(Path.home()) + os.sep not in issue and "detllm-pack-" not in issue
    line = next(x for x in issue.splitlines() if x.startswith("command line: llama-server "))
    argv = shlex.split(line.removeprefix("command line: "))
    model = argv[argv.index("-m") + 1]
    if model.startswith("~"):  # the model under the home folder: a shell expands it back
        assert Path(os.path.expanduser(model)).resolve() == gguf.resolve()
    else:
        assert model == "[temp]/model.gguf"
    env = json.loads((run.out_dir / "env.json").read_text())
    assert str(gguf) in env["backend"]["argv"]  # the sealed env.json keeps the real path
    assert cli("verify", tmp_path / "lc.tar.gz").exit_code == 0
