"""parity.txt: the trainer <-> engine logprob comparison of parity.json as plain text.
Reads the document only; computes nothing (training/parity.py owns the numbers).
"""

from __future__ import annotations

from typing import Any

from .paritystats import RATIO_BAND


def _num(x: Any) -> str:
    return "null" if x is None else f"{x:.3g}" if isinstance(x, float) else str(x)


def _exact(x: Any) -> str:
    return "null" if x is None else repr(x) if isinstance(x, float) else str(x)


def render_text(doc: dict[str, Any]) -> str:
    tr, en = doc["trainer"], doc["engine"]
    lines = [f"parity: {doc['verdict']}  (model {doc['model']}, atol {doc['atol']})",
             f"  trainer: {tr['framework']}, {tr['dtype']}, attention {tr['attn_implementation']}, model.eval(), {tr['threads']} threads",
             f"  engine:  {en['backend']}, {en['dtype']}" + (f"; {en['attention']['note']}" if en.get("attention") else "")]
    if doc.get("checkpoint"):
        lines.append(f"  weights: the checkpoint {doc['checkpoint']} (checked by digest), on both sides")
    for name, p in doc["paths"].items():
        label = "decode (rollout logprobs)" if name == "decode" else f"prefill ({en['score_method'] or 'score'})"
        if not p["available"]:
            lines.append(f"  {label}: not compared: {p['reason']}")
            continue
        state = "bitwise equal" if p["bitwise_equal"] else f"{p['bitwise_equal_positions']}/{p['positions']} tokens bitwise equal"
        lines.append(f"  {label}: {state}, max |Δlogprob| {_num(p['max_abs_diff'])}, mean {_num(p['mean_abs_diff'])}")
        rl = p.get("rl")
        if rl and rl["tokens"]:
            lo, hi = RATIO_BAND
            lines.append(f"    importance ratio r = exp(logp_trainer - logp_engine): max {rl['ratio_max']:.6g}, min {rl['ratio_min']:.6g}, "
                         f"{rl['ratio_outside_share']:.1%} of {rl['tokens']} tokens outside [{lo}, {hi}]; "
                         f"mismatch KL(engine || trainer), k3 = mean(r - 1 - log r): {rl['mismatch_kl_k3']:.3g}")
        f = p["first_difference"]
        if f is not None:  # enough digits that the two values differ as printed, and the Δ itself
            delta = "" if f["abs_diff"] is None else f" (|Δ| {f['abs_diff']:.3g})"
            lines.append(f"    first difference: sequence {f['sequence']}, token {f['position']}: trainer {_exact(f['trainer'])}, "
                         f"engine {_exact(f['engine'])}{delta}")
    for seq in doc["sequences"]:
        if seq.get("excluded"):
            lines.append(f"  sequence {seq['index']} not compared: {seq['excluded']}")
    return "\n".join(lines) + "\n"
