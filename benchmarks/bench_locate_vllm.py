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
import tempfile
import time
from pathlib import Path

import detllm
from bench_locate import PROMPT, cases, perturbation_rows, summary  # the hf benchmark's case loop (benchmarks/ is on sys.path)

# vLLM computes each of these as (a piece of) one module; HF's mlp.act_fn it fuses with the multiply by up
KINDS = [("input_layernorm", "output"), ("self_attn.o_proj", "output"), ("mlp.gate_proj", "output"),
         ("mlp.down_proj", "weight"), ("self_attn.v_proj", "weight"), ("mlp.up_proj", "output"),
         ("post_attention_layernorm", "weight"), ("self_attn.q_proj", "weight"), ("self_attn.k_proj", "output"),
         ("self_attn", "output"), ("mlp", "output"), ("", "output")]


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
    # vLLM captures modules only: a case is named by the perturbed module itself
    rows = perturbation_rows(run, tmp, cases(layers, args.cases, KINDS), lambda op, module: op == module)
    if rows:
        print(summary(rows) + f"; engine restarted: {'no' if current_llm() is engine else 'YES'}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
