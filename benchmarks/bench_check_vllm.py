"""Overhead of `detllm check --backend vllm` against the bare work it wraps: one `vllm.LLM` + `LLM.generate`.

Side by side in one process, alternated --repeat times (vLLM imported and one engine started and
stopped first, outside the timings, so both sides start from the same warm process and page cache):
  bare:   vllm.LLM(...) with the engine arguments and env vars detllm's vllm backend uses (read from
          the backend itself, not copied), then LLM.generate of the same prompts in the same batches
          (greedy, logprobs 5, max_tokens --max-new-tokens; prompts as text, which vLLM tokenizes as
          detllm does before it passes ids): --runs runs at the first batch size (one call per batch),
          one run at each other size of --vary-batch, short batches topped up with detllm's fillers
  detllm: detllm.check(backend="vllm", runs, vary_batch, tier 2): engine start, the same calls,
          trace (logprobs + top-5), seal, compare, report
Each engine is shut down after its side, untimed (check keeps its engine up for the process).
Prints wall and CPU times and the ratios (_overhead.py).

    .venv/bin/python benchmarks/bench_check_vllm.py [--model smollm2-135m] [--runs 5] [--vary-batch 1,8]
        [--max-new-tokens 32] [--repeat 2] [--threads N]
"""

from __future__ import annotations

import os
from typing import Any

from _overhead import alternate, arguments, check_fields, timed


def engine_args(config: Any) -> tuple[dict[str, str], dict[str, Any]]:
    """(env vars, vllm.LLM keyword arguments) that detllm's vllm backend starts its engine with for
    `config`, caught at the call that would start it (no engine is started here)."""
    from detllm.backends.vllm import backend as backend_mod, engine as engine_mod

    caught: dict[str, Any] = {}

    def catch(key: tuple, env: dict[str, str], kwargs: dict[str, Any]) -> object:
        caught.update(env=dict(engine_mod.LOGGING_DEFAULTS, **env), kwargs=kwargs)
        return object()

    real, backend_mod.start_engine = backend_mod.start_engine, catch
    try:
        backend_mod.VLLMBackend.from_config(config).engine()
    finally:
        backend_mod.start_engine = real
    return caught["env"], caught["kwargs"]


def shutdown(llm: Any) -> None:
    """Stop a bare engine the way detllm's release_engine stops its own."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    cleanup_dist_env_and_memory()


def bare(kwargs: dict[str, Any], prompts: list[str], fillers: list[str], runs: int, sizes: list[int], tokens: int) -> Any:
    """Start an engine and generate what `check` generates; returns the engine (still up)."""
    import torch
    from vllm import LLM, SamplingParams

    from detllm.pipeline.runner import plan_batches

    set_num_threads = torch.set_num_threads  # vLLM's in-process worker replaces it with a no-op (as detllm undoes)
    llm = LLM(**kwargs)
    torch.set_num_threads = set_num_threads
    params = SamplingParams(temperature=0.0, max_tokens=tokens, logprobs=5, seed=0)
    for b in sizes:
        for _ in range(runs if b == sizes[0] else 1):
            for batch in plan_batches(len(prompts), b):
                texts = [prompts[i] if i >= 0 else fillers[-i - 1] for i in batch]
                llm.generate(texts, params, use_tqdm=False)  # one call per batch, as detllm's backend makes
    return llm


def main() -> None:
    args = arguments(__doc__)
    from detllm.api import make_config
    from detllm.backends.vllm import release_engine
    from detllm.models import resolve_model
    from detllm.core.prompts import BUILTIN_PROMPTS, FILLERS

    resolve_model(args.model)  # build/cache the model outside every timing
    fields = check_fields("vllm", args)
    env, kwargs = engine_args(make_config(**fields))
    os.environ.update(env)  # the same env for both sides; detllm sets the same values again
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)  # the in-process worker computes on this pool; detllm sets the same
    print(f"engine: {', '.join(f'{k}={v}' for k, v in env.items())}; "
          f"LLM({', '.join(f'{k}={v!r}' for k, v in kwargs.items() if k not in ('model', 'tokenizer'))})")
    prompts, fillers = list(BUILTIN_PROMPTS), list(FILLERS)
    warm, llm = timed(lambda: bare(kwargs, prompts, fillers, 1, args.sizes[:1], 2))
    shutdown(llm)
    del llm
    print(f"warm-up, untimed below (import vllm + one engine start + 4 short calls): {warm}")

    engines: list[Any] = []

    def stop_engines() -> None:
        while engines:
            shutdown(engines.pop())
        release_engine()

    alternate("vLLM check", lambda: engines.append(bare(kwargs, prompts, fillers, args.runs, args.sizes, args.max_new_tokens)),
              fields, args.repeat, bare_name="bare vllm.LLM + generate", after=stop_engines)


if __name__ == "__main__":
    main()
