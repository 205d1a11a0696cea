"""What a locate outcome asks the user to do next (locate.json `next`), and, when a side does not
reproduce its own trace here, what of the recorded environment differs from this machine's (replay's
rule: ENV_MISMATCH's comparison of env.json) with the command that pins it. Reads the document and
the sides' recorded env; re-runs nothing.
"""

from __future__ import annotations

import dataclasses
import shlex
from typing import Any

from ..compare.causes import Side
from ..compare.causes.environment import env_mismatch
from ..compare.causes.notes import Notes
from ..compare.causes.sides import ABSENT, Routed


def env_apart(side: Side) -> list[dict[str, Any]]:
    """The differences between the environment `side` recorded (left) and this process's (right), as
    diff's ENV_MISMATCH lists them; [] when it recorded none or nothing differs."""
    from ..runfolder.env import collect_env

    if not side.env:
        return []
    here = dataclasses.replace(side, label="here", env=collect_env(None, torch=side.env.get("torch") is not None))
    found = env_mismatch(side, here, Notes(), Routed())
    return list(found["differences"]) if found else []


def pin_command(fields: list[dict[str, Any]], command: str) -> str | None:
    """`command` run with each recorded environment variable that differs set back as recorded
    (unset where it was absent); None when no variable differs (libraries, hardware: another machine)."""
    parts = []
    for f in fields:
        name = f["field"].removeprefix("env_vars.")
        if name == f["field"] or "." in name:
            continue
        parts.append(f"-u {name}" if f["left"] == ABSENT else f"{name}={shlex.quote(str(f['left']))}")
    return f"env {' '.join(parts)} {command}" if parts else None


def selection(side: dict[str, Any]) -> str:
    """A locate.json side as the selection that names it (FOLDER::run_N@batch_B)."""
    return f"{side['folder']}::run_{side['run_index']}@batch_{side['batch_size']}"


def not_reproduced(key: str, fields: list[dict[str, Any]], doc: dict[str, Any]) -> str:
    """The next step of a side that does not reproduce its trace here, from what differs."""
    again = f"detllm locate {shlex.quote(selection(doc['left']))} {shlex.quote(selection(doc['right']))}"
    if not fields:
        return (f"the {key} side's environment as recorded equals this one in everything env.json holds: the re-run varies "
                f"by itself here (run variance); `detllm check` with --runs 3 on this machine shows it")
    listed = "; ".join(f"{f['field']} {f['left']!r} recorded vs {f['right']!r} here" for f in fields[:4])
    pin = pin_command(fields, again)
    return (f"the {key} side was recorded in another environment ({listed}"
            + (f"; {len(fields) - 4} more" if len(fields) > 4 else "") + "): "
            + (f"pin it and locate again: {pin}" if pin else "re-run on the machine (libraries, hardware) that recorded it"))


def next_step(doc: dict[str, Any]) -> str:
    """One line: what to do with this outcome."""
    status = doc["status"]
    if status == "not_reproduced":
        return doc.get("next") or "re-run where the sides were recorded"
    if status == "no_difference":
        if any("different --max-new-tokens" in n for n in doc["not_captured"]):
            return "nothing differs over the steps both recorded; record both sides with the same --max-new-tokens to compare the rest"
        return "nothing to locate: the sides agree in everything recorded (`detllm diff` says which settings differ)"
    if status == "not_located":
        if (doc.get("step") or {}).get("what") == "asked":
            return "nothing differs at this step: drop --step to locate the first recorded difference"
        return ("the difference enters in what was not captured (see not captured): locate again at op level (without "
                "--layers-only or --no-ops), or the same pair on hf, which captures aten ops")
    op, beyond = doc["first_bitwise_op"], doc["first_beyond_tolerance_op"]
    category = (doc.get("category") or {}).get("name")  # issue 33: benign or bug
    if category == "not_judged" and op is not None and op.get("tolerance") is not None:
        return ("not judged: the difference grows in computation compared on one side only (the line names it); capture it "
                "on both sides (locate the same pair on hf, which captures aten ops) before calling it rounding")
    if category == "different_computation":
        return "the two sides compute different things (weights, config or a test-only perturbation: see category): make them equal, then check again"
    if beyond is not None:
        return (f"{beyond['module']} computes something other than float64 says it should on the same inputs: a bug or a changed "
                "weight there; compare its kernel or weights between the two sides")
    if op is not None and op.get("tolerance") is None:
        return "tolerance not evaluated: locate again without --no-reference to judge the op against float64"
    batches = doc["left"].get("batch_size") != doc["right"].get("batch_size")
    return ("rounding from a different reduction shape (within both sides' float64 error): "
            + ("batch-invariant kernels remove it (--opt batch_invariant=true, tier 3)" if batches else
               "the same kernels on the same shapes remove it; `detllm diff` names the setting that differs"))
