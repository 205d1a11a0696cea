"""answers.steps: the fast path for the common completions answer (text keys, finite float logprobs)
gives what the general path gives, ties kept in the server's order, on random answers that mix in
everything the fast path must leave to the general one (NaN, infinities, ints, strings, vLLM ids)."""

from __future__ import annotations

import random

from detllm.backends.openai import answers


def _answer(rng: random.Random) -> dict:
    values = [-0.5, -1.0, -1.0, -2.25, 0.0, -0.0, 3, "x", None, float("nan"), float("-inf"), float("inf"), True]
    keys = [" a", " b", "token_id:7", "token_id:x", "", "é", 5]
    tops = []
    for _ in range(rng.randint(0, 4)):
        plain = rng.random() < 0.6  # most steps as servers send them: text keys, finite floats, ties included
        n = rng.randint(0, 5)
        if plain:
            tops.append({f" t{rng.randint(0, 9)}": rng.choice([-0.5, -1.0, -1.0, -2.25, 0.0, -0.0]) for _ in range(n)})
        else:
            tops.append({rng.choice(keys): rng.choice(values) for _ in range(n)})
    toks = [rng.choice([" a", "token_id:3", 4]) for _ in tops]
    return {"tokens": toks, "token_logprobs": [rng.choice(values) for _ in tops], "top_logprobs": tops}


def test_the_fast_path_gives_the_general_paths_steps(monkeypatch):
    rng = random.Random(36)
    docs = [_answer(rng) for _ in range(4000)]
    fast = [answers.steps(d) for d in docs]
    monkeypatch.setattr(answers, "_plain", lambda top: False)  # every step through the general path
    general = [answers.steps(d) for d in docs]
    assert fast == general
    monkeypatch.undo()
    taken = sum(answers._plain(t) for d in docs for t in d["top_logprobs"])
    assert taken > 1000, "the fast path was taken"
    tie = answers.steps({"tokens": [" a"], "token_logprobs": [-1.0], "top_logprobs": [{" z": -1.0, " a": -1.0, " m": -0.5}]})
    assert [p[0] for p in tie[0].top] == [" m", " z", " a"], "most likely first, ties in the server's order"
