"""The verdict written without rich is byte for byte what rich writes to a non-terminal, on real reports
(PASS, FAIL, logprob FAIL, a diff); each thing rich would change, or a forced terminal, sends it to rich."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

import detllm
from detllm.cli import plainout, shell

TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[tuple[dict, Path]]:
    tmp = tmp_path_factory.mktemp("plain")
    runs = [detllm.check(backend="fake", out=tmp / "pass"),
            detllm.check(backend="fake", options={"diverge": "prompt=0,pos=2,batch=4"}, vary_batch=(1, 4), out=tmp / "batch"),
            detllm.check(backend="fake", options={"diverge": "prompt=1,pos=4,run=1,what=logprob"}, tier=2, out=tmp / "lp")]
    out = [(r.report, r.out_dir) for r in runs]
    out += [(json.loads(p.read_text()), p.parent) for p in sorted((TESTS / "golden" / "out" / "diff").glob("*.report.json"))[:8]]
    return out


def _printed(monkeypatch, capsys, report, folder, plain: bool) -> str:
    for var in plainout._FORCING:
        monkeypatch.delenv(var, raising=False)
    if not plain:
        monkeypatch.setattr(plainout, "write_plain", lambda first, rest: False)
    shell.print_verdict(report, folder)
    return capsys.readouterr().out


def test_the_plain_verdict_is_the_bytes_rich_writes(monkeypatch, capsys, reports):
    engaged = 0
    for report, folder in reports:
        with monkeypatch.context() as m:
            via_rich = _printed(m, capsys, report, folder, plain=False)
        with monkeypatch.context() as m:
            used = []
            real = plainout.write_plain
            m.setattr(plainout, "write_plain", lambda first, rest: used.append(real(first, rest)) or used[-1])
            plain = _printed(m, capsys, report, folder, plain=True)
        assert plain == via_rich, (report.get("status"), plain, via_rich)
        engaged += used == [True]
        if report.get("command") == "diff":  # its sides' labels (a::run_0@batch_1) are no emoji codes
            assert used == [True], report["summary"]
    assert engaged >= 6, "the plain path was taken too rarely: this test would prove little"


@pytest.mark.parametrize("line", ["a::run_0@batch_1 vs b::run_0@batch_1", "x::smile: y", "::smile::", ":-emoji: and :-text:",
                                  "a :smile: b", "a:b:c", ":thumbs_up:", "time 12:30:01", "x:smile-emoji:", "::", ":"])
def test_a_line_rich_leaves_as_it_is_is_written_plain_and_the_same(monkeypatch, capsys, line):
    """Emoji codes as rich scans them: a code without a name (a diff side's `::`) is left as it is, so it
    is written plain; one with a name goes to rich unless rich leaves it too. Either way the bytes are rich's."""
    from rich.console import Console

    Console(highlight=False, soft_wrap=True).print(line, markup=False)
    via_rich = capsys.readouterr().out
    for var in plainout._FORCING:
        monkeypatch.delenv(var, raising=False)
    plain = plainout.write_plain("detllm diff: PASS", [line])
    written = capsys.readouterr().out
    named = any(m.group(2) for m in plainout._EMOJI_CODE.finditer(line))
    if plain:
        assert written == "detllm diff: PASS\n" + via_rich
    else:
        assert written == "" and named, line  # nothing else here sends a line to rich
    assert plain is not named


@pytest.mark.parametrize("first,rest", [
    ("detllm check: PASS", ["a line with :ok: in it"]),  # rich would print an emoji
    ("detllm check: PASS", ["tab\there"]),
    ("detllm check: PASS", ["carriage\rreturn"]),
    ("detllm check: [red]PASS", []),  # markup in the coloured line
    ("detllm check: \\[x]", []),
])
def test_what_rich_would_change_goes_to_rich(monkeypatch, first, rest):
    monkeypatch.setattr("sys.stdout", io.StringIO())
    assert plainout.write_plain(first, rest) is False


@pytest.mark.parametrize("var", plainout._FORCING)
def test_a_forced_terminal_goes_to_rich(monkeypatch, var):
    monkeypatch.setattr("sys.stdout", io.StringIO())
    assert plainout.write_plain("detllm check: PASS", ["x"]) is True
    monkeypatch.setenv(var, "1")
    assert plainout.write_plain("detllm check: PASS", ["x"]) is False


def test_a_terminal_goes_to_rich(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stdout", Tty())
    assert plainout.write_plain("detllm check: PASS", ["x"]) is False
