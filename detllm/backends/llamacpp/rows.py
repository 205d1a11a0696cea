"""One sequence out of detllm-dump's batched graph, and the graft's arguments (the `llamacpp` capture):
which rows of each graph evaluation are the captured sequence's (index.json "rows": [sequence,
position, output] per row), each dumped node cut to them; and how locate's graft of a module becomes
detllm-dump's --graft arguments (the node, its op, the rows in GGUF's order, their positions).
Pure functions on what detllm-dump wrote or will read; running it is capture.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from .names import UNPERMUTED_ARCHS, NameMap, repermute

BOUND = 1e-6  # max |Δ| of the top-k logprob gaps past which the dumper did not compute the server's batch
# (agreement to rounding measured <= 3.6e-7 on tiny, 2.4e-7 on smollm2 Q4_1; a batch-1 row of tiny
# against its batch-4 row differs by ~1e-4)


def cut(index: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """Keep, in each record's data, only the captured sequence's rows (index["row"]) of its evaluation; a
    node with no such rows, or whose layout names no row (the KQ mask...), keeps no data. A dump of one
    sequence is left as it is."""
    if int(index.get("sequences", 1)) <= 1:
        return
    rows, me = index.get("rows") or [], int(index.get("row", 0))
    for rec in records:
        if rec["data"] is not None:
            whole = rec["data"]
            while whole.ndim > 2 and whole.shape[0] == 1:  # capture._rows' shape: the rows as the engine computed them
                whole = whole[0]
            rec["whole"] = tuple(whole.shape)
            rec["data"] = _cut(rec, rows[rec["eval"]] if rec["eval"] < len(rows) else [], me)


def _cut(rec: dict[str, Any], ev: list[list[int]], me: int) -> Any:
    a, ne = rec["data"], [int(n) for n in rec["ne"]]  # a: [ne3, ne2, ne1, ne0]
    own = [i for i, r in enumerate(ev) if r[0] == me]
    if not own:
        return None
    if len(own) == len(ev):
        return a  # an evaluation of this sequence's rows only
    outs = [r for r in ev if r[2]]
    own_out = [k for k, r in enumerate(outs) if r[0] == me]
    seqs = sorted({r[0] for r in ev})
    if rec["name"].startswith("cache_") and ne[3] == len(seqs):  # a KV cache view: one stream per sequence
        i = seqs.index(me)
        return a[i:i + 1]
    if ne[2] == 1 and ne[3] == 1 and ne[1] == len(ev):
        return a[:, :, own]
    if ne[2] == 1 and ne[3] == 1 and ne[1] == len(outs):  # the last layer keeps the output rows only
        return a[:, :, own_out] if own_out else None
    if ne[3] == 1 and ne[2] == len(ev):  # [head_dim, heads, tokens] (roped q/k, v)
        return a[:, own]
    return None


def schedule(index: dict[str, Any]) -> list[dict[str, Any]]:
    """The captured step's graph evaluations as detllm-dump ran them: per evaluation, its rows per
    sequence ({"sequences": {seq: [first position, rows]}, "rows": n})."""
    out = []
    for ev in index.get("rows") or []:
        per: dict[str, list[int]] = {}
        for seq, pos, _ in ev:
            per.setdefault(str(seq), [pos, 0])[1] += 1
        out.append({"rows": len(ev), "sequences": per})
    return out


def graft_target(name: str, names: NameMap, tied: bool) -> tuple[str, str, str | None]:
    """(node or weight name, op, GGUF weight base or None) that detllm-dump's --graft/--graft-op select
    for a captured module: a layer is l_out-N, an attention op kqv_out-N (o_proj's input), a module the
    node that reads its weight (the first per evaluation, as the capture names it)."""
    parts = name.split(".")
    if len(parts) == 3 and parts[:2] == ["model", "layers"]:
        return f"l_out-{parts[2]}", "", None
    if name.endswith("/attention"):
        return f"kqv_out-{parts[2]}", "", None
    if name == "lm_head" and tied:
        return "token_embd.weight", "MUL_MAT", "token_embd"
    base = next((b for b, hf in names.hf.items() if hf == name), None)
    if base is None:
        raise KeyError(name)
    leaf = base.rsplit(".", 1)[-1]
    op = "GET_ROWS" if base == "token_embd" else "MUL" if leaf.endswith("norm") else "MUL_MAT"
    return f"{base}.weight", op, base


def graft_rows(value: Any, base: str | None, arch: str, heads: tuple[int, int], last: int) -> tuple[Any, list[int], str]:
    """The other side's output as float32 rows [positions, features] in GGUF's feature order (q/k
    re-permuted: the inverse of the capture's un-permutation), the positions they hold (the trailing
    ones, ending at `last`) and what was done to them."""
    import numpy as np

    rows = np.ascontiguousarray(np.asarray(value, dtype=np.float32).reshape(-1, np.asarray(value).shape[-1]))
    done = ""
    if base is not None and base.endswith(("attn_q", "attn_k")) and arch in UNPERMUTED_ARCHS:
        rows = np.ascontiguousarray(repermute(rows, heads[0] if base.endswith("attn_q") else heads[1]))
        done = "; q/k rows re-permuted into GGUF's order (the inverse of the capture's un-permutation)"
    return rows, list(range(last - rows.shape[0] + 1, last + 1)), done


def graft_args(spec: Any, info: Any, tmp: Path, heads: tuple[int, int], last: int) -> tuple[list[str], Any]:
    """detllm-dump's --graft arguments for spec.graft (the values written to a file in `tmp`), and a
    function of the dump's "graft" record giving the capture's note; ([], None) without a graft."""
    if spec.graft is None:
        return [], None
    import numpy as np

    name = spec.graft.name
    names = NameMap(info.architecture, int(info.metadata.get(f"{info.architecture}.block_count") or 0))
    try:
        target, op, base = graft_target(name, names, tied="output.weight" not in info.tensor_layout)
    except KeyError:
        return [], lambda _rec: f"grafted {name}: written 0 time(s); not written: llama.cpp's capture names no node {name!r}"
    rows, positions, done = graft_rows(spec.graft.value, base, info.architecture, heads, last)
    (tmp / "graft.bin").write_bytes(np.asarray(rows, dtype="<f4").tobytes())
    argv = ["--graft", target, "--graft-file", str(tmp / "graft.bin"), "--graft-pos", ",".join(map(str, positions))]
    if op:
        argv += ["--graft-op", op]

    def note(rec: dict[str, Any]) -> str:
        why = f"; not written: {rec['why']}" if rec.get("why") else ""
        return (f"grafted {name}: written {rec.get('evals_written', 0)} time(s) ({rec.get('rows_written', 0)} row(s) of "
                f"{target}{' ' + op if op else ''}, by detllm-dump after the node was computed, before its consumers){done}{why}")
    return argv, note


def ids(seqs: Sequence[Sequence[int]]) -> str:
    """Sequences of token ids as detllm-dump's --tokens/--forced take them (',' within, ';' between)."""
    return ";".join(",".join(str(int(t)) for t in s) for s in seqs)


__all__ = ["BOUND", "cut", "graft_args", "graft_rows", "graft_target", "ids", "schedule"]
