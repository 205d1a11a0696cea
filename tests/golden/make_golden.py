"""Golden outputs: what detllm prints and writes for every committed fixture and every
diff case, kept byte for byte so a refactor that changes none of them can show it.

`python tests/golden/make_golden.py` (re)writes tests/golden/out/ (`--check`: prints what would
change and writes nothing); tests/test_golden.py
renders everything again and compares. Paths of temporary folders and of this checkout
are replaced by <TMP> and <REPO>, and a pack's unpacking folder by <RANDOM>: the only parts
that differ between runs.
Regenerate only for a change that is meant to alter output, and say so in the commit.
"""

from __future__ import annotations

import itertools
import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
REPO = HERE.parent.parent
FIXTURES = REPO / "tests" / "fixtures"
OUT = HERE / "out"
FORMATS = ("txt", "md", "json", "html", "issue")

sys.path.insert(0, str(REPO))


def run_folders() -> list[Path]:
    """Every committed folder a diff can read (the fast-diff fixture set)."""
    return sorted(p for p in [*(FIXTURES / "diff").iterdir(), *(FIXTURES / "v1").iterdir()]
                  if (p / "run_config.json").is_file())


def report_folders() -> list[Path]:
    """Every committed fixture that holds a report (folders and the pack)."""
    return sorted([p for p in (FIXTURES / "v1").iterdir() if (p / "report.json").is_file()]
                  + list((FIXTURES / "v1").glob("*.tar.gz")))


def _invoke(args: list[str]) -> tuple[int, str, str]:
    from typer.testing import CliRunner

    from detllm.cli import app

    res = CliRunner().invoke(app, args)
    return res.exit_code, res.stdout, res.stderr


def _clean(text: str, tmp: Path) -> str:
    text = text.replace(str(tmp.resolve()), "<TMP>").replace(str(tmp), "<TMP>").replace(str(REPO), "<REPO>")
    return re.sub(r"/detllm-pack-[a-z0-9_]+/", "/detllm-pack-<RANDOM>/", text)  # a pack's unpacking folder


def _rendered(folder: Path, tmp: Path, name: str) -> dict[str, str]:
    """`detllm report FOLDER --format F` for every format, plus --junit."""
    out: dict[str, str] = {}
    for fmt in FORMATS:
        code, stdout, stderr = _invoke(["report", str(folder), "--format", fmt])
        out[f"{name}.{fmt}"] = _clean(f"exit {code}\n{stderr}---\n{stdout}", tmp)
    junit = tmp / f"{name}.junit.xml"
    code, _, stderr = _invoke(["report", str(folder), "--format", "json", "--junit", str(junit)])
    out[f"{name}.junit.xml"] = _clean(f"exit {code}\n{stderr}---\n{junit.read_text() if junit.exists() else ''}", tmp)
    return out


def synthetic_pairs(root: Path):
    """The synthetic fast-diff cases of tests/test_fast_diff.py (each variant at each tier/atol)."""
    sys.path.insert(0, str(REPO))
    from tests.test_fast_diff import VARIANTS, _pair

    for variant in VARIANTS:
        sub = root / variant
        sub.mkdir()
        left, right = _pair(sub, variant)
        for tier, atol in [(1, 0.0), (2, 0.0), (2, 1e-6), (2, 0.5)]:
            yield f"synthetic-{variant}-t{tier}-atol{atol:g}", left, right, ["--tier", str(tier), "--atol", repr(atol)]


def outputs() -> dict[str, str]:
    """name -> text, everything the golden set holds."""
    out: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        for folder in report_folders():
            out.update(_rendered(folder, tmp, f"reports/{folder.name}"))
        cases = [(f"{a.parent.name}-{a.name}__{b.parent.name}-{b.name}", a, b, [])
                 for a, b in itertools.permutations(run_folders(), 2)]
        for name, a, b, extra in [*cases, *synthetic_pairs(tmp)]:
            dest = tmp / "d" / name
            code, stdout, stderr = _invoke(["diff", str(a), str(b), "--out", str(dest), *extra])
            out[f"diff/{name}.stdout"] = _clean(f"exit {code}\n{stderr}---\n{stdout}", tmp)
            for f in ("report.json", "report.md"):  # report.txt is the stdout above, less its last line
                if (dest / f).is_file():
                    out[f"diff/{name}.{f}"] = _clean((dest / f).read_text(), tmp)
            if name.startswith("diff-base__") or name.endswith("__diff-base"):
                out.update(_rendered(dest, tmp, f"diffrender/{name}"))
    return out


def changes(got: dict[str, str]) -> list[str]:
    """Unified diffs of every golden file `got` changes, adds or removes."""
    import difflib

    kept = {str(p.relative_to(OUT)): p.read_text(encoding="utf-8") for p in OUT.rglob("*") if p.is_file()}
    out = []
    for name in sorted(set(got) | set(kept)):
        if got.get(name) != kept.get(name):
            out.append("\n".join(difflib.unified_diff((kept.get(name) or "").splitlines(), (got.get(name) or "").splitlines(),
                                                    f"golden/{name}", "now", lineterm="", n=1)))
    return out


def main() -> None:
    import shutil

    got = outputs()
    if "--check" in sys.argv:  # print what changed, write nothing
        diffs = changes(got)
        print("\n".join(diffs) + f"\n{len(diffs)} golden files would change")
        return
    if OUT.exists():
        shutil.rmtree(OUT)
    for name, text in got.items():
        path = OUT / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    print(f"{len(got)} golden files in {OUT}")


if __name__ == "__main__":
    main()
