"""report.txt: the one-screen plain-text verdict rendered from report.json."""

from __future__ import annotations

from typing import Any


def _tok(side: dict[str, Any]) -> str:
    if side["token_id"] is None:
        return "<end of generation>"
    lp = f" logprob {side['logprob']:.6g}" if side.get("logprob") is not None else ""
    margin = f" margin {side['margin']:.3g}" if side.get("margin") is not None else ""
    return f"id {side['token_id']} {side['token_text']!r}{lp}{margin}"


def divergence_lines(d: dict[str, Any]) -> list[str]:
    lines = [
        f"first divergence ({d['comparison']}): prompt {d['prompt_index']}, generated token {d['token_index']}, kind {d['kind']}",
        f"  common prefix: {d['common_prefix_text'][-80:]!r}",
        f"  {d['left']['label']:<18} {_tok(d['left'])}",
        f"  {d['right']['label']:<18} {_tok(d['right'])}",
    ]
    if d["kind"] == "input_ids":
        lines.append("  the prompt was tokenized differently on the two sides")
    if d.get("logprob_abs_diff") is not None:
        lines.append(f"  |logprob difference| {d['logprob_abs_diff']:.3g}")
    if d.get("near_tie"):
        lines.append(f"  near tie: a margin is below the noise floor {d['noise_floor']:g} (a numeric tie flipped)")
    return lines


def render_text(report: dict[str, Any]) -> str:
    s = report.get("summary", {})
    tier = report["tier"]
    tier_note = "" if tier["requested"] == tier["effective"] else f" (requested {tier['requested']}, downgraded)"
    lines = [
        f"detllm {report['command']}: {report['status']}" + ("" if report["category"] in ("PASS", report["status"]) else f" [{report['category']}]"),
        f"tier {tier['effective']}{tier_note}" + (f"  backend {s['backend']}  model {s['model']}" if "backend" in s else ""),
    ]
    if "prompts" in s:
        lines.append(f"prompts {s['prompts']}  runs {s.get('runs', '-')}  batch sizes {s.get('batch_sizes', '-')}  tokens {s.get('generated_tokens', '-')}")
    for c in report["comparisons"]:
        extra = ""
        if c["drift"].get("available") and c["drift"].get("max_abs_logprob_diff"):
            extra = f"  max |dlogprob| {c['drift']['max_abs_logprob_diff']:.3g}"
        need = "" if c["required"] else " (not required)"
        lines.append(f"  {c['status']:<4} {c['name']}: {c['prompts_diverged']}/{c['prompts_compared']} prompts diverged{need}{extra}")
    for cause in report["causes"]:
        lines.append(f"cause {cause['code']}: " + ", ".join(f"{k}={v}" for k, v in cause["evidence"].items() if not isinstance(v, (dict, list)))[:300])
    if report["first_divergence"] is not None:
        lines += divergence_lines(report["first_divergence"])
    return "\n".join(lines) + "\n"
