"""report.txt: the one-screen plain-text verdict rendered from report.json, and the
one-line summaries of causes that the other renderers share."""

from __future__ import annotations

from typing import Any

from ..compare.causes import ADVICE, TITLES
from .figures import chosen_logprobs, difference_parts, difference_text, maxima_text, share, topk_bound
from . import engaged


def short(value: Any, width: int = 40) -> str:
    """repr() cut to `width` characters; sha256 digests to 12 hex digits."""
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return value[:12]
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _pairs(items: list[dict[str, Any]], n: int) -> str:
    shown = ", ".join(f"{d['field']} {short(d['left'])} vs {short(d['right'])}" for d in items[:n])
    return shown + (f" (+{len(items) - n} more)" if len(items) > n else "")


def cause_summary(cause: dict[str, Any]) -> str:
    """What the evidence of one cause says, in one line."""
    code, ev = cause["code"], cause["evidence"]
    if code == "MODEL_MISMATCH":
        w = ev["weights_sha256"]
        where = f" at the same path {ev['path']['left']}" if ev.get("same_path") else ""
        files = f"; {ev['files_differing']} weight file(s) differ, e.g. {ev['files'][0]['file']}" if ev.get("files") else ""
        conv = f"; formats {ev['format']['left']} vs {ev['format']['right']}" if ev.get("converted") else ""
        cfg = ev.get("config_sha256")
        if w["left"] == w["right"] and cfg:
            return f"same weights, but config.json/generation_config.json differ: {short(cfg['left'])} vs {short(cfg['right'])}{where}"
        return f"weights {short(w['left'])} vs {short(w['right'])}{where}{files}{conv}"
    if code == "TOKENIZER_MISMATCH":
        if ev.get("examples"):
            ex = ev["examples"][0]
            i, la, lb = ex["first_difference"], ex["left_input_ids"], ex["right_input_ids"]
            at = "" if i is None else f": input id {i} is {la[i] if i < len(la) else 'absent'} vs {lb[i] if i < len(lb) else 'absent'}"
            n, checked = ev["prompts_with_different_input_ids"], ev["prompts_checked"]
            return f"{n}/{checked} prompts tokenized differently (prompt {ex['prompt_index']}{at})"
        t = ev["tokenizer_sha256"]
        return f"tokenizer files {short(t['left'])} vs {short(t['right'])}; input ids agree on all {ev['prompts_checked']} prompts"
    if code == "PROMPT_MISMATCH":
        example = (ev["left_only"] + ev["right_only"])[:1]
        text = f" (e.g. {short(example[0]['prompt_text'])})" if example and example[0]["prompt_text"] else ""
        lo, ro = ev.get("left_only_count", len(ev["left_only"])), ev.get("right_only_count", len(ev["right_only"]))
        return f"{lo} prompt(s) only on the left, {ro} only on the right{text}"
    if code == "CONFIG_MISMATCH":
        dt = ev.get("dtype_in_effect")
        return _pairs(ev["fields"] + ev["applied"], 4) + (f"; computed in {dt['left']} vs {dt['right']}" if dt else "")
    if code == "BACKEND_MISMATCH":
        b = ev["backend"]
        name = f"{b['left']} vs {b['right']}" if b["left"] != b["right"] else f"{b['left']} on both sides"
        dt = ev.get("dtype_in_effect")
        return (name + (f"; computed in {dt['left']} vs {dt['right']}" if dt else "")
                + (f"; {_pairs(ev['engine'], 3)}" if ev["engine"] else ""))
    if code == "ENV_MISMATCH":
        return _pairs(ev["differences"], 3) + (f" ({ev['count']} fields in all)" if ev.get("count", 0) > 3 else "")
    first = ev.get("first")
    where = ""
    if first:
        tie = ", a near tie" if first["near_tie"] else ""
        where = f"; {ev['prompts_diverged']} prompt(s) diverged, first prompt {first['prompt_index']} at token {first['token_index']}{tie}"
    also = ev.get("not_required")  # check: INFO comparisons that found this same cause (verdict._fold)
    if also:
        at = also.get("first")
        n = f" in {also['prompts_diverged']} prompt(s)" if "prompts_diverged" in also else ""
        at = f" from prompt {at['prompt_index']} token {at['token_index']}" if at else ""
        where += f"; not required at this tier, also differed: {', '.join(also['comparisons'])},{n}{at}".rstrip(",")
    if code == "BATCH_VARIANCE":
        sizes = ev.get("batch_size")
        what = f"batch size {sizes['left']} vs {sizes['right']}" if sizes else f"batch sizes {ev['batch_sizes']}"
        if ev.get("composition_changed"):
            what += f"; {ev['composition_changed']} prompt(s) sat in a different batch"
        if ev.get("derived"):
            what += f"; settings that follow the batch size: {_pairs(ev['derived'], 2)}"
        if ev.get("not_repeated"):
            what += f"; {ev['not_repeated']}"
        for side, sb in (ev.get("server_batching") or {}).items():  # backend openai: the server's own account
            if sb:
                what += (f"; {side}: {sb['in_flight']} request(s) in flight, the server computed up to "
                         f"{sb['server_busy_max'] if sb['server_busy_max'] is not None else '?'} at once ({sb['source'] or 'not reported'})")
        return what + where
    if code == "CACHE_VARIANCE":
        sides = ", ".join(f"{k} {v.get('side')} ({v.get('cached_prompt_tokens', '?')} cached tokens)" for k, v in ev.get("sides", {}).items())
        return f"prefix cache: {sides}" + where
    if code == "PROCESS_VARIANCE":
        return f"process: {ev['process']['left']} vs {ev['process']['right']}" + where
    kinds = ev.get("repeats")
    which = f"; diverged in {' and '.join(k + ' repeats' for k in kinds)}" if kinds else ""
    cache = ev.get("server_cache")  # backend openai: the server answered one side from its prefix cache
    if cache:
        n = cache["cached_prompt_tokens"]
        which += f"; the server reused {n['left']} vs {n['right']} cached prompt tokens: likely CACHE_VARIANCE (check --cache-probe)"
    return "same model, tokenizer, prompts, config, engine, environment and batch" + which + where


def _tok(side: dict[str, Any], same_token: bool, logprob: str | None) -> str:
    if side["token_id"] is None:
        return "<end of generation>"
    lp = f" logprob {logprob}" if logprob is not None else ""
    other = f" (other's token {side['other_logprob']:.6g})" if side.get("other_logprob") is not None and not same_token else ""
    margin = f" margin {side['margin']:.3g}" if side.get("margin") is not None else ""
    return f"id {side['token_id']} {side['token_text']!r}{lp}{other}{margin}"


def divergence_lines(d: dict[str, Any]) -> list[str]:
    width = max(len(d["left"]["label"]), len(d["right"]["label"]), 12)
    same = d["left"]["token_id"] == d["right"]["token_id"]
    lp = chosen_logprobs(d)
    lines = [
        f"first divergence ({d['comparison']}): prompt {d['prompt_index']}, generated token {d['token_index']}, kind {d['kind']}",
        f"  common prefix: {d['common_prefix_text'][-80:]!r}",
        f"  {d['left']['label']:<{width}} {_tok(d['left'], same, lp[0])}",
        f"  {d['right']['label']:<{width}} {_tok(d['right'], same, lp[1])}",
    ]
    if d["kind"] == "input_ids":
        ids = d.get("input_ids") or {}
        at = f" (first difference at input id {ids['first_difference']})" if ids.get("first_difference") is not None else ""
        lines.append(f"  the prompt was tokenized differently on the two sides{at}")
    if difference := difference_text(d):
        lines.append(f"  {difference}")
    m = magnitude_line(d)
    if m:
        lines.append("  " + m)
    return lines


MAGNITUDE_TITLES = {
    "tie_flip": "tie flip",
    "confident_flip": "confident flip",
    "sampled_step": "sampled step",
    "tokens_equal_logprobs_differ": "tokens equal, logprobs differ",
    "input_ids": "different input ids",
    "length": "one side stopped",
    "unclassified": "unclassified",
    "identical": "identical",
}


def _g(x: Any) -> str:
    return "?" if x is None else f"{x:.3g}"


def magnitude_line(d: dict[str, Any]) -> str:
    """One line saying how big a divergence is (docs/causes.md#magnitude)."""
    m = d.get("magnitude")
    if not m:  # a report written before magnitudes existed
        return f"near tie: a margin is below the noise floor {d['noise_floor']:g} (a numeric tie flipped)" if d.get("near_tie") else ""
    label, floor = m["label"], m.get("noise_floor")
    gap = m.get("gap") or {}
    bound = m.get("gap_is_lower_bound") or {}
    gaps = (f"gap between the two tokens {'>=' if bound.get('left') else ''}{_g(gap.get('left'))} on the left, "
            f"{'>=' if bound.get('right') else ''}{_g(gap.get('right'))} on the right")
    at = f" at token {m['token_index']}" if m.get("token_index") not in (None, d["token_index"]) else ""
    if label == "tie_flip":
        return f"tie flip{at}: {gaps}, both below the noise floor {_g(floor)} (any reordering of a sum can flip it)"
    if label == "confident_flip":
        return f"confident flip{at}: {gaps}; noise floor {_g(floor)}: a real computational difference"
    if label == "sampled_step":
        pr = m.get("probabilities") or {}
        lp, rp = pr.get("left") or {}, pr.get("right") or {}
        moved = m.get("distribution_moved")
        how = "" if moved is None else ("; the two tokens' odds moved beyond the noise floor" if moved
                                        else "; the two tokens' odds did not move: the samplers drew differently")
        return (f"sampled step{at}: p(own token) {_g(lp.get('own'))}, p(other's token) {_g(lp.get('other'))} on the left; "
                f"{_g(rp.get('own'))}, {_g(rp.get('other'))} on the right{how}")
    if label == "tokens_equal_logprobs_differ":
        noise = "" if floor is None else (" (within the noise floor)" if m.get("within_noise") else f" (beyond the noise floor {_g(floor)})")
        parts = difference_parts(d) if m.get("abs_diff") is not None else None
        of = "" if parts is None else (" of the chosen token's logprob" if parts[1] is None else " of a top-k entry's logprob")
        return f"tokens equal, logprobs differ: |difference| {_g(m.get('abs_diff'))}{of}{noise}"
    if label == "unclassified":
        return f"magnitude unclassified: {m.get('why', 'not enough recorded')}"
    if label == "length" and at:  # a logprob moved, then one side stopped earlier: the tokens are not equal
        return f"one side stopped{at}: the tokens are not equal, so this is a length divergence"
    return ""


def drift_summary(drift: dict[str, Any]) -> str:
    """Distribution measures of one comparison, in one line ("" without logprobs)."""
    if not drift.get("available"):
        return ""
    parts = []
    if drift.get("same_top1_share") is not None:
        parts.append(f"same top-1 {share(drift['same_top1_share'])}")
    if drift.get("kl_topk"):
        parts.append(f"KL(top-k) mean {drift['kl_topk']['mean']:.3g} max {drift['kl_topk']['max']:.3g}")
    pc = drift.get("abs_logprob_diff_percentiles")
    if pc and drift.get("max_abs_logprob_diff"):
        parts.append(f"chosen-token |dlogprob| p50 {pc['p50']:.3g} p90 {pc['p90']:.3g} p99 {pc['p99']:.3g} max {drift['max_abs_logprob_diff']:.3g}")
    return ", ".join(parts)


def equal_drift_line(e: dict[str, Any]) -> str:
    """The "tokens equal, logprobs differ" finding of a comparison."""
    growth = " -> ".join(_g(q["max_abs_logprob_diff"]) for q in e["growth"])
    return (f"tokens equal, logprobs differ in {e['prompts']} prompt(s): max |dlogprob| of chosen tokens {_g(e['max_abs_logprob_diff'])}, "
            f"from prompt {e['first']['prompt_index']} token {e['first']['token_index']}; by quarter of the positions {growth}")


def _header(report: dict[str, Any]) -> list[str]:
    s = report.get("summary", {})
    tier = report["tier"]
    tier_note = "" if tier["requested"] == tier["effective"] else f" (requested {tier['requested']}, downgraded)"
    category = "" if report["category"] in ("PASS", report["status"]) else f" [{report['category']}]"
    lines = [f"detllm {report['command']}: {report['status']}{category}"]
    if line := reproduction_line(report):  # the pack's verdict, in the reporter's terms
        lines.append(line)
    if report["command"] == "diff" and "left" in s:
        for name in ("left", "right"):
            x = s[name]
            lines.append(f"{name:<5} {x['label']}  {x['backend']} {x['model']} {x['dtype']} {x['device']}  "
                         f"(recorded at tier {x['tier']}, {x['records']} prompts)")
        floor = f"  noise floor {s['noise_floor']:g}" if s.get("noise_floor") is not None else ""
        lines.append(f"tier {tier['effective']}{tier_note}  atol {s.get('atol', 0):g}{floor}")
        return lines
    lines.append(f"tier {tier['effective']}{tier_note}" + (f"  backend {s['backend']}  model {s['model']}" if "backend" in s else ""))
    if "prompts" in s:
        axis = "concurrency" if s.get("backend") == "openai" else "batch sizes"  # a server chose its own batches
        lines.append(f"prompts {s['prompts']}  runs {s.get('runs', '-')}  {axis} {s.get('batch_sizes', '-')}  "
                     f"tokens {s.get('generated_tokens', '-')}")
    if report.get("scope"):
        lines.append(f"scope: {report['scope']}")
    if report.get("sensitivity"):
        lines += sensitivity_line(report["sensitivity"], report.get("negative_control"), report.get("comparisons", ()))
    lines += engaged.lines(report)  # UNVERIFIED / not observable comparisons, and the PASS's bound
    return lines


# the causes `detllm diagnose` probes for a check: a setting of the run can make them vanish
DIAGNOSABLE = frozenset({"RUN_VARIANCE", "BATCH_VARIANCE", "CACHE_VARIANCE", "PROCESS_VARIANCE", "CONFIG_MISMATCH", "ENV_MISMATCH"})


def reproduction_line(report: dict[str, Any]) -> str | None:
    """A replay's verdict in the reporter's terms ("the pack's FAIL [X] reproduces here, ..."),
    shown under the verdict in every rendering; None for other reports."""
    if report["command"] != "replay":
        return None
    return (report["summary"].get("reproduction") or {}).get("line") or None


def diagnose_command(report: dict[str, Any], run_dir: str = "RUN_DIR") -> str | None:
    """`detllm diagnose RUN_DIR` when the report is a check's FAIL whose top cause diagnose can
    probe, else None: the first next step in every rendering (txt, md, the step summary, html)."""
    if report["command"] == "check" and report["status"] == "FAIL" and report["causes"] \
            and report["causes"][0]["code"] in DIAGNOSABLE:
        return f"detllm diagnose {run_dir}"
    return None


def next_step(report: dict[str, Any], run_dir: str = "RUN_DIR") -> str:
    """The line after a verdict with causes: a check's FAIL that diagnose can probe names
    `detllm diagnose` on its folder first, then the top cause's advice."""
    code = report["causes"][0]["code"]
    command = diagnose_command(report, run_dir)
    if command is not None:
        return f"next: {command} (finds the setting that makes it stop); {ADVICE[code]}"
    return f"next: {ADVICE[code]}"


def render_text(report: dict[str, Any], run_dir: str = "RUN_DIR") -> str:
    """The verdict in plain text; `run_dir`: the folder's name in a suggested command."""
    lines = _header(report)
    for c in report["comparisons"]:
        extra = ""
        drift = c["drift"]
        maxima = maxima_text(c)
        if maxima:
            extra = f"  {maxima}"
        if drift.get("available") and drift.get("argmax_flips"):
            extra += f"  argmax flips {drift['argmax_flips']}"
        unmatched = len(c["unmatched"]["left_only"]) + len(c["unmatched"]["right_only"])
        extra += f"  {unmatched} prompt(s) unmatched" if unmatched else ""
        need = "" if c["required"] else " (not required)"
        mag = (c.get("magnitude") or {}).get("label")
        extra += f"  [{MAGNITUDE_TITLES.get(mag, mag)}]" if mag and mag != "identical" else ""
        extra += engaged.comparison_note(c)
        lines.append(f"  {c['status']:<4} {c['name']}: {c['prompts_diverged']}/{c['prompts_compared']} prompts diverged{need}{extra}")
        dist = drift_summary(drift)
        if dist and (drift.get("max_abs_logprob_diff") or drift.get("argmax_flips")):
            lines.append(f"       {dist}")
        if drift.get("tokens_equal_logprobs_differ"):
            lines.append("       " + equal_drift_line(drift["tokens_equal_logprobs_differ"]))
        moved = c.get("prompts_moved") or {}
        if moved.get("count"):
            ex = moved["examples"][0]
            lines.append(f"       {moved['count']} aligned prompt(s) sit at other positions (e.g. {ex['left_index']} -> {ex['right_index']})")
    if report.get("magnitude"):
        m = report["magnitude"]
        counts = ", ".join(f"{MAGNITUDE_TITLES.get(k, k)} {n}" for k, n in sorted(m["counts"].items()))
        lines.append(f"magnitude: {MAGNITUDE_TITLES.get(m['label'], m['label'])}" + (f" ({counts})" if counts else ""))
    if report["causes"]:
        lines.append("causes, most likely first:")
    for n, cause in enumerate(report["causes"], 1):
        lines.append(f"  {n}. {cause['code']}: {TITLES[cause['code']]}: {cause_summary(cause)}"[:400])
    info = report.get("info") or []
    if info:
        lines.append("recorded differences that did not fail the verdict:")
        lines += [f"  - {c['code']}: {cause_summary(c)}"[:300] for c in info]
    inert = report.get("inert_differences") or []
    if inert:
        lines.append("differences that never change the computation (not causes):")
        lines += [f"  - {d['field']} {short(d['left'])} vs {short(d['right'])}: {d['why']}"[:300] for d in inert[:8]]
    skipped = report.get("not_compared") or []
    if skipped:
        lines.append("not compared (different meanings across schema versions, or unknown on a side):")
        lines += [f"  - {d['field']}: {d['reason']}"[:300] for d in skipped[:8]]
    if report["first_divergence"] is not None:
        lines += divergence_lines(report["first_divergence"])
    if report["causes"]:
        lines.append(next_step(report, run_dir))
    return "\n".join(lines) + "\n"


def _logprob_figure(lp: float | None, topk: float | None = None) -> str:
    """What was measured of the logprobs, in words: a 0 is said as "none moved", never printed as a
    figure; the chosen tokens' maximum, and a top-k entry's difference where a divergence shows a larger one."""
    if lp is None:
        return "logprobs not compared"
    if topk is not None:
        return (f"max |dlogprob| of chosen tokens {lp:.3g}, " if lp else "") + f"of top-k entries >={topk:.3g}"
    if lp == 0.0:
        return "tokens diverged; no logprob moved before them"
    return f"max |dlogprob| of chosen tokens {lp:.3g}"


def sensitivity_line(sens: dict[str, Any], control: dict[str, Any] | None, comparisons: Any = ()) -> list[str]:
    """The report's lines: the sensitivity, and the negative control's verdict when one ran.
    `comparisons`: the report's, whose divergences may show a top-k difference above the chosen maximum."""
    if sens["drift_observed"]:
        topk = max((b for b in map(topk_bound, comparisons) if b is not None), default=None)
        topk = topk if topk is not None and topk > (sens["max_abs_logprob_diff"] or 0.0) else None
        pairs = dict.fromkeys(w.removesuffix(" (logprobs)") for w in sens["where"])  # a pair's token and logprob comparisons: once
        lines = [f"sensitivity: drift observed in {', '.join(pairs)} ({_logprob_figure(sens['max_abs_logprob_diff'], topk)})"]
    elif sens["max_abs_logprob_diff"] is None:
        lines = ["sensitivity: no drift observed anywhere (no token moved in any comparison; logprobs not compared)"]
    else:
        lines = ["sensitivity: no drift observed anywhere (no token and no logprob moved in any comparison)"]
    if control is not None:
        if not control["ran"]:
            lines.append(f"negative control: not run: {control['note']}")
        elif control["differed"]:
            lines.append(f"negative control: {control['setting']} differed as it should "
                         f"({control['prompts_differed']}/{control['prompts']} prompts, {_logprob_figure(control['max_abs_logprob_diff'])})")
        else:
            lines.append(f"negative control: {control['setting']} did not differ: the prompts/tokens were too few to expose "
                         "variance, so this verdict says little")
    return lines
