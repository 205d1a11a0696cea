"""parity.txt: the trainer <-> engine logprob comparison of parity.json as plain text.
Reads the document only; computes nothing (training/parity.py owns the numbers).
"""

from __future__ import annotations

from typing import Any


def _num(x: Any) -> str:
    return "null" if x is None else f"{x:.3g}" if isinstance(x, float) else str(x)


def render_text(doc: dict[str, Any]) -> str:
    tr, en = doc["trainer"], doc["engine"]
    lines = [f"parity: {doc['verdict']}  (model {doc['model']}, atol {doc['atol']})",
             f"  trainer: {tr['framework']}, {tr['dtype']}, attention {tr['attn_implementation']}, model.eval(), {tr['threads']} threads",
             f"  engine:  {en['backend']}, {en['dtype']}" + (f"; {en['attention']['note']}" if en.get("attention") else "")]
    for name, p in doc["paths"].items():
        label = "decode (rollout logprobs)" if name == "decode" else f"prefill ({en['score_method'] or 'score'})"
        if not p["available"]:
            lines.append(f"  {label}: not compared: {p['reason']}")
            continue
        state = "bitwise equal" if p["bitwise_equal"] else f"{p['bitwise_equal_positions']}/{p['positions']} tokens bitwise equal"
        lines.append(f"  {label}: {state}, max |Δlogprob| {_num(p['max_abs_diff'])}, mean {_num(p['mean_abs_diff'])}")
        f = p["first_difference"]
        if f is not None:
            delta = (f", Δ {f['engine'] - f['trainer']:.3g}" if isinstance(f["engine"], float) and isinstance(f["trainer"], float)
                     else "")  # the two values print alike at 3 digits: the difference is what moved
            lines.append(f"    first difference: sequence {f['sequence']}, token {f['position']}: trainer {_num(f['trainer'])}, "
                         f"engine {_num(f['engine'])}{delta}")
    for seq in doc["sequences"]:
        if seq.get("excluded"):
            lines.append(f"  sequence {seq['index']} not compared: {seq['excluded']}")
    return "\n".join(lines) + "\n"
