"""The `llamacpp` backend's capture (`detllm locate`): run detllm-dump (our libllama program, built
next to llama-server by scripts/build_llamacpp.sh) on one recorded sequence, read the raw tensors
it wrote at the chosen step, name them in Hugging Face naming (names.py), add each layer's attention
op with its cached K/V, and evaluate each op in float64 (the tolerance). A batch is re-run as
llama-server scheduled it and the prompt's rows cut out (rows.py); a graft is written by the dumper.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ...core.errors import BackendError, BackendUnavailableError, UsageError
from ..capture import Capture, CapturedTensor, CaptureSpec
from . import rows as batchrows
from .names import UNPERMUTED_ARCHS, NameMap, node_name, unpermute

DUMPER = "detllm-dump"
DUMP_FORMAT, DUMP_VERSION = "detllm-dump", 2  # 2: "rows", "sequences", "row", "graft" (a batch, the graft)
LAYER_KINDS = ("embedding", "layer", "logits")  # what a "layers" capture keeps
# what the dumper is asked for: a "layers" capture needs the embedding, the boundaries and the logits;
# a "modules" one every activation, less the views/reshapes of nodes captured anyway and the cache
# writes (SET_ROWS: the whole KV cache); the cache views attention reads are kept (past K/V)
LAYER_NODES = (r"^(inp_)?embd$", r"^l_out-\d+$", r"^result_output$")
SKIP_NODES = (r"^(?!cache_).*\(view\)", r"\((permuted|reshaped|transposed|cont)\)")
SKIP_OPS = ("SET_ROWS",)
KV_INPUTS = ["query", "key", "value", "past_keys", "past_values"]
REBUILD_HINT = "rebuild llama.cpp with scripts/build_llamacpp.sh: it builds detllm-dump next to llama-server"


def find_dumper(server: Path) -> Path:
    """detllm-dump in llama-server's folder (the build script puts both there)."""
    dumper = server.parent / DUMPER
    if not dumper.is_file():
        raise BackendUnavailableError(f"{server.parent} has no {DUMPER}: this llama.cpp build cannot capture tensors",
                                      hint=REBUILD_HINT)
    return dumper


@dataclass
class Dump:
    """What one detllm-dump run wrote: its index (index.json) and the tensors' float32 data."""

    index: dict[str, Any]
    records: list[dict[str, Any]]  # index["tensors"], each with "data" (numpy array, reversed ne) or None
    logits: Any  # numpy float32 [step + 1, n_vocab]: the last row's logits at each step
    argv: list[str] = field(default_factory=list)


def run_dump(dumper: Path, gguf: Path, prompt: Sequence[int], forced: Sequence[int], step: int, settings: dict[str, Any],
             patterns: Sequence[str] = (), skips: Sequence[str] = (), skip_ops: Sequence[str] = (),
             timeout: float = 600.0, batch: Sequence[Sequence[int]] = (), gens: Sequence[Sequence[int]] = (), row: int = 0,
             extra: Sequence[str] = ()) -> Dump:
    """Run detllm-dump on one sequence (or a `batch`: every row's prompt, `gens` every row's generated
    tokens, `row` the one captured) and read what it wrote. `settings` mirror llama-server's:
    threads, threads_batch, n_ctx, n_seq, batch, ubatch, flash_attn, kv_type (None: the default)."""
    argv = [str(dumper), "-m", str(gguf), "--tokens", batchrows.ids(batch if len(batch) > 1 else [prompt]), "--step", str(step)]
    if len(batch) > 1:
        argv += ["--forced", batchrows.ids(gens), "--row", str(row)]
    elif step:
        argv += ["--forced", ",".join(str(int(t)) for t in forced[:step])]
    for flag, key in (("-t", "threads"), ("-tb", "threads_batch"), ("-c", "n_ctx"), ("-np", "n_seq"), ("-b", "batch"),
                      ("-ub", "ubatch"), ("-fa", "flash_attn"), ("-ctk", "kv_type"), ("-ctv", "kv_type")):
        if settings.get(key) is not None:
            argv += [flag, str(settings[key])]
    for p in patterns:
        argv += ["--match", p]
    for p in skips:
        argv += ["--skip", p]
    for op in skip_ops:
        argv += ["--skip-op", op]
    argv += list(extra)
    with tempfile.TemporaryDirectory(prefix="detllm-dump-") as out:
        try:
            proc = subprocess.run([*argv, "--out", out], capture_output=True, text=True, timeout=timeout, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BackendError(f"{DUMPER} failed: {exc.__class__.__name__}: {exc}") from exc
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
            raise BackendError(f"{DUMPER} failed (exit code {proc.returncode}): {tail}")
        dump = read_dump(Path(out))
    dump.argv = argv[1:]
    return dump


def read_dump(folder: Path) -> Dump:
    """index.json, tensors.bin and logits.bin of a dump folder; BackendError for a malformed one."""
    import numpy as np

    try:
        index = json.loads((folder / "index.json").read_text())
        size = (folder / "tensors.bin").stat().st_size  # mapped, not read: only what a capture keeps is copied
        data = np.memmap(folder / "tensors.bin", dtype=np.float32, mode="r") if size else np.zeros(0, np.float32)
        logits = np.fromfile(folder / "logits.bin", dtype=np.float32)
    except (OSError, ValueError) as exc:
        raise BackendError(f"{DUMPER} wrote an unreadable dump: {exc}") from exc
    if index.get("format") != DUMP_FORMAT or index.get("version") != DUMP_VERSION:
        raise BackendError(f"{DUMPER} wrote format {index.get('format')!r} version {index.get('version')!r}, "
                           f"expected {DUMP_FORMAT!r} version {DUMP_VERSION}", hint=REBUILD_HINT)
    n_vocab, step = int(index["n_vocab"]), int(index["step"])
    if logits.size != (step + 1) * n_vocab:
        raise BackendError(f"{DUMPER} wrote {logits.size} logits, expected {(step + 1) * n_vocab}")
    records = index["tensors"]
    for rec in records:
        ne = [int(n) for n in rec["ne"]]
        rec["data"] = None
        if rec.get("offset") is not None:
            first, count = int(rec["offset"]) // 4, ne[0] * ne[1] * ne[2] * ne[3]
            if first + count > data.size or int(rec["nbytes"]) != 4 * count:
                raise BackendError(f"{DUMPER}: tensor {rec['name']!r} lies outside tensors.bin")
            rec["data"] = data[first:first + count].reshape(ne[3], ne[2], ne[1], ne[0])
    batchrows.cut(index, records)  # a batch: the captured row's rows only
    return Dump(index, records, logits.reshape(step + 1, n_vocab))


def _rows(data: Any) -> Any:
    """A node's data (reversed ne: [ne3, ne2, ne1, ne0]) as [rows, features] (ne1 the token axis),
    keeping ne2/ne3 only where they are not 1."""
    a = data
    while a.ndim > 2 and a.shape[0] == 1:
        a = a[0]
    return a


def tensors(dump: Dump, spec: CaptureSpec, arch: str, n_head: int, n_head_kv: int, known: Sequence[str] = ()) -> tuple[list[CapturedTensor], list[str]]:
    """The dump's nodes that a rule names, as CapturedTensor records (ubatches of the prompt joined
    along the token axis), in capture order; and notes on what was left out."""
    import numpy as np

    idx = dump.index
    notes: list[str] = []
    try:
        names = NameMap(arch, int(idx["n_layer"]), known)
    except BackendUnavailableError as exc:
        names = NameMap("", 0)
        notes.append(f"modules other than layer boundaries not named: {exc.message}")
    evals = [list(range(int(first), int(first) + int(n))) for first, n in idx["evals"]]  # positions per evaluation
    by_name: dict[tuple[int, str], dict[str, Any]] = {}  # (eval, node name) -> the latest record so named
    groups: dict[str, dict[str, Any]] = {}
    taken: set[tuple[str, int]] = set()
    for rec in sorted(dump.records, key=lambda r: r["order"]):
        by_name[(rec["eval"], rec["name"])] = rec
        named = node_name(rec, names)
        if named is None or rec["data"] is None:
            continue
        hf, kind, base = named
        if (spec.level == "layers" and kind not in LAYER_KINDS) or (hf, rec["eval"]) in taken:
            continue  # one node per module and evaluation: the first that reads its weight (llama.cpp
            # also embeds the tokens a second time, for its multi-token-prediction input)
        taken.add((hf, rec["eval"]))
        positions = evals[rec["eval"]] if rec["eval"] < len(evals) else []
        rows = _rows(rec["data"])
        if rows.shape[-2] != len(positions):  # the last layer keeps only the rows that yield logits
            positions = positions[len(positions) - rows.shape[-2]:] if rows.shape[-2] <= len(positions) else []
        if base is not None and base.endswith(("attn_q", "attn_k")) and arch in UNPERMUTED_ARCHS:
            rows = unpermute(rows, n_head if base.endswith("attn_q") else n_head_kv)
        in_shapes: list = []
        inputs = _inputs(rec, hf, kind, by_name, names, in_shapes)
        g = groups.setdefault(hf, {"kind": kind, "order": rec["order"], "out": [], "inputs": [], "positions": [],
                                   "in_shapes": [], "out_shapes": []})
        g["out"].append(rows)
        g["inputs"].append(inputs)
        g["positions"] += positions
        g["in_shapes"].append(in_shapes)
        g["out_shapes"].append(_whole(rec))
        if base is not None and base.endswith("attn_output") and sum(1 for e in evals if e) == 1 and inputs:
            _attention(groups, rec, hf, inputs[0], by_name, fa=any(r["op"] == "FLASH_ATTN_EXT" for r in dump.records),
                       positions=positions, prompt_len=len(idx["prompt"]),
                       heads=(n_head, n_head_kv), unperm=arch in UNPERMUTED_ARCHS, reference=spec.reference)
    out: list[CapturedTensor] = []
    for hf, g in sorted(groups.items(), key=lambda kv: kv[1]["order"]):
        join = (lambda parts: parts[0]) if len(g["out"]) == 1 else (lambda parts: np.concatenate(parts, axis=-2))
        ins = [join([ins[k] for ins in g["inputs"]]) for k in range(min(len(i) for i in g["inputs"]))]
        out.append(CapturedTensor(name=hf, kind=g["kind"], order=len(out), output=join(g["out"]), inputs=ins,
                                  input_shapes=[_batch_shape([s[k] for s in g["in_shapes"]]) for k in range(len(ins))],
                                  output_shape=_batch_shape(g["out_shapes"]), positions=list(g["positions"]),
                                  input_names=g.get("names", []), cached_steps=g.get("cached", []), ref_error=g.get("ref")))
    if spec.level != "layers":
        notes.append("llama.cpp modules are the graph nodes that read a weight (embedding, norms, q/k/v/o, gate/up/down, "
                     "lm_head), the layer boundaries and each layer's attention op (self_attn/attention: its output is "
                     "o_proj's input; inputs roped query/key, value and the cached K/V); no softmax, activation or rotary "
                     "internals")
        if sum(1 for e in evals if e) > 1:  # the evaluations holding the captured sequence's rows (a batch has others)
            notes.append(f"attention ops not captured: the step's rows ran in {sum(1 for e in evals if e)} ubatches")
    return out, notes


def _attention(groups: dict, o_proj: dict[str, Any], o_name: str, out: Any, by_name: dict, *, fa: bool,
               positions: list[int], prompt_len: int, heads: tuple[int, int], unperm: bool, reference: bool) -> None:
    """The attention op of o_proj's layer as one more record, `model.layers.N.self_attn/attention`:
    output = o_proj's input; inputs = the roped query and key, the value, and at a decode step the
    cached keys/values of the positions before this one (the cache view it read: cell i holds
    position i of the one sequence; the V cache is stored transposed without flash attention). Roped
    q/k are un-permuted like the projections (`unperm`), which puts rope's pairs where HF has them.
    `reference`: ref_error against a float64 causal softmax(q k^T / sqrt(d)) v on those inputs."""
    ev, layer, first = o_proj["eval"], o_name.split(".")[2], positions[0] if positions else 0
    get = {k: by_name.get((ev, n)) for k, n in (("q", f"Qcur-{layer}"), ("k", f"Kcur-{layer}"), ("v", f"Vcur-{layer}"),
                                                ("kc", f"cache_k_l{layer} (view)"), ("vc", f"cache_v_l{layer} (view)"))}
    if any(r is None or r["data"] is None for r in get.values()) or get["q"]["op"] != "ROPE" or get["k"]["op"] != "ROPE":
        return

    def flat(a: Any, n_heads: int | None) -> Any:  # [..., heads, head_dim] -> [..., heads * head_dim]
        a = a.reshape(*a.shape[:-2], a.shape[-2] * a.shape[-1])
        return unpermute(a, n_heads) if n_heads else a

    q, k, v = (get[x]["data"][0] for x in "qkv")  # [tokens, heads, head_dim]
    kc = get["kc"]["data"][0]  # [cells, heads, head_dim]
    vc = get["vc"]["data"][0] if fa else get["vc"]["data"][0].transpose(2, 1, 0)
    n_q, n_kv = heads
    inputs = [flat(q, n_q if unperm else None), flat(k, n_kv if unperm else None), flat(v, None)]
    if first:
        inputs += [flat(kc[:first], n_kv if unperm else None), flat(vc[:first], None)]
    ref = None
    if reference:  # float64 softmax(q k^T / sqrt(d)) v over the cached and current positions, causal
        import numpy as np

        d = q.shape[-1]
        keys = np.concatenate([kc[:first], k]).astype(np.float64)
        vals = np.concatenate([vc[:first], v]).astype(np.float64)
        kv_head = np.arange(n_q) // (n_q // n_kv)
        scores = np.einsum("thd,nhd->htn", q.astype(np.float64), keys[:, kv_head]) / np.sqrt(d)
        key_pos = np.array(list(range(first)) + list(positions))
        scores[:, np.array(positions)[:, None] < key_pos[None, :]] = -np.inf
        w = np.exp(scores - scores.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        expect = np.einsum("htn,nhd->thd", w, vals[:, kv_head]).reshape(out.shape)
        ref = float(np.max(np.abs(out.astype(np.float64) - expect))) if out.size else 0.0
    groups[o_name.rsplit(".", 1)[0] + "/attention"] = {"ref": ref,
        "kind": "attention", "order": o_proj["order"] - 0.5, "out": [out], "inputs": [inputs], "positions": list(positions),
        "in_shapes": [[_flat_whole(get[x], a) for x, a in zip("qkv", inputs)] + [(1, *a.shape) for a in inputs[3:]]],
        "out_shapes": [(1, *out.shape) if "whole" not in get["q"] else (1, get["q"]["whole"][0], out.shape[-1])],
        "names": KV_INPUTS[:len(inputs)],
        "cached": [0 if p < prompt_len else p - prompt_len + 1 for p in range(first)]}


def _flat_whole(rec: dict[str, Any], a: Any) -> tuple[int, ...]:
    """A roped q/k or v node's whole shape ([tokens, heads, head_dim], every sequence's rows) as [1, tokens, features]."""
    w = rec.get("whole")
    return (1, *a.shape) if w is None else (1, w[0], a.shape[-1])


def _batch_shape(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The shapes of one module's evaluations ([1, tokens, ...] each) as one: tokens summed."""
    return (1, sum(s[1] for s in shapes), *shapes[0][2:]) if shapes and len(shapes[0]) >= 3 else (shapes[0] if shapes else ())


def _whole(rec: dict[str, Any]) -> tuple[int, ...]:
    """A node's shape as the engine computed it, [1, rows, ...] (a batch: every sequence's rows, before the cut)."""
    return (1, *rec.get("whole", _rows(rec["data"]).shape))


def _inputs(rec: dict[str, Any], hf: str, kind: str, by_name: dict, names: NameMap, shapes: list | None = None) -> list[Any]:
    """The captured activations a node read (weights left out): a layer boundary's input is the previous
    boundary (or the embedding), a norm's is what its RMS_NORM read, a matmul's its activation operand.
    `shapes` collects each one's whole shape (_whole)."""
    ev = rec["eval"]
    shapes = [] if shapes is None else shapes
    if kind == "layer":
        n = int(hf.rsplit(".", 1)[1])
        prev = by_name.get((ev, f"l_out-{n - 1}")) if n else (by_name.get((ev, "inp_embd")) or by_name.get((ev, "embd")))
        if prev is None or prev["data"] is None:
            return []
        shapes.append(_whole(prev))
        return [_rows(prev["data"])]
    found = []
    for src in rec["src"]:
        if names.module(src["name"]) is not None or src["name"].endswith(".weight"):
            continue
        wanted = src["src"][0] if src["op"] == "RMS_NORM" and src["src"] else src["name"]
        got = by_name.get((ev, wanted))
        if got is not None and got["data"] is not None:
            found.append(_rows(got["data"]))
            shapes.append(_whole(got))
    return found


def capture_sequence(backend: Any, requests: Sequence[Any], decoding: Any, *, seed: int, n_logprobs: int,
                     spec: CaptureSpec) -> Capture:
    """LlamaCppBackend.capture: the server re-runs the one request up to spec.step (the generations
    locate checks against the trace), then detllm-dump computes the same sequence with the server's
    settings, feeding the server's tokens, and writes the nodes of step spec.step."""
    import numpy as np

    if not 0 <= spec.row < len(requests):
        raise UsageError(f"row {spec.row} is not a row of this batch of {len(requests)}")
    if backend.device != "cpu":
        raise BackendUnavailableError(f"llama.cpp capture computes on the CPU; this run used {backend.device!r}",
                                      hint="locate a --device cpu llamacpp run")
    dumper = find_dumper(backend.binary)
    cut = dataclasses.replace(decoding, max_new_tokens=min(decoding.max_new_tokens, spec.step + 1))
    gens = backend.generate(requests, cut, seed=seed, n_logprobs=n_logprobs, logprobs=n_logprobs > 0)
    tokens = list(gens[spec.row].token_ids)
    if len(tokens) <= spec.step:
        raise UsageError(f"the re-run stopped after {len(tokens)} tokens; step {spec.step} was not reached")
    settings = backend.dump_settings()
    layers = spec.level == "layers"
    meta, arch = backend.info.metadata, backend.info.architecture
    n_head = int(meta.get(f"{arch}.attention.head_count") or 1)
    n_head_kv = int(meta.get(f"{arch}.attention.head_count_kv") or n_head)
    prompt = requests[spec.row].input_ids
    with tempfile.TemporaryDirectory(prefix="detllm-graft-") as tmp:
        extra, graft_note = batchrows.graft_args(spec, backend.info, Path(tmp), (n_head, n_head_kv), len(prompt) + spec.step - 1)
        dump = run_dump(dumper, backend.gguf, prompt, tokens[:spec.step], spec.step, settings,
                        patterns=LAYER_NODES if layers else (), skips=SKIP_NODES, skip_ops=SKIP_OPS,
                        batch=[r.input_ids for r in requests], gens=[g.token_ids for g in gens], row=spec.row, extra=extra)
    meta, arch = backend.info.metadata, backend.info.architecture
    n_head = int(meta.get(f"{arch}.attention.head_count") or 1)
    n_head_kv = int(meta.get(f"{arch}.attention.head_count_kv") or n_head)
    level = "layers" if layers else "modules"
    found, notes = tensors(dump, dataclasses.replace(spec, level=level), arch, n_head, n_head_kv)
    if spec.reference and level != "layers":
        eps = float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon") or 1e-5)
        notes += reference_errors(found, backend.gguf, backend.info, n_head, n_head_kv, eps,
                                  [*prompt, *tokens[:spec.step]])
    if level != "layers" and sum(int(t.output.nbytes) + sum(int(i.nbytes) for i in t.inputs) for t in found) > spec.max_bytes:
        found = [dataclasses.replace(t, order=k) for k, t in enumerate(t for t in found if t.kind in LAYER_KINDS)]
        level = "layers"
        notes.append(f"past the {spec.max_bytes} byte bound: layer boundaries only")
    for t in found:  # own copies of what is kept (the rest of the mapped dump is never read into memory)
        t.output, t.inputs = np.array(t.output), [np.array(i) for i in t.inputs]
    # does the dumper's forward reproduce the server's? The server's top-k logprobs share one float32
    # softmax sum (summed in an order we cannot replay; on a 49k vocabulary it is off by ~2e-4), so
    # compare the gaps to the best entry, where the sum cancels: logprob_j - logprob_0 = logit_j - logit_0
    drift = None
    if gens[spec.row].top_logprobs:
        drift = max((abs((lp - top[0][1]) - float(dump.logits[i][tok] - dump.logits[i][top[0][0]]))
                     for i, top in enumerate(gens[spec.row].top_logprobs[:spec.step + 1]) for tok, lp in top), default=None)
    greedy_same = [int(t) for t in dump.index["argmax"]] == tokens[:spec.step + 1]
    notes += [f"a batch of {len(requests)}: detllm-dump re-ran it as llama-server schedules its slots (row i on slot i, "
              "each iteration the generating slots' tokens then the prompts, up to -b tokens, split into the ubatches "
              f"llama_decode makes) and row {spec.row}'s rows were cut out of each graph evaluation" if len(requests) > 1 else
              "one sequence, re-run by llama-server (the generations) and by detllm-dump (the tensors) with the same "
              "settings",
              "RMS_NORM nodes are never captured (a cut there would undo the CPU backend's RMS_NORM+MUL fusion); "
              "a norm module is its MUL with the norm weight"]
    if settings.get("threads") is None:
        notes.append("llama-server did not log its thread count: detllm-dump ran with 1 thread, perhaps not the server's")
    if arch not in UNPERMUTED_ARCHS:
        notes.append(f"q/k outputs are in GGUF's row order: no un-permute rule for architecture {arch!r}")
    if graft_note:
        notes.append(graft_note(dump.index.get("graft") or {}))
    engine = {"dumper": str(dumper), "dumper_argv": dump.argv, "evals": dump.index["evals"],
              "dumper_argmax_equals_server_tokens": greedy_same, "dumper_topk_gap_max_abs_diff": drift}
    if len(requests) > 1:
        engine["dumper_schedule"] = batchrows.schedule(dump.index)
        if not greedy_same or drift is None or drift > batchrows.BOUND:
            engine["not_reproduced"] = (f"detllm-dump's re-run of the batch of {len(requests)} did not compute llama-server's "
                                        f"row {spec.row}: " + ("its argmax tokens differ from the server's" if not greedy_same else
                                                               f"top-k logprob gaps differ by {drift!r} (bound {batchrows.BOUND:g})"))
    return Capture(generations=gens, tensors=found, level=level, notes=notes, engine=engine)



def weight(gguf_path: Path, info: Any, name: str) -> Any:
    """One GGUF tensor as a float64 array [ne[-1], ..., ne[0]] (numpy's order), dequantised by the gguf
    package where stored quantised; None when the file has no such tensor."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    if name not in info.tensor_layout:
        return None
    ne, offset = info.tensor_layout[name]
    qtype = GGMLQuantizationType(info.tensor_types[name])
    block, size = GGML_QUANT_SIZES[qtype]
    count = 1
    for n in ne:
        count *= int(n)
    raw = np.memmap(gguf_path, dtype=np.uint8, mode="r", offset=offset, shape=(count // block * size,))
    rows = raw.reshape(-1, int(ne[0]) // block * size)
    return np.asarray(dequantize(rows, qtype), dtype=np.float64).reshape([int(n) for n in reversed(ne)])


def reference_errors(found: list[CapturedTensor], gguf_path: Path, info: Any, n_head: int, n_head_kv: int,
                     eps: float, token_ids: Sequence[int]) -> list[str]:
    """Set ref_error on each module computed from one weight (embedding, norm, gemm, logits): max |output -
    the same op in float64 on the captured inputs and the GGUF's weight| (locate's tolerance). Returns
    notes on what was not evaluated. Layer boundaries are many ops: not evaluated."""
    import numpy as np

    try:
        import gguf  # noqa: F401  (dequantisation)
    except ImportError:
        return ["no float64 reference: the gguf package is missing"]
    arch = info.architecture
    n_layer = int(info.metadata.get(f"{arch}.block_count") or 0)
    weights = {hf: base for base, hf in NameMap(arch, n_layer).hf.items()}
    skipped: list[str] = []
    for t in found:
        base = weights.get(t.name)
        if base is None:
            continue
        try:
            W = weight(gguf_path, info, f"{base}.weight")
        except (NotImplementedError, ValueError, KeyError, OSError):
            W = None
        if W is None:
            skipped.append(t.name)
            continue
        out = np.asarray(t.output, dtype=np.float64)
        if t.kind == "embedding":
            ids = [int(token_ids[p]) for p in (t.positions or range(len(token_ids)))]
            ref = W[ids]
        elif not t.inputs:
            skipped.append(t.name)
            continue
        else:
            x = np.asarray(t.inputs[0], dtype=np.float64)
            if t.kind == "norm":
                ref = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * W
            else:
                ref = x @ W.T
                if base.endswith(("attn_q", "attn_k")) and arch in UNPERMUTED_ARCHS:
                    ref = unpermute(ref, n_head if base.endswith("attn_q") else n_head_kv)
            ref = ref[..., ref.shape[-2] - out.shape[-2]:, :] if ref.shape != out.shape and ref.ndim == out.ndim else ref
        if ref.shape == out.shape:
            t.ref_error = float(np.max(np.abs(out - ref))) if out.size else 0.0
        else:
            skipped.append(t.name)
    return [f"no float64 reference for {', '.join(skipped)}"] if skipped else []


__all__ = ["DUMPER", "Dump", "NameMap", "SKIP_NODES", "SKIP_OPS", "capture_sequence", "find_dumper", "reference_errors", "weight", "node_name", "read_dump", "run_dump", "tensors", "unpermute"]
