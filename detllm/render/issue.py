"""`detllm report --format issue`: a markdown block shaped for the engine's bug template.

Rendered from a run or diff folder (report.json, run_config.json, env.json,
determinism_applied.json and the divergent prompt's trace record): the verdict and first
divergence, the reproduction (`detllm replay`, and the equivalent raw engine call with
the exact input ids and sampling settings), and the environment fields the engine's
maintainers ask for (vLLM's collect_env, llama.cpp's version/build/command line), from
env.json only. Environment values go through env.redact_env again: secrets stay hidden.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
from pathlib import Path
from typing import Any, Iterator

from ..compare.causes import ADVICE, TITLES
from ..runfolder.env import REDACTED, redact_env
from .figures import chosen_logprobs, difference_text
from .paths import mask_paths
from .text import cause_summary

# env var families each engine's maintainers ask about (vLLM's collect_env prints these)
ENGINE_VARS = {
    "vllm": ("VLLM_", "CUBLAS", "NCCL", "CUDA_", "TORCH_", "PYTORCH_", "OMP_", "MKL_"),
    "llamacpp": ("LLAMA_", "GGML_", "OMP_", "CUDA_"),
    "hf": ("CUBLAS", "CUDA_", "TORCH_", "PYTORCH_", "OMP_", "MKL_", "TRANSFORMERS_", "TOKENIZERS_", "HF_"),
}
TEMPLATE = {
    "vllm": "vLLM's bug template (https://github.com/vllm-project/vllm/issues/new/choose): paste under "
            "'Your current environment' and 'Describe the bug'",
    "llamacpp": "llama.cpp's bug template (https://github.com/ggml-org/llama.cpp/issues/new/choose): paste under "
                "'Name and Version', 'Command line' and 'Problem description & steps to reproduce'",
    "hf": "transformers' bug template (https://github.com/huggingface/transformers/issues/new/choose): paste under "
          "'System Info' and 'Reproduction'",
}
_SECRET_ARG = re.compile(r"(?i)(key|token|secret|password|auth)")


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _fence(text: str, lang: str = "text") -> list[str]:
    fence = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`+", text)), default=0))
    return [fence + lang, text, fence]


def _record(folder: Path, run: int, batch: int, prompt_index: int) -> tuple[dict[str, Any] | None, int]:
    """The record of one prompt and its occurrence (earlier prompts with the same id), the seed rule's key."""
    from ..compare.trace import load_records

    trace = folder if folder.is_file() else folder / "trace.jsonl"
    if not trace.is_file():
        return None, 0
    try:
        recs, _ = load_records(trace, keep=lambda h: (h["run_index"], h["batch_size"]) == (run, batch)
                               and h["prompt_index"] <= prompt_index)
        target = next((r for r in recs if r["prompt_index"] == prompt_index), None)
        if target is None:
            return None, 0
        occurrence = sum(1 for r in recs if r["prompt_index"] < prompt_index and r["prompt_id"] == target["prompt_id"])
        return dict(target.load()), occurrence
    except Exception:  # noqa: BLE001 - the raw call is a convenience; the rest of the issue still renders
        return None, 0


def _is_pack(path: Path) -> bool:
    return path.is_file() and path.name.endswith((".tar.gz", ".tgz"))


@contextlib.contextmanager
def _opened(pack: Path) -> Iterator[Path | None]:
    """The pack extracted for the block (None when it cannot be read: the rest of the issue still renders)."""
    from ..runfolder.artifacts import open_run_path

    try:
        cm = open_run_path(pack)
        real = cm.__enter__()
    except Exception:  # noqa: BLE001 - a convenience: the issue renders without the pack's files
        yield None
        return
    try:
        yield real
    finally:
        cm.__exit__(None, None, None)


class _Side:
    """What one side's folder recorded (any of it may be missing: a diff's folders may be gone)."""

    def __init__(self, name: str, folder: Path | None, run: int, batch: int) -> None:
        self.name, self.folder, self.run, self.batch = name, folder, run, batch
        self.env = self.run_config = self.applied = None
        if folder is not None and folder.is_dir():
            self._read(folder)
        elif folder is not None and _is_pack(folder):
            with _opened(folder) as real:  # a pack-based diff: env and config are inside the pack
                if real is not None:
                    self._read(real)

    def _read(self, f: Path) -> None:
        self.env = _read(f / "env.json")
        self.run_config = _read(f / "run_config.json")
        self.applied = _read(f / "determinism_applied.json")

    @property
    def selection(self) -> str:
        return f"::run_{self.run}@batch_{self.batch}"

    @property
    def backend(self) -> str:
        return (self.run_config or {}).get("config", {}).get("backend", "unknown")


def _sides(report: dict[str, Any], folder: Path | None) -> list[_Side]:
    from ..compare.engine import parse_label

    s = report.get("summary", {})
    if report["command"] == "diff" and "left" in s:
        return [_Side(k, Path(s[k]["folder"]) if s[k].get("folder") else None, s[k]["run_index"], s[k]["batch_size"])
                for k in ("left", "right")]
    d = report["first_divergence"]
    run, batch = parse_label(d["right"]["label"]) if d else (0, (report.get("summary", {}).get("batch_sizes") or [1])[0])
    return [_Side("run", folder, run, batch)]


# ------------------------------------------------------------------ sections


def _verdict(report: dict[str, Any]) -> list[str]:
    tier = report["tier"]
    lines = [f"**detllm {report['command']}: {report['status']}** (category `{report['category']}`, tier {tier['effective']}"
             + ("" if tier["requested"] == tier["effective"] else f", requested {tier['requested']}") + ")", ""]
    for c in report["comparisons"]:
        if c["status"] != "PASS":
            lines.append(f"- {c['status']} {c['name']}: {c['prompts_diverged']}/{c['prompts_compared']} prompts diverged"
                         + ("" if c["required"] else " (not required at this tier)"))
    d = report["first_divergence"]
    if d is not None:
        lps = dict(zip(("left", "right"), chosen_logprobs(d)))
        difference = difference_text(d, ".6g")

        def tok(x: dict[str, Any], side: str) -> str:
            if x["token_id"] is None:
                return "generation ended"
            return f"id {x['token_id']} {x['token_text']!r}" + (f" (logprob {lps[side]})" if lps[side] is not None else "")

        lines += ["", f"First divergence: prompt {d['prompt_index']}, generated token {d['token_index']} ({d['kind']})"
                  + (", a near tie" if d["near_tie"] else "") + ":", "",
                  f"- `{d['left']['label']}`: {tok(d['left'], 'left')}", f"- `{d['right']['label']}`: {tok(d['right'], 'right')}",
                  *([f"- the {difference}".replace("|", "\\|")] if difference else []),
                  "", "Common prefix:", "", *_fence(d["common_prefix_text"][-300:] or "(empty)")]
    if report["causes"]:
        lines += ["", "Causes detllm ranked (most likely first):", ""]
        lines += [f"{n}. `{c['code']}` ({TITLES[c['code']]}): {cause_summary(c)}" for n, c in enumerate(report["causes"], 1)]
        lines += ["", f"detllm's advice: {ADVICE[report['causes'][0]['code']]}"]
    return lines


def _env_lines(side: _Side) -> list[str]:
    env = side.env
    if env is None:
        return [f"(env.json of {side.name} is not at hand)"]
    b = {**(env.get("kernels") or {}), **(env.get("backend") or {})}  # hardware facts (device_name...) moved to env.kernels
    t = env.get("torch") or {}
    libs = {k: v for k, v in (env.get("libraries") or {}).items() if v}
    out = [f"detllm: {env.get('detllm')}",
           f"OS: {env['os']['system']} {env['os']['release']} {env['os']['machine']} ({env['os'].get('libc') or 'libc unknown'})",
           f"Python: {env['python']['version']} ({env['python']['implementation']})",
           f"CPU: {env['cpu']['model']} ({env['cpu']['usable_cores']} usable of {env['cpu']['logical_cores']} cores; "
           f"ISA {', '.join(k for k, v in env['cpu']['isa'].items() if v) or 'unknown'})",
           "Libraries: " + ", ".join(f"{k}=={v}" for k, v in libs.items())]
    if t:
        out.append(f"PyTorch: {t.get('version')} (CUDA {t.get('cuda') or 'none'}, cuDNN {t.get('cudnn') or 'none'}, "
                   f"debug {t.get('debug')}, MKL {t.get('mkl')}, OpenMP {t.get('openmp')}, deterministic algorithms "
                   f"{t.get('deterministic_algorithms')}, TF32 matmul {t.get('tf32_matmul')})")
    gpus = env.get("gpus") or []
    out.append("GPU: " + ("; ".join(f"{g['name']} (compute capability {g['compute_capability']}, driver {g.get('driver') or 'unknown'})"
                                    for g in gpus) or "none visible"))
    threads = {k: v for k, v in (env.get("threads") or {}).items() if v is not None}
    if threads:
        out.append("Threads: " + ", ".join(f"{k}={v}" for k, v in threads.items()))
    engine = side.backend
    if engine == "llamacpp":
        out += [f"llama.cpp version: {b.get('version')}", f"llama.cpp build_info (/props): {b.get('build_info')}",
                f"package: {b.get('package')}", f"llama-server sha256: {b.get('binary_sha256')}",
                f"n_ctx: {b.get('n_ctx')}, total_slots: {b.get('total_slots')}",
                "command line: llama-server " + " ".join(_sh(_safe_arg(a)) for a in b.get("argv") or [])]
    elif engine == "vllm":
        out += [f"vLLM: {b.get('distribution')} {b.get('version')} ({b.get('build')} build; git sha not recorded by the wheel)",
                f"platform: {b.get('platform')}, device: {b.get('device_name')}, attention backend: {b.get('attention_backend')}, "
                f"batch-invariant mode supported: {b.get('batch_invariant_supported')}"]
        if b.get("cpu_kernels"):
            out.append(f"vLLM CPU kernels: {b['cpu_kernels']}")
    elif b:
        out.append("engine: " + ", ".join(f"{k}={v}" for k, v in b.items()))
    prefixes = ENGINE_VARS.get(engine, ())
    env_vars = redact_env(env.get("env_vars") or {})  # again: a pack from elsewhere may predate a redaction rule
    shown = {k: v for k, v in env_vars.items() if k.startswith(prefixes)} if prefixes else env_vars
    out.append("Environment variables: " + (", ".join(f"{k}={v}" for k, v in shown.items()) or "none of " + "/".join(prefixes) + "*"))
    return out


def _sh(arg: str) -> str:
    """One shell word, its path shown as mask_paths shows it; `~/` left unquoted, so the shell expands it."""
    arg = mask_paths(arg)
    return "~/" + shlex.quote(arg[2:]) if arg.startswith("~/") else shlex.quote(arg)


def _py_path(path: str) -> str:
    """A model path as a Python expression, shown as mask_paths shows it (`~` expanded at run time)."""
    shown = mask_paths(path)
    return f"os.path.expanduser({shown!r})" if shown.startswith("~") else repr(shown)


def _safe_arg(arg: str) -> str:
    return REDACTED if _SECRET_ARG.search(arg) and "=" in arg else arg


def _raw_call(side: _Side, record: dict[str, Any] | None, occurrence: int = 0) -> list[str]:
    """The engine call detllm made for the divergent prompt, without detllm."""
    cfg = (side.run_config or {}).get("config")
    if cfg is None:
        return []
    dec = cfg["decoding"]
    model = (side.run_config or {}).get("model", {})
    ids = record.get("input_ids") if record else None
    ids_text = json.dumps(ids) if ids is not None else "[...]  # input ids not recorded (--no-prompt-text): tokenize the prompt"
    seed = cfg["seed"]
    if record is not None and dec["temperature"] > 0:
        from ..backends.base import Request, request_seed

        seed = request_seed(cfg["seed"], Request(record["prompt_index"], tuple(ids or ()), prompt_id=record["prompt_id"],
                                                     occurrence=occurrence))
    engine = cfg["backend"]
    if engine == "llamacpp":
        argv = ((side.env or {}).get("backend") or {}).get("argv") or []
        applied = {x["name"]: x for x in (side.applied or {}).get("settings", [])}
        greedy = dec["temperature"] == 0
        body = {"prompt": ids if ids is not None else "<input ids>", "n_predict": dec["max_new_tokens"],
                "seed": applied.get("seed", {}).get("value", seed),  # the server's seed as detllm applied it
                "temperature": dec["temperature"], "top_k": dec["top_k"], "top_p": dec["top_p"],
                "samplers": ["temperature"] if greedy else ["top_k", "temperature", "top_p"],
                "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0, "repeat_last_n": 0, "presence_penalty": 0.0,
                "frequency_penalty": 0.0, "dry_multiplier": 0.0, "xtc_probability": 0.0, "mirostat": 0,
                "n_probs": cfg.get("logprobs", cfg.get("logprobs_top_k")), "post_sampling_probs": False, "return_tokens": True,
                "cache_prompt": bool(applied.get("cache_prompt", {}).get("value", False)), "stream": False}
        server = "llama-server " + " ".join(_sh(_safe_arg(a).replace("<port>", "8080")) for a in argv)
        return ["Raw llama.cpp call (the same server flags and /completion body detllm used):", "",
                *_fence(f"{server} &\ncurl -s http://127.0.0.1:8080/completion -H 'Content-Type: application/json' \\\n"
                        f"  -d {shlex.quote(json.dumps(body))}", "bash")]
    if engine == "vllm":
        applied = {x["name"]: x.get("value") for x in (side.applied or {}).get("settings", []) if x.get("applied")}
        env_vars = {k: v for k, v in applied.items() if k.isupper() and isinstance(v, str)}
        kv = ((side.env or {}).get("env_vars") or {}).get("VLLM_CPU_KVCACHE_SPACE")
        if kv is not None and kv != REDACTED:
            env_vars["VLLM_CPU_KVCACHE_SPACE"] = kv
        llm_kw = {"max_model_len": applied.get("max_model_len"), "max_num_seqs": applied.get("max_num_seqs"),
                  "enforce_eager": applied.get("enforce_eager"), "enable_prefix_caching": applied.get("prefix_caching"),
                  "tensor_parallel_size": applied.get("tensor_parallel_size")}
        extra = "".join(f", {k}={v!r}" for k, v in llm_kw.items() if v is not None)
        code = ("import os\n" + "".join(f"os.environ[{k!r}] = {v!r}\n" for k, v in sorted(env_vars.items()))
                + "from vllm import LLM, SamplingParams\n"
                f"llm = LLM(model={_py_path(model.get('path') or cfg['model'])}, dtype={cfg['dtype']!r}, seed=0{extra}, "
                "logprobs_mode='raw_logprobs')\n"
                f"params = SamplingParams(temperature={dec['temperature']}, top_p={dec['top_p']}, top_k={dec['top_k']}, "
                f"max_tokens={dec['max_new_tokens']}, seed={seed}, logprobs={cfg['logprobs']})\n"
                f"out = llm.generate([{{'prompt_token_ids': {ids_text.split('  #')[0]}}}], params)\n"
                "print(out[0].outputs[0].token_ids)")
        return ["Raw vLLM call (offline engine, as detllm ran it):", "", *_fence(code, "python")]
    if engine == "hf":
        greedy = dec["temperature"] == 0
        attn = ((side.env or {}).get("backend") or {}).get("attn_implementation")
        where = _py_path(model.get("path") or cfg["model"])
        code = (("import os\n" if where.startswith("os.") else "") + "import torch\nfrom transformers import AutoModelForCausalLM\n"
                f"model = AutoModelForCausalLM.from_pretrained({where}, dtype=torch."
                f"{cfg['dtype'] if cfg['dtype'] != 'auto' else 'float32'}" + (f", attn_implementation={attn!r}" if attn else "") + ")\n"
                f"torch.manual_seed({seed})\nids = torch.tensor([{ids_text.split('  #')[0]}])\n"
                f"out = model.generate(ids, max_new_tokens={dec['max_new_tokens']}, do_sample={not greedy}"
                + ("" if greedy else f", temperature={dec['temperature']}, top_p={dec['top_p']}, top_k={dec['top_k']}")
                + ", output_scores=True, return_dict_in_generate=True)\nprint(out.sequences[0, ids.shape[1]:].tolist())")
        return ["Raw transformers call (detllm's own decode loop is equivalent to greedy generate):", "", *_fence(code, "python")]
    return []


def _applied(side: _Side) -> list[str]:
    a = side.applied
    if not a:
        return []
    rows = [f"| {s['name']} | `{json.dumps(s.get('value'))}` | {s.get('applied')} |" for s in a.get("settings", [])]
    return ["", f"Determinism settings applied ({side.name}, tier {a.get('tier_effective')} of {a.get('tier_requested')} requested):",
            "", "| setting | value | applied |", "|---|---|---|", *rows]


def _judged_as(report: dict[str, Any]) -> str:
    """The tier (and tolerance) the diff was judged at, so the printed command reaches the same verdict:
    a batch 1 vs 8 diff run with --tier 3 PASSes at its default tier."""
    tier = (report.get("tier") or {}).get("requested")
    summary = report.get("summary")
    atol = summary.get("atol") if isinstance(summary, dict) else None
    return (f" --tier {tier}" if tier else "") + (f" --atol {atol!r}" if atol else "")


def render_issue(report: dict[str, Any], folder: Path | None) -> str:
    """The markdown block. `folder`: where report.json was read (a run folder, or a diff folder)."""
    sides = _sides(report, Path(folder) if folder is not None else None)
    engines = [s.backend for s in sides]
    engine = next((e for e in engines if e in ("vllm", "llamacpp")), engines[0])
    d = report["first_divergence"]
    cat = "" if report["category"] in (report["status"], "PASS") else f" {report['category']}"
    title = f"[detllm] {report['command']} {report['status']}{cat}: " + " vs ".join(dict.fromkeys(engines))
    if d is not None:
        title += f", prompt {d['prompt_index']} diverges at generated token {d['token_index']}"
    lines = [f"<!-- {TEMPLATE.get(engine, 'the engine bug template')} -->", f"### {title}", "", "#### Describe the bug", ""]
    lines += _verdict(report)
    from .locate import issue_lines, load_located

    located = load_located(folder)  # detllm locate's finding, sealed with the folder
    if located is not None:
        lines += ["", *issue_lines(located)]
    lines += ["", "#### Your current environment", ""]
    for side in sides:
        lines += [f"{side.name} ({side.backend}):", "", *_fence("\n".join(_env_lines(side)))]
    lines += ["", "#### Reproduce", ""]
    target = folder if report["command"] != "diff" else None
    extras = ",".join(dict.fromkeys(x for x in ({"hf": "hf", "llamacpp": "hf", "vllm": "vllm", "openai": "openai"}.get(e) for e in engines) if x))
    install = (f"detllm from its repository (in a clone: `pip install -c constraints.txt {shlex.quote(f'.[{extras}]' if extras else '.')}`; "
               "PyPI's `detllm` is the older 0.1, which cannot read these packs)")  # docs/ci.md#install
    if target is not None:
        lines += [f"With {install}, from the pack of this run (`detllm pack {shlex.quote(str(target))} -o pack.tar.gz`, attached):",
                  "", *_fence(f"detllm verify pack.tar.gz && detllm replay pack.tar.gz", "bash")]
    elif len(sides) == 2 and sides[0].folder is not None and sides[1].folder is not None and \
            sides[0].folder.resolve() == sides[1].folder.resolve():  # two selections of one run (batch 1 vs batch 8)
        l, r = sides
        lines += [f"With {install}, from the pack of the run both sides come from (`detllm pack FOLDER -o pack.tar.gz`, attached):",
                  "", *_fence("detllm verify pack.tar.gz && detllm replay pack.tar.gz\n"
                              f"detllm diff pack.tar.gz{l.selection} pack.tar.gz{r.selection}{_judged_as(report)}", "bash")]
    else:
        l, r = sides
        lines += [f"With {install}, from the packs of the two runs (`detllm pack FOLDER -o left.tar.gz`, and right), attached:", "",
                  *_fence("detllm replay left.tar.gz && detllm replay right.tar.gz\n"
                          f"detllm diff left.tar.gz{l.selection} right.tar.gz{r.selection}{_judged_as(report)}", "bash")]
    for side in sides:
        rec, occurrence = None, 0
        if side.folder is not None:  # the divergent prompt, else the first prompt of the first run
            from ..compare.engine import parse_label

            label = d["left"]["label"] if d is not None and side.name == "left" else d["right"]["label"] if d is not None else None
            run, batch = (side.run, side.batch) if report["command"] == "diff" or label is None else parse_label(label)
            if _is_pack(side.folder):
                with _opened(side.folder) as real:
                    rec, occurrence = _record(real, run, batch, d["prompt_index"] if d is not None else 0) if real else (None, 0)
            else:
                rec, occurrence = _record(side.folder, run, batch, d["prompt_index"] if d is not None else 0)
        raw = _raw_call(side, rec, occurrence)
        if raw:
            lines += ["", *raw]
        lines += _applied(side)
    return mask_paths("\n".join(lines)) + "\n"  # the whole text: no path under a home or temporary folder
