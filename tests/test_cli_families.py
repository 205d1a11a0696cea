"""The console script imports only the family of the command it runs (cli/families.COMMANDS) and builds
only that command: the map is held to what each family module really registers, and a command run
that way sees the same app (help, errors) as the whole one."""

from __future__ import annotations

import json
import subprocess
import sys

from detllm.cli import COMMANDS, FAMILIES, app
from detllm.cli.families import names

PROBE = """
import json
import detllm.cli.{family}
from detllm.cli.families import names
from detllm.cli.shell import app
print(json.dumps(sorted(names(app))))
"""


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_each_family_registers_exactly_the_commands_the_map_gives_it():
    for family in FAMILIES:
        got = json.loads(_run(PROBE.format(family=family)))
        assert got == sorted(c for c, f in COMMANDS.items() if f == family), family
    assert sorted(names(app)) == sorted(COMMANDS)


def test_a_command_line_imports_its_family_alone_and_help_lists_every_command_in_order():
    """`env` imports the info family alone; --help afterwards, in the same process, lists every command
    in the order of the whole app (the families' order, whichever was imported first)."""
    code = ("import sys, contextlib, io\nfrom detllm.cli import main\n"
            "def go(args):\n    out = io.StringIO()\n    with contextlib.redirect_stdout(out):\n        try:\n            main(args)\n"
            "        except SystemExit:\n            pass\n    return out.getvalue()\n"
            "go(['env', '--json'])\n"
            f"print(sorted(m.rsplit('.', 1)[1] for m in sys.modules if m.rsplit('.', 1)[0] == 'detllm.cli' and m.rsplit('.', 1)[1] in {FAMILIES!r}))\n"
            "print(' '.join(line.split()[1] for line in go(['--help']).splitlines() if line.startswith('\u2502 ') and len(line.split()) > 2))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    imported, listed = out.stdout.strip().splitlines()[-2:]
    assert imported == "['info']"
    assert [n for n in listed.split() if n in COMMANDS] == names(app)
