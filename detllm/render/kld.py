"""`report --format kld`: llama-perplexity's `--kl-divergence` statistics block, line for line.

Renders the numbers of compare/kld.py under a short header saying what the two runs are and
which positions counted, then the three sections with llama.cpp's labels, percentiles and
printf formats (tools/perplexity/perplexity.cpp), so a script that parses its output reads
ours. Computes nothing.
"""

from __future__ import annotations

from typing import Any

RULE = "======"


def _pct(fraction: float | None, what: str) -> str:
    """llama.cpp's label of a percentile line: "99.9%   KLD", " 5.0%   Δp", "Median  KLD"."""
    return f"Median  {what}" if fraction is None else f"{100 * fraction:4.1f}%   {what}"


def block(stats: dict[str, Any]) -> list[str]:
    """The statistics block itself, as llama-perplexity prints it after its per-chunk table."""
    ppl, kld, dp = stats["perplexity"], stats["kld"], stats["p_diff"]
    lines = [
        f"{RULE} Perplexity statistics {RULE}",
        "Mean PPL(Q)                   : %10.6f ± %10.6f" % tuple(ppl["ppl_q"]),
        "Mean PPL(base)                : %10.6f ± %10.6f" % tuple(ppl["ppl_base"]),
        "Cor(ln(PPL(Q)), ln(PPL(base))): %6.2f%%" % (100.0 * ppl["cor"]),
        "Mean ln(PPL(Q)/PPL(base))     : %10.6f ± %10.6f" % tuple(ppl["ln_ratio"]),
        "Mean PPL(Q)/PPL(base)         : %10.6f ± %10.6f" % tuple(ppl["ratio"]),
        "Mean PPL(Q)-PPL(base)         : %10.6f ± %10.6f" % tuple(ppl["difference"]),
        "",
        f"{RULE} KL divergence statistics {RULE}",
        "Mean    KLD: %10.6f ± %10.6f" % tuple(kld["mean"]),
        "Maximum KLD: %10.6f" % kld["maximum"],
        *(f"{_pct(f, 'KLD')}: {v:10.6f}" for f, v in kld["percentiles"]),
        "Minimum KLD: %10.6f" % kld["minimum"],
        "",
        f"{RULE} Token probability statistics {RULE}",
        "Mean    Δp: %6.3f ± %5.3f %%" % tuple(100.0 * x for x in dp["mean"]),
        "Maximum Δp: %6.3f%%" % (100.0 * dp["maximum"]),
        *(f"{_pct(f, 'Δp')}: {100.0 * v:6.3f}%" for f, v in dp["percentiles"]),
        "Minimum Δp: %6.3f%%" % (100.0 * dp["minimum"]),
        "RMS Δp    : %6.3f ± %5.3f %%" % tuple(100.0 * x for x in dp["rms"]),
        "Same top p: %6.3f ± %5.3f %%" % tuple(100.0 * x for x in dp["same_top"]),
    ]
    return lines


def _what_differed(c: dict[str, Any], count: int) -> str:
    """Token divergence and, apart from it, positions whose logprobs or top-k moved (a logprob-only difference)."""
    moved = c.get("moved")
    if moved is None or c["prompts_diverged"]:
        return f"{c['prompts_diverged']} of {c['prompts']} prompts diverged"
    if moved:
        return f"no prompt's tokens diverged; logprobs or top-k differ at {moved} of {count} positions (a logprob-only difference)"
    return f"0 of {c['prompts']} prompts diverged; logprobs and top-k identical at every position"


def render_kld(doc: dict[str, Any]) -> str:
    """The header (what was compared, what counted) and the block. `doc`: {"left", "right"
    (side summaries), "counts" and "statistics"} as reporting.kld_document builds it."""
    c, stats = doc["counts"], doc["statistics"]
    left, right = doc["left"], doc["right"]
    side = "{label}  {backend} {model} {dtype} {device}"
    head = [
        f"detllm kld: base (P) = left  {side.format(**left)}",
        f"            Q        = right {side.format(**right)}",
        f"positions: {stats['count']}, each prompt's steps up to and including its first divergent token "
        f"({_what_differed(c, stats['count'])}; {c['generated']} tokens generated on the left)",
        f"distributions: each side's top-{doc['top_k']} and chosen token; the tokens both sides list, plus one \"other\" "
        "bucket holding the rest of each side's mass (so KLD is a lower bound of the full-vocabulary KLD)",
        f"reference token: the left run's chosen token; not listed by the right run at {c['outside_top_k']} position(s), "
        "where Q is its \"other\" mass (an upper bound)",
    ]
    if c.get("keyed_by") == "text":
        head.append("tokens keyed by their text: the served model gave no token ids, so tokens that decode alike are one entry")
    if c["prompts_other_input"]:
        head.append(f"left out: {c['prompts_other_input']} prompt(s) whose input ids differ (their contexts are never equal)")
    if c["null_steps"]:
        head.append(f"left out: {c['null_steps']} step(s) with a null (non-finite) logprob")
    if stats["count"] < 100:
        head.append(f"note: llama-perplexity prints no statistics for fewer than 100 positions; these are over {stats['count']}")
    return "\n".join([*head, "", *block(stats)]) + "\n"


__all__ = ["block", "render_kld"]
