"""`detllm locate` on vLLM (in-process, one engine for every case): test-only perturbations named.

One clean vLLM run, then for each case a run with `--opt perturb=MODULE:output|weight:REL` (hooks on the
same engine, no restart; recorded in the run's config, so locate's re-run applies it on that side only),
a check that the perturbation moved the logits, and `locate clean perturbed`. Prints per case: named or
not, the op named, re-runs per side, peak captured bytes and wall time; then the totals and whether
the engine was ever restarted. The hf counterpart is bench_locate.py.

    .venv/bin/python benchmarks/bench_locate_vllm.py [--model smollm2-135m] [--cases 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import detllm
from detllm.locate import locate
from detllm.locate.sides import compared_tier, first_step, load, resolve

PROMPT = ["The capital of France is"]
# vLLM computes each of these as (a piece of) one module; HF's mlp.act_fn it fuses with the multiply by up
KINDS = [("input_layernorm", "output"), ("self_attn.o_proj", "output"), ("mlp.gate_proj", "output"),
         ("mlp.down_proj", "weight"), ("self_attn.v_proj", "weight"), ("mlp.up_proj", "output"),
         ("post_attention_layernorm", "weight"), ("self_attn.q_proj", "weight"), ("self_attn.k_proj", "output"),
         ("self_attn", "output"), ("mlp", "output"), ("", "output")]


def cases(layers: int, n: int) -> list[tuple[str, str]]:
    """n (module, target) pairs spread over the layers ("" is the decoder layer itself)."""
    out = [("model.embed_tokens", "output"), ("model.norm", "output")]
    i = 0
    while len(out) < n:
        kind, target = KINDS[i % len(KINDS)]
        layer = f"model.layers.{(i * 7) % layers}"
        out.append((f"{layer}.{kind}" if kind else layer, target))
        i += 1
    return out[:n]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--cases", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    from detllm.backends.vllm.engine import current_llm  # the benchmark checks the engine is never restarted

    tmp = Path(tempfile.mkdtemp(prefix="detllm_vllm_locate_"))
    run = dict(backend="vllm", model=args.model, max_new_tokens=2, tier=2, prompts=PROMPT)
    t0 = time.perf_counter()
    detllm.run(**run, out=tmp / "clean")
    engine = current_llm()
    print(f"model {args.model}: clean run {time.perf_counter() - t0:.1f} s (includes the engine start)")
    layers = engine.llm_engine.vllm_config.model_config.hf_config.num_hidden_layers
    rows = []
    for n, (module, target) in enumerate(cases(layers, args.cases)):
        spec = f"{module}:{target}:1e-3"
        moved = tmp / f"p{n}"
        detllm.run(**run, out=moved, options={"perturb": spec})
        left, right = load(*resolve(str(tmp / "clean"), str(moved))[:2])
        if first_step(left, right, tier=compared_tier(left, right)) is None:
            print(f"{spec:<58} did not move the logits: skipped")
            continue
        t = time.perf_counter()
        doc = locate(str(tmp / "clean"), str(moved), out=tmp / f"l{n}").doc
        wall = time.perf_counter() - t
        op = (doc["first_bitwise_op"] or {}).get("module", "-")
        cost = doc["cost"]
        rows.append({"spec": spec, "named": op == module, "op": op, "reruns": cost["reruns"],
                     "peak_bytes": cost["peak_captured_bytes"], "seconds": wall})
        print(f"{spec:<58} {'NAMED' if op == module else 'MISSED':<6} {op:<45} re-runs {cost['reruns']['left']}/"
              f"{cost['reruns']['right']}  peak {max(cost['peak_captured_bytes'].values()) / 2**20:6.2f} MB  {wall:5.2f} s")
    if rows:
        print(f"\n{sum(r['named'] for r in rows)}/{len(rows)} named; re-runs per side max "
              f"{max(max(r['reruns'].values()) for r in rows)}; peak captured max "
              f"{max(max(r['peak_bytes'].values()) for r in rows) / 2**20:.2f} MB (bound 512 MB); wall per locate median "
              f"{statistics.median(r['seconds'] for r in rows):.2f} s, max {max(r['seconds'] for r in rows):.2f} s; "
              f"engine restarted: {'no' if current_llm() is engine else 'YES'}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
