"""Every committed fixture rendered in every format, and every fast-diff case diffed, gives
byte for byte what tests/golden/out/ holds (written by tests/golden/make_golden.py before
the layers refactor). A change meant to alter output regenerates them in the same commit."""

from __future__ import annotations

import difflib

from tests.golden.make_golden import OUT, outputs


def test_golden_outputs_unchanged():
    got = outputs()
    kept = {str(p.relative_to(OUT)): p.read_text(encoding="utf-8") for p in OUT.rglob("*") if p.is_file()}
    assert sorted(got) == sorted(kept), "the golden set's files differ: regenerate with tests/golden/make_golden.py"
    changed = [name for name in sorted(got) if got[name] != kept[name]]
    shown = []
    for name in changed[:3]:
        shown += difflib.unified_diff(kept[name].splitlines(), got[name].splitlines(), f"golden/{name}", "now", lineterm="", n=1)
    assert not changed, f"{len(changed)} golden outputs changed:\n" + "\n".join(shown[:120])
