"""The verdict's lines written to stdout without rich where rich would write the same bytes: stdout is no
terminal (a CI log, a file, a pipe), nothing forces colour, and no line holds what rich would change (a
control character or tab, an emoji code such as `:ok:`, markup in the coloured first line). Anywhere
else the caller prints through rich as before. Saves rich's import (~25 ms, ~1.5 MiB) in a check or a diff.
"""

from __future__ import annotations

import os
import re
import sys

# what makes rich decide on a terminal (or a notebook) although stdout is not one: see rich.console.Console.is_terminal
_FORCING = ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "JUPYTER_COLUMNS", "JUPYTER_LINES")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # control codes and tabs
# rich._emoji_replace's pattern, scanned as its sub() scans: a code with a name may be an emoji; one without
# (the `::` of a diff side's label, `a::run_0@batch_1`) never is, and rich leaves it as it is
_EMOJI_CODE = re.compile(r"(:(\S*?)(?:(?:\-)(emoji|text))?:)")
_MARKUP = re.compile(r"\[[a-z#/@]|\\")  # what could open a rich tag (rich.markup.RE_TAGS) or escape one


def _plain_stdout() -> bool:
    if any(v in os.environ for v in _FORCING) or "IPython" in sys.modules:
        return False
    try:
        return not sys.stdout.isatty()
    except (AttributeError, ValueError):  # no stdout, or a closed one: rich's own handling
        return False


def write_plain(first: str, rest: list[str]) -> bool:
    """Write `first` (the coloured line) and `rest` to stdout as rich would, when rich would add nothing;
    False (nothing written) otherwise."""
    if not _plain_stdout() or _MARKUP.search(first) or any(_changed_by_rich(line) for line in (first, *rest)):
        return False
    sys.stdout.write("".join(line + "\n" for line in (first, *rest)))
    return True


def _changed_by_rich(line: str) -> bool:
    return bool(_CONTROL.search(line)) or any(m.group(2) for m in _EMOJI_CODE.finditer(line))
