"""What a tensor-parallel capture says of the located op: whether it is a row-parallel module
(o_proj, down_proj at tensor_parallel_size > 1), whose output is the sum, by an all-reduce, of
each rank's partial product over its share of the input columns. Read from the capture's own
facts (the vllm backend's unshard.py), never inferred from a name; the category is category.py's.
"""

from __future__ import annotations

from typing import Any


def row_parallel(found: Any, name: str) -> dict[str, Any] | None:
    """{side, tensor_parallel_size, input_columns_per_rank, partials_sum_equals_output, other_side}
    where one side's capture recorded `name` as row-parallel; None where neither did."""
    facts = [(c.engine or {}).get("tensor_parallel") or {} for c in found.caps]
    for i, key in enumerate(("left", "right")):
        rp = (facts[i].get("row_parallel") or {}).get(name)
        if rp is None:
            continue
        other = facts[1 - i]
        return {"side": key, "tensor_parallel_size": int(facts[i]["ranks"]),
                "input_columns_per_rank": rp.get("input_columns_per_rank"),
                "partials_sum_equals_output": bool(rp.get("sum_equals_output")),
                "other_side_tensor_parallel_size": int(other.get("ranks", 1))}
    return None


def how(rp: dict[str, Any], name: str) -> str:
    """The reduction's shape, as the capture showed it, for category.py's line."""
    n, cols = rp["tensor_parallel_size"], rp["input_columns_per_rank"]
    other = rp["other_side_tensor_parallel_size"]
    summed = ("the captured partials summed in rank order equal its output bitwise" if rp["partials_sum_equals_output"] else
              "the captured partials summed in rank order do not equal its output: the all-reduce adds them in another order")
    rest = (f"the other side (tensor_parallel_size {other}) reduces all {cols * n} in one GEMM" if other == 1 else
            f"the other side splits it over {other} ranks")
    return (f"that is row-parallel on the {rp['side']} side (tensor_parallel_size {n}): each rank reduces {cols} of the "
            f"{cols * n} input columns and an all-reduce adds the {n} partial products ({summed}); {rest}")


__all__ = ["how", "row_parallel"]
