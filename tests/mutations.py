"""Copies of a valid artifact with one leaf or key changed the ways a bug (or an odd value) would change
it: the inputs on which two validators are held to the same answers (test_schema_io, test_schemalite)."""

from __future__ import annotations

import copy
import random


def mutations(obj: dict, rng: random.Random, n: int, hows: tuple[str, ...], values: list, *,
              deletes_list_items: bool = False) -> list[dict]:
    """n copies of obj, each changed at one random path in one of `hows` ways ("type": one of `values`;
    "delete" takes a list item too with `deletes_list_items`; the rest as named below)."""
    paths = []

    def walk(x, path):
        if isinstance(x, dict):
            for k, v in x.items():
                paths.append(path + [k])
                walk(v, path + [k])
        elif isinstance(x, list):
            for i, v in enumerate(x[:3]):
                paths.append(path + [i])
                walk(v, path + [i])

    walk(obj, [])
    out = []
    for _ in range(n):
        y = copy.deepcopy(obj)
        path = rng.choice(paths)
        parent = y
        for key in path[:-1]:
            parent = parent[key]
        old = parent[path[-1]]
        how = rng.choice(hows)
        if how == "delete" and (deletes_list_items or isinstance(parent, dict)):
            del parent[path[-1]]
        elif how == "extra" and isinstance(parent, dict):
            parent["not_in_the_schema"] = 1
        elif how == "negative":
            parent[path[-1]] = -1
        elif how == "float":
            parent[path[-1]] = 1.5
        elif how == "integral":  # 2.0 where an integer is asked
            parent[path[-1]] = float(old) if type(old) is int else 2.0
        elif how == "string" and isinstance(old, str):  # near misses of a pattern or an enum
            parent[path[-1]] = rng.choice([old + "\n", old.upper(), old[:-1], old + "é", "../" + old, "", old + "x"])
        elif how == "empty":
            parent[path[-1]] = type(old)() if isinstance(old, (list, dict, str)) else 0
        elif how == "append" and isinstance(old, list):
            old.append(old[0] if old else None)
        else:
            parent[path[-1]] = rng.choice(values)
        out.append(y)
    return out
