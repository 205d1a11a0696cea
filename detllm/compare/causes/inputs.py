"""MODEL_MISMATCH, TOKENIZER_MISMATCH and PROMPT_MISMATCH: what the computation was given
(the weights and model config, the input ids and tokenizer, the prompt set) differs. Does not
judge how it was computed (config.py, environment.py, variance.py).
"""

from __future__ import annotations

from typing import Any

from ..represent import input_ids_known
from .notes import Notes
from .sides import CAP, Side, cut, lr


def model_mismatch(left: Side, right: Side, notes: Notes) -> dict[str, Any] | None:
    lm, rm = left.run_config["model"], right.run_config["model"]
    if lm["weights_sha256"] is None or rm["weights_sha256"] is None:  # a served model's weights: unknown, never equal or different
        notes.skip("run_config.model.weights_sha256", "unknown, neither equal nor different: "
                   + "; ".join(m.get("remote") or "not hashed" for m in (lm, rm) if m["weights_sha256"] is None))
        return None
    lc, rc = lm.get("config_sha256"), rm.get("config_sha256")
    config_differs = lc is not None and rc is not None and lc != rc
    if config_differs and notes.screen([{"field": "model.config_sha256", "left": lc, "right": rc}], "run_config") == []:
        config_differs = False  # hashed differently by the two versions: not compared
    lf, rf = lm.get("config_files_sha256"), rm.get("config_files_sha256")
    if not config_differs and lc is not None and lc == rc and lf and rf and lf != rf:
        notes.note({"field": "run_config.model.config_files_sha256", "left": lf, "right": rf},
                   "config.json/generation_config.json differ only in fields that do not change the computation "
                   "(a version stamp, a name): config_sha256, over the fields that do, agrees")
    lt, rt = lm.get("chat_template_sha256"), rm.get("chat_template_sha256")
    if lt != rt:
        notes.note({"field": "run_config.model.chat_template_sha256", "left": lt, "right": rt},
                   "no chat template is applied: the prompts are tokenized as given")
    if lm["weights_sha256"] == rm["weights_sha256"] and not config_differs:
        return None
    lw, rw = ({w["file"]: w["sha256"] for w in m["weights"]} for m in (lm, rm))
    files = [{"file": f, "left": lw.get(f), "right": rw.get(f)} for f in sorted(set(lw) | set(rw)) if lw.get(f) != rw.get(f)]
    ev: dict[str, Any] = {
        "weights_sha256": lr(lm["weights_sha256"], rm["weights_sha256"]),
        "model": lr(lm["id"], rm["id"]),
        "path": lr(lm["path"], rm["path"]),
        "same_path": lm["path"] is not None and lm["path"] == rm["path"],
        "files": cut(files),
        "files_differing": len(files),
    }
    for key in ("format", "quantization", "revision"):
        if lm[key] != rm[key]:
            ev[key] = lr(lm[key], rm[key])
    if lm["format"] != rm["format"]:
        ev["converted"] = True  # weights in different formats never hash equal
    if config_differs:
        ev["config_sha256"] = lr(lc, rc)  # the architecture or decoding defaults were edited
    return ev


def tokenizer_mismatch(left: Side, right: Side, pairs: list[tuple[dict, dict]], notes: Notes) -> dict[str, Any] | None:
    """Input ids first: they are what the engine saw, comparable across engines. The
    tokenizer hash is compared only where it is computed the same way (same engine and
    model format); identical tokenizer files at different paths hash the same."""
    known = [(a, b) for a, b in pairs if input_ids_known(a) and input_ids_known(b)]
    if len(known) < len(pairs):  # the server tokenized the text: its ids are unknown, never different
        notes.skip("trace_record.input_ids", "unknown on one side, neither equal nor different: the server tokenized the "
                   "prompt text (evidence.prompt_as text)")
    pairs = known
    differ = [(a, b) for a, b in pairs if a["input_ids_sha256"] != b["input_ids_sha256"]]
    ev: dict[str, Any] = {}
    if differ:
        examples = []
        for a, b in differ[:3]:
            la, lb = a.get("input_ids"), b.get("input_ids")
            first = None if la is None or lb is None else next(
                (i for i, (x, y) in enumerate(zip(la, lb)) if x != y), min(len(la), len(lb)))
            examples.append({"prompt_index": a["prompt_index"], "prompt_id": a["prompt_id"], "first_difference": first,
                             "left_input_ids": la, "right_input_ids": lb,
                             "input_ids_sha256": lr(a["input_ids_sha256"], b["input_ids_sha256"])})
        ev.update({"prompts_with_different_input_ids": len(differ), "prompts_checked": len(pairs), "examples": examples})
    if left.run_config is not None and right.run_config is not None:
        lm, rm = left.run_config["model"], right.run_config["model"]
        comparable = left.run_config["config"]["backend"] == right.run_config["config"]["backend"] and lm["format"] == rm["format"]
        hashes = notes.screen([{"field": "model.tokenizer_sha256", "left": lm["tokenizer_sha256"], "right": rm["tokenizer_sha256"]}],
                              "run_config")
        if None in (lm["tokenizer_sha256"], rm["tokenizer_sha256"]):  # a served model's tokenizer: unknown
            notes.skip("run_config.model.tokenizer_sha256", "unknown, neither equal nor different: not hashed (remote)")
            hashes = []
        if hashes and hashes[0]["left"] != hashes[0]["right"] and (comparable or differ):
            ev["tokenizer_sha256"] = lr(lm["tokenizer_sha256"], rm["tokenizer_sha256"])
            if not differ:
                ev.update({"prompts_with_different_input_ids": 0, "prompts_checked": len(pairs)})
    return ev or None


def prompt_mismatch(left: Side, right: Side, comp: dict[str, Any]) -> dict[str, Any] | None:
    lo, ro = comp["unmatched"]["left_only"], comp["unmatched"]["right_only"]
    if not lo and not ro:
        return None

    def describe(side: Side, indexes: list[int]) -> list[dict[str, Any]]:
        by_index = {r["prompt_index"]: r for r in side.records or ()}
        out = []
        for i in indexes[:CAP]:
            r = by_index.get(i, {})
            text = r.get("prompt_text")
            out.append({"prompt_index": i, "prompt_id": r.get("prompt_id"), "prompt_text": text[:120] if text else None})
        return out

    ev: dict[str, Any] = {"left_only": describe(left, lo), "right_only": describe(right, ro),
                          "left_only_count": len(lo), "right_only_count": len(ro)}
    if left.run_config is not None and right.run_config is not None:
        ev["prompt_sets"] = lr(left.run_config["prompts"], right.run_config["prompts"])
    return ev
