"""`detllm run` and `detllm check`: one command builder for both (check repeats and compares,
run generates once per batch size), and the flags that are spellings of backend options
(--base-url, --concurrency, --llama-bin...) turned into RunConfig's options. The run itself
is api.run / api.check.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Callable, Optional

import typer

from ..runfolder.artifacts import check_output_file
from ..core.errors import UsageError
from .proofopts import HIDDEN, Confidence, FillPrompts, MaxRate, RequireEngagement
from .shell import Backend, JUnit, Model, ProgressBar, SignKey, app, emit, guarded, write_html

FreshProcess = Annotated[int, typer.Option("--fresh-process", help="check: run this many of the repeats each in a new process (new import, load and settings); the others share run 0's process.")]
FreshProcessHidden = Annotated[int, typer.Option("--fresh-process", hidden=True)]  # run: not offered (RunConfig.validate refuses it)
NegativeControl = Annotated[bool, typer.Option("--negative-control", help="check: also generate each prompt in a batch of fillers (a deliberately non-invariant setting); it must differ, else the verdict says the prompts were too few to expose variance.")]
NegativeControlHidden = Annotated[bool, typer.Option("--negative-control", hidden=True)]  # run: not offered


def _gen_command(command: str, default_runs: int) -> Callable:
    def cmd(
        backend: Backend = "hf",
        model: Model = "tiny",
        prompts: Annotated[Optional[Path], typer.Option(help="Prompt file: .jsonl ({\"prompt\": ...} per line), .json (an array of prompts) or text (one per line).")] = None,
        prompt: Annotated[Optional[list[str]], typer.Option("--prompt", help="A prompt (repeatable); instead of --prompts.")] = None,
        prompt_file: Annotated[Optional[Path], typer.Option("--prompt-file", help="JSONL prompt file ({\"prompt\"|\"text\": ...} or a string per line).")] = None,
        out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Run folder (default: a new folder under artifacts/).")] = None,
        force: Annotated[bool, typer.Option(help="Write into an existing non-detllm folder.")] = False,
        tier: Annotated[int, typer.Option(help="0 artifacts only, 1 token ids repeat, 2 +logprobs equal, 3 +batch invariance.")] = 1,
        mode: Annotated[str, typer.Option(help="strict: refuse a tier the backend cannot enforce; best-effort: downgrade and record.")] = "best-effort",
        runs: Annotated[int, typer.Option(help="Repeats at --batch-size (check needs >= 2).")] = default_runs,
        fresh_process: FreshProcess = 0,
        negative_control: NegativeControl = False,
        require_engagement: RequireEngagement = False,
        max_rate: MaxRate = None,
        confidence: Confidence = 0.95,
        fill_prompts: FillPrompts = False,
        batch_size: Annotated[int, typer.Option(help="Batch size of the repeated runs.")] = 1,
        vary_batch: Annotated[Optional[str], typer.Option(help="Extra batch sizes, e.g. 1,2,8; each is compared to batch size 1.")] = None,
        max_new_tokens: Annotated[int, typer.Option(help="Tokens generated per prompt.")] = 16,
        temperature: Annotated[float, typer.Option(help="0 = greedy; > 0 samples with a seeded generator per request.")] = 0.0,
        top_p: Annotated[float, typer.Option(help="Nucleus sampling filter.")] = 1.0,
        top_k: Annotated[int, typer.Option("--top-k", help="Top-k sampling filter (0 = off), as in transformers, vLLM and llama.cpp.")] = 0,
        sample_top_k: Annotated[Optional[int], typer.Option("--sample-top-k", hidden=True, help="Old name of --top-k.")] = None,
        seed: Annotated[int, typer.Option(help="Seed for every RNG and per-request generator.")] = 0,
        logprobs: Annotated[int, typer.Option("--logprobs", help="(id, logprob) pairs recorded per step, best first (OpenAI's top_logprobs).")] = 5,
        dtype: Annotated[str, typer.Option(help="float32, bfloat16, float16 or auto.")] = "float32",
        device: Annotated[str, typer.Option(help="cpu, cuda or auto.")] = "cpu",
        threads: Annotated[Optional[int], typer.Option(help="Intra-op threads (default: the engine's).")] = None,
        atol: Annotated[float, typer.Option(help="Logprob tolerance at tier >= 2 (0 = bitwise).")] = 0.0,
        revision: Annotated[Optional[str], typer.Option(help="Hub revision of --model.")] = None,
        tokenizer_revision: Annotated[Optional[str], typer.Option("--tokenizer-revision", help="Tokenizer revision: the model's snapshot, so the same as --revision.")] = None,
        redact_env: Annotated[bool, typer.Option("--redact-env", help="env.json: hide every recorded variable's value and the hostname (secrets are always hidden).")] = False,
        redact_env_var: Annotated[Optional[list[str]], typer.Option("--redact-env-var", metavar="NAME", help="env.json: hide this variable's value (repeatable).")] = None,
        validate_schema: Annotated[bool, typer.Option("--validate-schema", help="Accepted for compatibility: every artifact is always validated.")] = False,
        html: Annotated[Optional[Path], typer.Option("--html", help="Also write a self-contained HTML report here.")] = None,
        prompt_text: Annotated[bool, typer.Option("--prompt-text/--no-prompt-text", help="Record prompt text and input ids (off: only hashes).")] = True,
        opt: Annotated[Optional[list[str]], typer.Option("--opt", help="Backend option key=value (repeatable); see docs/backends/.")] = None,
        llama_bin: Annotated[Optional[Path], typer.Option("--llama-bin", help="llama.cpp bin folder or llama-server binary (llamacpp; else DETLLM_LLAMA_BIN, PATH, the build cache).")] = None,
        base_url: Annotated[Optional[list[str]], typer.Option("--base-url", metavar="URL", help="openai: the server's OpenAI-compatible root, e.g. http://127.0.0.1:8080/v1. check: repeat it for a fleet (N endpoints checked at once, OUT/replica_<i>/, one N-way verdict; docs/fleet.md).")] = None,
        reference_url: Annotated[Optional[str], typer.Option("--reference-url", metavar="URL", help="fleet check: the replica (one of the --base-url) the others are judged against: outliers are those that differ from it (docs/fleet.md).")] = None,
        api_key_env: Annotated[Optional[str], typer.Option("--api-key-env", metavar="NAME", help="openai: the environment variable holding the API key (never recorded).")] = None,
        chat: Annotated[bool, typer.Option("--chat", help="openai: /v1/chat/completions with one user message.")] = False,
        concurrency: Annotated[Optional[str], typer.Option("--concurrency", help="openai: requests in flight, e.g. 1,8,32 (its --vary-batch); each level is compared with 1.")] = None,
        cache_probe: Annotated[bool, typer.Option("--cache-probe", help="openai (check): each prompt cold, warm, and after a shared prefix; CACHE_VARIANCE on a difference.")] = False,
        as_json: Annotated[bool, typer.Option("--json", help="Print report.json instead of the verdict.")] = False,
        progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Progress bar on stderr.")] = True,
        sign_key: SignKey = None,
        junit: JUnit = None,
        ray: Annotated[Optional[str], typer.Option("--ray", metavar="ADDRESS", help="check: run the check on a Ray cluster (HOST:PORT of its head, or auto: RAY_ADDRESS), once per --per target, one N-way verdict (docs/ray.md).")] = None,
        per: Annotated[str, typer.Option("--per", help="with --ray: node, accelerator_type or resource:NAME: what each replica stands for.")] = "node",
        ship_model: Annotated[bool, typer.Option("--ship-model", help="with --ray: send the --model folder to every node by content hash, checked on arrival (docs/ray.md).")] = False,
        ray_test_hold: Annotated[Optional[str], typer.Option("--ray-test-hold", hidden=True)] = None,
    ) -> None:
        def body() -> int:
            from .. import api
            from ..core.config import Decoding, RunConfig, parse_options
            from ..core.prompts import resolve_prompts

            cfg = RunConfig(
                backend=backend, model=model, revision=api.tokenizer_revision_of(revision, tokenizer_revision) if tokenizer_revision else revision,
                dtype=dtype, device=device,
                decoding=Decoding(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k if sample_top_k is None else sample_top_k),
                seed=seed, tier=tier, mode=mode, batch_size=batch_size, vary_batch=concurrency_levels(vary_batch, concurrency, backend),
                runs=runs, fresh_process=fresh_process, negative_control=negative_control,
                require_engagement=require_engagement, max_rate=max_rate, confidence=confidence, fill_prompts=fill_prompts, logprobs=logprobs, record_prompt_text=prompt_text, threads=threads, atol=atol,
                options=parse_options((opt or []) + llama_bin_option(llama_bin, backend)
                                      + served_options(backend, (base_url or [None])[0], api_key_env, chat, cache_probe, command)),
            )
            if ray is not None:  # a check per node of a Ray cluster (cli/cluster.py)
                from .cluster import ray_check
                return ray_check(command, cfg, ray, per, ray_test_hold, base_url, prompts, prompt, prompt_file, out, as_json,
                                 junit, html, redact_env, redact_env_var, ship_model)
            if per != "node" or ship_model:
                raise UsageError(f"{'--ship-model' if ship_model else '--per'} applies to a --ray check: give --ray ADDRESS too")
            if base_url and len(base_url) > 1:  # a fleet: N endpoints, one N-way verdict (cli/fleet.py)
                return fleet_check(command, cfg, base_url, prompts, prompt, prompt_file, out, progress and not as_json,
                                   as_json, junit, html, redact_env, redact_env_var, reference_url)
            if reference_url is not None:
                raise UsageError("--reference-url names the reference replica of a fleet check (two or more --base-url)")
            check_output_file(junit, "--junit")  # before the run, not after it
            check_output_file(html, "--html")
            cfg.validate(command=command)
            prompt_set = resolve_prompts(prompts, texts=prompt or (), jsonl_file=prompt_file)
            with ProgressBar(progress and not as_json) as bar:
                outcome = getattr(api, command)(cfg, prompts=prompt_set, out=out, force=force, progress=bar, sign_key=sign_key,
                                                redact=redact_env, redact_env_vars=redact_env_var)
            write_html(outcome, html)
            return emit(outcome, as_json=as_json, junit=junit)

        guarded(body, detach=True)  # run after the parser is gone (shell.held_bodies)

    if command != "check":
        cmd.__annotations__["fresh_process"] = "FreshProcessHidden"
        cmd.__annotations__["negative_control"] = "NegativeControlHidden"
        cmd.__annotations__.update(HIDDEN)
    return cmd


def fleet_check(command, cfg, urls, prompts, prompt, prompt_file, out, progress, as_json, junit, html, redact, redact_vars,
                reference_url=None) -> int:
    """`check --base-url U1 --base-url U2 ...`: detllm.fleet.fleet_check, then the fleet's outputs."""
    from ..fleet.endpoints import fleet_check as run_fleet
    from ..core.prompts import resolve_prompts
    from .fleet import emit_fleet

    if command != "check":
        raise UsageError(f"several --base-url make a fleet check: use `detllm check`, not `detllm {command}`")
    check_output_file(junit, "--junit")
    check_output_file(html, "--html")
    prompt_set = resolve_prompts(prompts, texts=prompt or (), jsonl_file=prompt_file)
    with ProgressBar(progress) as bar:
        outcome = run_fleet(cfg, urls, prompt_set=prompt_set, out=out, progress=bar,
                            redact=redact, redact_env_vars=redact_vars, reference_url=reference_url)
    return emit_fleet(outcome, as_json=as_json, junit=junit, html=html)


def served_options(backend: str, base_url: str | None, key_env: str | None, chat: bool, cache_probe: bool, command: str) -> list[str]:
    """--base-url, --api-key-env, --chat and --cache-probe are the openai backend's `--opt`s."""
    given = [f for f, v in (("--base-url", base_url), ("--api-key-env", key_env), ("--chat", chat), ("--cache-probe", cache_probe)) if v]
    if given and backend != "openai":
        raise UsageError(f"{given[0]} applies to --backend openai, not {backend!r}")
    if cache_probe and command != "check":
        raise UsageError("--cache-probe is a check: use `detllm check --cache-probe`")
    return ([f"base_url={base_url}"] if base_url else []) + ([f"api_key_env={key_env}"] if key_env else []) \
        + (["chat=true"] if chat else []) + (["cache_probe=true"] if cache_probe else [])


def concurrency_levels(vary_batch: str | None, concurrency: str | None, backend: str) -> tuple[int, ...]:
    """--concurrency is the openai backend's spelling of --vary-batch: a batch is the requests in flight."""
    from ..core.config import parse_batch_list

    if concurrency is None:
        return parse_batch_list(vary_batch)
    if backend != "openai":
        raise UsageError(f"--concurrency applies to --backend openai (requests in flight), not {backend!r}", hint="use --vary-batch")
    if vary_batch is not None:
        raise UsageError("--concurrency and --vary-batch say the same thing: give one")
    try:
        return tuple(int(x) for x in concurrency.split(",") if x.strip())
    except ValueError as exc:
        raise UsageError(f"--concurrency expects comma-separated integers like 1,8,32, got {concurrency!r}") from exc


def llama_bin_option(path: Path | None, backend: str) -> list[str]:
    """--llama-bin is the llamacpp backend's `--opt bin=`, spelled as issue-tracker users expect."""
    if path is None:
        return []
    if backend != "llamacpp":
        raise UsageError(f"--llama-bin applies to --backend llamacpp, not {backend!r}")
    return [f"bin={path}"]


app.command("run", help="Generate once per batch size and write a run folder.")(_gen_command("run", 1))
app.command("check", help="Repeat runs, vary batch size, compare, and give a verdict CI can act on.")(_gen_command("check", 3))
