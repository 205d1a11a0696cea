"""Cost of one fresh-process repeat (`check --fresh-process`) against an in-process repeat.

For each model, in one process (the parent's engine loaded and warmed first):
  in-process repeat: the repeat's generations through the parent's already-loaded backend
  fresh repeat:      fresh.FreshProcess: spawn `python -m detllm.pipeline.fresh`, import the engine, load the
                     model, hash its files, apply the determinism settings, generate the same
                     batches, restore and exit -- broken down phase by phase
  end to end:        detllm.check(runs=2) vs detllm.check(runs=2, fresh_process=1), wall time
Prints seconds per phase and the extra cost of a fresh repeat over an in-process one.

    .venv/bin/python benchmarks/bench_fresh_process.py [--models tiny,smollm2-135m] [--backend hf]
        [--max-new-tokens 16] [--repeat 2] [--ab]   (--ab: end to end with and without the up-front child)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def phases(config, backend, batches, tier: int) -> dict[str, float]:
    """One fresh repeat, timed phase by phase (seconds)."""
    from detllm.pipeline import fresh

    with backend.determinism(tier=tier, seed=config.seed, threads=config.threads) as applied:
        settings = [a.to_json() for a in applied]
    identity = backend.model_identity().to_json()
    t0 = time.perf_counter()
    child = fresh.FreshProcess(config, tier=tier, identity=identity, settings=settings)
    t_ready = time.perf_counter()
    try:
        for reqs in batches:
            child.generate(reqs, seed=config.seed, n_logprobs=config.logprobs, logprobs=True)
        t_gen = time.perf_counter()
    finally:
        child.close()
    t_end = time.perf_counter()
    t = child.timings
    return {"total": t_end - t0, "python+detllm start": t["python_start_s"] + t["start_s"],
            "engine import+load": t["load_s"], "hash model files": t["identity_s"], "apply settings": t["settings_s"],
            "spawn->ready": t_ready - t0, "generate (child)": t["generate_s"], "generate (seen by parent)": t_gen - t_ready,
            "restore+exit": t_end - t_gen}


def in_process(config, backend, batches, tier: int) -> float:
    t0 = time.perf_counter()
    with backend.determinism(tier=tier, seed=config.seed, threads=config.threads):
        for reqs in batches:
            backend.generate(reqs, config.decoding, seed=config.seed, n_logprobs=config.logprobs, logprobs=True)
    return time.perf_counter() - t0


def bench_model(model: str, backend_name: str, tokens: int, repeat: int) -> None:
    import detllm
    from detllm.backends.base import Request
    from detllm.backends.registry import create_backend
    from detllm.core.config import Decoding, RunConfig
    from detllm.core.prompts import BUILTIN_PROMPTS

    config = RunConfig(backend=backend_name, model=model, runs=2, fresh_process=1, tier=2,
                       decoding=Decoding(max_new_tokens=tokens))
    backend = create_backend(config)
    reqs = [Request(i, tuple(backend.tokenize(t)), t, f"{i:064x}", 0) for i, t in enumerate(BUILTIN_PROMPTS)]
    batches = [[r] for r in reqs]  # batch size 1, as check's repeats
    in_process(config, backend, batches, 2)  # warm
    inproc = [in_process(config, backend, batches, 2) for _ in range(repeat)]
    fresh_runs = [phases(config, backend, batches, 2) for _ in range(repeat)]
    med = {k: statistics.median(r[k] for r in fresh_runs) for k in fresh_runs[0]}
    print(f"\n== {backend_name} {model}: {len(reqs)} prompts x {tokens} tokens, batch 1, tier 2 (median of {repeat})")
    print(f"  in-process repeat (generate only)      {statistics.median(inproc):8.2f} s")
    for k, v in med.items():
        print(f"  fresh repeat: {k:<26}{v:8.2f} s")
    print(f"  extra cost of a fresh repeat           {med['total'] - statistics.median(inproc):8.2f} s")
    with tempfile.TemporaryDirectory() as tmp:
        walls = {}
        for n in (0, 1):
            t0 = time.perf_counter()
            out = detllm.check(backend=backend_name, model=model, runs=2, fresh_process=n, tier=2, max_new_tokens=tokens,
                               out=Path(tmp) / f"c{n}")
            walls[n] = time.perf_counter() - t0
            assert out.status == "PASS", out.report["causes"]
    print(f"  end to end: check --runs 2             {walls[0]:8.2f} s")
    print(f"  end to end: check --runs 2 --fresh-process 1 {walls[1]:8.2f} s  (+{walls[1] - walls[0]:.2f} s)")
    backend.close()


def ab_prestart(model: str, backend_name: str, tokens: int, repeat: int) -> None:
    """End to end `check --runs 2 --fresh-process 1`, with the first child started up front (loads while the
    parent generates) and without (started when its repeat comes), alternated so both see the same load."""
    import detllm
    from detllm.pipeline import fresh

    walls: dict[str, list[float]] = {"prestart": [], "no prestart": []}
    original = fresh.Dispatcher._needs_the_device
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeat):
            for name in walls:
                fresh.Dispatcher._needs_the_device = original if name == "prestart" else (lambda self: True)
                t0 = time.perf_counter()
                detllm.check(backend=backend_name, model=model, runs=2, fresh_process=1, tier=2, max_new_tokens=tokens,
                             out=Path(tmp) / f"{name}-{i}".replace(" ", "-"))
                walls[name].append(time.perf_counter() - t0)
    fresh.Dispatcher._needs_the_device = original
    print(f"\n== {backend_name} {model}: check --runs 2 --fresh-process 1, end to end (median of {repeat})")
    for name, w in walls.items():
        print(f"  {name:<12} {statistics.median(w):8.2f} s   {', '.join(f'{x:.1f}' for x in w)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,smollm2-135m")
    ap.add_argument("--backend", default="hf")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--ab", action="store_true", help="only the prestart A/B, end to end")
    args = ap.parse_args()
    for model in args.models.split(","):
        if args.ab:
            ab_prestart(model, args.backend, args.max_new_tokens, args.repeat)
        else:
            bench_model(model, args.backend, args.max_new_tokens, args.repeat)


if __name__ == "__main__":
    main()
