"""Paths in a bug report, shown without what is private: a path under the current folder is shown
relative to it, one under a home folder from `~`, one under a temporary folder as `[temp]/` and its
last part (the rest is a random or per-user name). Used by the issue text and the HTML page, which
are pasted where strangers read them; the pack's own files are left as they are (verify needs them).
"""

from __future__ import annotations

import os
import re
import tempfile
from functools import lru_cache
from pathlib import Path

TEMP = "[temp]"
# a path starts at a separator that does not continue a word, a URL or another path
_START = r"(?<![\w.~/\\:-])"
# what a path runs on to: not blank, not a quote, not the brackets and separators prose puts around it
_REST = r"(?P<rest>(?:[/\\][^\s'\"`<>|,;(){}\[\]]*)?)"
_TEMP_ROOTS = (r"/tmp", r"/var/tmp", r"/private/tmp", r"/dev/shm", r"(?:/private)?/var/folders/[^/\s]+/[^/\s]+/T",
               r"[A-Za-z]:(?:\\\\|\\|/)Users(?:\\\\|\\|/)[^\\/\s'\"]+(?:\\\\|\\|/)AppData(?:\\\\|\\|/)Local(?:\\\\|\\|/)Temp")
_HOME_ROOTS = (r"/home/[^/\s'\"`<>|,;]+", r"/Users/[^/\s'\"`<>|,;]+", r"/root",
               r"[A-Za-z]:(?:\\\\|\\|/)Users(?:\\\\|\\|/)[^\\/\s'\"`<>|,;]+")


def _local(path: str | None) -> list[str]:
    """This machine's spelling(s) of a folder, resolved and as given; none for the root."""
    if not path:
        return []
    out = {path.rstrip("/\\"), os.path.realpath(path).rstrip("/\\")}
    return sorted((p for p in out if p and p not in ("/", ".")), key=len, reverse=True)


@lru_cache(maxsize=8)
def _pattern(cwd_now: str, temp_now: str, tmpdir: str | None, home_now: str) -> re.Pattern[str]:
    """One alternation, most specific first: the current folder, then temporary, then home folders
    (a Windows temporary folder sits under the home folder; the current folder may sit under either)."""
    cwd = _local(cwd_now)
    temp = [re.escape(p) for p in _local(temp_now) + _local(tmpdir)] + list(_TEMP_ROOTS)
    home = [re.escape(p) for p in _local(home_now)] + list(_HOME_ROOTS)
    groups = [f"(?P<cwd>{'|'.join(map(re.escape, cwd))})" if cwd else None,
              f"(?P<temp>{'|'.join(temp)})(?=[/\\\\])", f"(?P<home>{'|'.join(home)})"]
    return re.compile(_START + "(?:" + "|".join(g for g in groups if g) + ")" + _REST + r"(?![\w.-])")


def _masked(m: re.Match[str]) -> str:
    rest = m.group("rest")
    tail = rest.rstrip(".:")  # a sentence's full stop or a colon after the path is not part of it
    end = rest[len(tail):]
    if m.group("temp") is not None:
        last = [p for p in re.split(r"[/\\]+", tail) if p]
        return (f"{TEMP}/{last[-1]}" if last else TEMP) + end
    if m.group("home") is not None:
        return "~" + tail.replace("\\\\", "/").replace("\\", "/") + end
    return (tail.lstrip("/\\") or ".") + end  # under the current folder: relative to it


def mask_paths(text: str) -> str:
    """`text` with every path under the current, a home or a temporary folder shown relative or masked."""
    if not any(c in text for c in "/\\"):
        return text
    try:
        cwd = os.getcwd()
    except OSError:  # the current folder was removed: no path is relative to it
        cwd = ""
    return _pattern(cwd, tempfile.gettempdir(), os.environ.get("TMPDIR"), str(Path.home())).sub(_masked, text)


def shown(path: str | os.PathLike[str]) -> str:
    """One path as a report shows it (mask_paths of its absolute form; relative under the current folder)."""
    return mask_paths(os.path.abspath(path))


__all__ = ["TEMP", "mask_paths", "shown"]
