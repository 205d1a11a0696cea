"""The diff fast path (compare/arrays.py, compare/fast.py) gives the report the reference path gives.

Every pair is compared twice: once with differing payloads parsed into arrays (the
threshold set to 0 bytes, so even the small fixtures take the fast path) and once with
every payload read by the reference code (threshold out of reach). The reports must be
equal as JSON, and the fast run must really have built its arrays."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from detllm.runfolder import artifacts
from detllm.compare import arrays, trace
from detllm.commands.diff import diff
from detllm.core.errors import DetllmError
from detllm.core.hashing import canonical_json, sha256_bytes, sha256_text

FIXTURES = Path(__file__).parent / "fixtures"
RUN_FOLDERS = sorted(p for p in [*(FIXTURES / "diff").iterdir(), *(FIXTURES / "v1").iterdir()]
                     if (p / "run_config.json").is_file())


def both_paths(monkeypatch, a, b, **kw) -> tuple[object, object, int]:
    """(fast report or error text, reference report or error text, records read as arrays)."""
    built = []
    real = arrays.views

    def counting(x, y, tops=True):
        got = real(x, y, tops)
        built.append(isinstance(got[0], arrays.View))
        return got

    monkeypatch.setattr(arrays, "views", counting)

    monkeypatch.setattr(trace, "FAST_PATH_AFTER", 0)

    def one(threshold: int):
        monkeypatch.setattr(trace, "FAST_PATH_MIN_BYTES", threshold)
        try:
            return json.dumps(diff(a, b, **kw).report, sort_keys=True)
        except DetllmError as exc:
            return f"{type(exc).__name__}: {exc}"

    quick = one(0)
    n_views = sum(built)
    return quick, one(10**15), n_views


@pytest.mark.parametrize("left,right", list(itertools.permutations(RUN_FOLDERS, 2))[:40],
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_fixture_pairs_same_report(monkeypatch, left, right):
    quick, ref, _ = both_paths(monkeypatch, left, right)
    assert quick == ref


def test_fixture_pairs_take_the_fast_path(monkeypatch):
    """At least one fixture pair differs in records the fast path reads (the tests above test something)."""
    base = FIXTURES / "diff" / "base"
    seen = 0
    for other in RUN_FOLDERS:
        if other != base:
            seen += both_paths(monkeypatch, base, other)[2]
    assert seen > 0


# ------------------------------------------------------------------ synthetic traces


def _record(i: int, ids, lps, tops) -> dict:
    text = f"synthetic prompt {i}"
    input_ids = [i % 7, 3, 5]
    texts = [f" w{t}" for t in ids]
    return artifacts.stamp("trace_record", {
        "run_index": 0, "batch_size": 1, "batch_position": 0, "prompt_index": i, "prompt_id": sha256_text(text),
        "prompt_text": text, "input_ids": input_ids, "input_ids_sha256": sha256_bytes(canonical_json(input_ids)),
        "token_ids": ids, "token_texts": texts, "text": "".join(texts), "logprobs": lps, "top_logprobs": tops,
        "finish_reason": "length",
    })


def _folder(root: Path, name: str, records: list[dict]) -> Path:
    src = FIXTURES / "diff" / "base"
    folder = root / name
    folder.mkdir()
    for f in (artifacts.RUN_CONFIG, artifacts.ENV, artifacts.APPLIED):
        (folder / f).write_bytes((src / f).read_bytes())
    with open(folder / artifacts.TRACE, "w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n")
    return folder


def _pair(root: Path, variant: str, prompts: int = 12, tokens: int = 40, k: int = 5) -> tuple[Path, Path]:
    rng = random.Random(variant)
    left, right = [], []
    for i in range(prompts):
        ids = [rng.randrange(60) for _ in range(tokens)]  # a small vocabulary: ids repeat inside a top-k
        lps = [-rng.random() * 3 for _ in range(tokens)]
        tops = [[[t, lp]] + [[rng.randrange(60), lp - 0.1 * (j + 1)] for j in range(k - 1)] for t, lp in zip(ids, lps)]
        a = _record(i, ids, lps, tops)
        b = json.loads(json.dumps(a))
        if variant == "drift" or (variant in ("mixed", "nulls") and i % 3 == 0):
            b["logprobs"] = [lp + 1e-7 for lp in b["logprobs"]]
            b["top_logprobs"] = [[[t, lp + 1e-7 * (j + 1)] for j, (t, lp) in enumerate(s)] for s in b["top_logprobs"]]
        if variant in ("flip", "mixed") and i % 4 == 1:
            p = tokens // 2
            b["token_ids"][p] = b["top_logprobs"][p][1][0]
            b["token_texts"][p] = f" w{b['token_ids'][p]}"
            b["text"] = "".join(b["token_texts"])
        if variant == "topk" and i % 2:  # ids of the top-k swap and change below the top-1
            b["top_logprobs"] = [[s[0], [s[2][0], s[1][1]], [s[1][0], s[2][1]], [s[3][0] + 1, s[3][1]], s[4]]
                                 for s in b["top_logprobs"]]
        if variant == "short" and i % 5 == 2:
            for key in ("token_ids", "token_texts", "logprobs", "top_logprobs"):
                b[key] = b[key][: tokens - 3]
            b["text"], b["finish_reason"] = "".join(b["token_texts"]), "stop"
        if variant == "fewer_k" and i % 2:
            b["top_logprobs"] = [s[:3] for s in b["top_logprobs"]]
            b["logprobs"] = [lp + 2e-6 for lp in b["logprobs"]]
        if variant == "no_tops" and i % 3 == 2:  # one side recorded no top-k (logprobs 0): every step differs
            b["top_logprobs"] = None
        if variant == "no_tops" and i % 3 == 1:
            b["logprobs"] = [lp + 3e-7 for lp in b["logprobs"]]
        if variant == "nulls" and i % 3 == 1:  # not the runner's layout: the reference path reads it
            b["top_logprobs"][2][1][1] = None
        left.append(a)
        right.append(b)
    return _folder(root, f"{variant}_l", left), _folder(root, f"{variant}_r", right)


VARIANTS = ["drift", "flip", "mixed", "topk", "short", "fewer_k", "nulls", "no_tops"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tier,atol", [(1, 0.0), (2, 0.0), (2, 1e-6), (2, 0.5)])
def test_synthetic_pairs_same_report(monkeypatch, tmp_path, variant, tier, atol):
    left, right = _pair(tmp_path, variant)
    quick, ref, n_views = both_paths(monkeypatch, left, right, tier=tier, atol=atol)
    assert quick == ref
    assert n_views > 0, "the fast path was not taken"


def test_irregular_payload_takes_the_reference_path(tmp_path):
    left, right = _pair(tmp_path, "nulls")
    records, _ = trace.load_records(right / artifacts.TRACE)
    assert arrays.payload(records[1]) is None  # a null inside the top-k
    assert arrays.payload(records[0]) is not None


def test_views_read_as_the_record(tmp_path):
    left, _ = _pair(tmp_path, "drift")
    records, _ = trace.load_records(left / artifacts.TRACE)
    r = records[3]
    v = arrays.View(r, arrays.payload(r))
    full = json.loads((left / artifacts.TRACE).read_text().splitlines()[3])
    for key in ("token_ids", "token_texts", "text", "logprobs", "finish_reason"):
        assert v[key] == full[key]
    assert list(v["top_logprobs"]) == full["top_logprobs"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("threshold", [0, 10**15], ids=["fast", "reference"])
def test_compare_without_drift_keeps_the_verdict(monkeypatch, tmp_path, variant, threshold):
    """compare(..., drift=False), as verify's re-derivation calls it: the same status, divergences
    and first divergence as with the drift aggregation, on either path; drift itself is not computed."""
    from detllm.compare.engine import compare

    monkeypatch.setattr(trace, "FAST_PATH_AFTER", 0)
    monkeypatch.setattr(trace, "FAST_PATH_MIN_BYTES", threshold)
    left, right = _pair(tmp_path, variant)
    a, _ = trace.load_records(left / artifacts.TRACE)
    b, _ = trace.load_records(right / artifacts.TRACE)
    kw = dict(name="c", kind="run", left_label="run_0@batch_1", right_label="run_1@batch_1", required=True,
              check_logprobs=True)
    full, lean = compare(a, b, **kw), compare(a, b, drift=False, **kw)
    assert full["drift"]["available"] and lean["drift"] == {"available": False}
    assert full["status"] == lean["status"] == "FAIL"
    for key in ("first_divergence", "divergences", "prompts_diverged", "unmatched"):
        assert json.dumps(full[key], sort_keys=True) == json.dumps(lean[key], sort_keys=True), key


@pytest.mark.parametrize("variant,line", [("drift", 3), ("nulls", 1)])
def test_lazy_top_k_reads_as_the_record(tmp_path, variant, line):
    """A View without parsed top-k (payload(tops=False)) gives each step as the record holds it,
    before and past the per-step limit, on the runner's layout and on an irregular one (a null)."""
    _, right = _pair(tmp_path, variant)
    records, _ = trace.load_records(right / artifacts.TRACE)
    r = records[line]
    v = arrays.View(r, arrays.payload(r, tops=False))
    full = json.loads((right / artifacts.TRACE).read_text().splitlines()[line])["top_logprobs"]
    tops = v["top_logprobs"]
    assert isinstance(tops, arrays._LazyTops)
    assert [tops[i] for i in (0, 1, 2, arrays.LAZY_STEPS + 1, 5)] == [full[i] for i in (0, 1, 2, arrays.LAZY_STEPS + 1, 5)]
    assert len(tops) == len(full) and list(tops) == full


# ------------------------------------------------------------------ the second core (compare/pairs.py)


class _Parent:
    """Counts the pairs this process settles; with `slow`, its first pair takes 2 s and each
    other >= 20 ms, so a worker (started in ~0.2 s, ~1 s on a loaded machine) surely takes some."""

    def __init__(self, monkeypatch) -> None:
        from detllm.compare import pairs

        self.mine: list[int] = []
        self.slow = False
        real = pairs.settle

        def settle(a, b, spec):
            if self.slow:
                time.sleep(0.02 if self.mine else 2.0)
            self.mine.append(a["prompt_index"])
            return real(a, b, spec)

        monkeypatch.setattr(pairs, "settle", settle)
        monkeypatch.setattr(trace, "_MAP_MIN_BYTES", 0)  # mapped files: what the worker reads through
        monkeypatch.setattr(trace, "FAST_PATH_AFTER", 0)
        monkeypatch.setattr(trace, "FAST_PATH_MIN_BYTES", 0)
        self.pairs, self.monkeypatch = pairs, monkeypatch

    def alone(self) -> None:
        self.monkeypatch.setattr(self.pairs, "WORKER_MIN_BYTES", 1 << 62)
        self.monkeypatch.setattr(trace, "_WARM_MIN_BYTES", 1 << 62)
        self.slow = False
        self.mine.clear()

    def shared(self, warm: bool = False) -> None:
        """With `warm`, the worker is started while the traces load (a spare that opens them
        through /proc), else when the pairs are handed over (it inherits their descriptors)."""
        self.monkeypatch.setattr(self.pairs, "WORKER_MIN_BYTES", 0)
        self.monkeypatch.setattr(trace, "_WARM_MIN_BYTES", 0 if warm else 1 << 62)
        self.slow = True
        self.mine.clear()


@pytest.mark.parametrize("variant,tier,warm", [("mixed", 2, False), ("nulls", 2, True), ("flip", 1, True), ("topk", 2, False)])
def test_a_worker_process_gives_the_same_report(monkeypatch, tmp_path, variant, tier, warm):
    from detllm.compare import spare

    left, right = _pair(tmp_path, variant, prompts=100, tokens=24)
    parent = _Parent(monkeypatch)
    parent.alone()
    reference = json.dumps(diff(left, right, tier=tier).report, sort_keys=True)
    differing = len(parent.mine)
    parent.shared(warm)
    spares = []
    monkeypatch.setattr(spare, "take", lambda real=spare.take: spares.append(real()) or spares[-1])
    shared = json.dumps(diff(left, right, tier=tier).report, sort_keys=True)
    assert differing > 20
    assert 0 < len(parent.mine) < differing, f"this process settled {len(parent.mine)} of {differing} pairs"
    assert shared == reference
    assert (spares[0] is not None) == warm and spare._waiting is None  # a spare was taken, when there was one


def test_a_record_the_worker_cannot_read_is_refused_here(monkeypatch, tmp_path):
    """A record that breaks the schema (a negative token id) among the pairs the worker takes: the
    worker leaves it, this process settles it and raises the error the reference path raises."""
    left, right = _pair(tmp_path, "drift", prompts=60, tokens=24)
    lines = (right / artifacts.TRACE).read_text().splitlines()
    bad = json.loads(lines[30])
    bad["token_ids"][3] = -4
    lines[30] = json.dumps(bad, separators=(",", ":"))
    (right / artifacts.TRACE).write_text("\n".join(lines) + "\n")
    parent = _Parent(monkeypatch)
    parent.alone()
    with pytest.raises(DetllmError) as reference:
        diff(left, right, tier=2)
    parent.shared()
    with pytest.raises(DetllmError) as shared:
        diff(left, right, tier=2)
    assert str(shared.value) == str(reference.value) and "line 31" in str(shared.value)
    assert len(parent.mine) < 30, "this process reached the bad record by itself: the worker settled nothing"


def test_the_worker_dies_with_its_parent(tmp_path):
    """A diff killed while its worker settles pairs leaves no process behind."""
    left, right = _pair(tmp_path, "drift", prompts=400, tokens=24)
    script = f"""
import time, sys
from detllm.compare import pairs, trace
from detllm.commands.diff import diff
trace._MAP_MIN_BYTES = trace.FAST_PATH_AFTER = trace.FAST_PATH_MIN_BYTES = pairs.WORKER_MIN_BYTES = 0
real = pairs.settle
def slow(a, b, spec):
    time.sleep(0.05)
    return real(a, b, spec)
pairs.settle = slow
print("started", flush=True)
diff({str(left)!r}, {str(right)!r}, tier=2)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "started"
        worker = None
        for _ in range(200):  # the worker appears once the pairs are handed over (exec'd: not a bare fork)
            for kid in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split():
                with contextlib.suppress(OSError):
                    if b"detllm.compare.pairs" in Path(f"/proc/{kid}/cmdline").read_bytes():
                        worker = int(kid)
            if worker is not None:
                break
            time.sleep(0.05)
        assert worker is not None, "no worker was started"
        time.sleep(0.5)  # it is settling pairs now
    finally:
        proc.kill()
        proc.wait()
    for _ in range(100):
        if not Path(f"/proc/{worker}").exists() or "Z" in Path(f"/proc/{worker}/stat").read_text().split()[2]:
            break
        time.sleep(0.05)
    else:
        os.kill(worker, 9)
        pytest.fail("the worker outlived its parent by 5 s")


# ------------------------------------------------------------------ check compares a large trace from disk


@pytest.mark.parametrize("options,vary,tier", [
    ({"diverge": "prompt=2,pos=5,run=1"}, (), 2),
    ({"diverge": "prompt=1,pos=3,run=2,what=logprob"}, (), 2),
    ({"diverge": "prompt=0,pos=2,batch=8", "batch_drift": 0.001}, (1, 8), 2),
    ({"batch_drift": 0.001}, (1, 8), 1),
    ({}, (), 2),
])
def test_check_compares_a_large_trace_from_disk_with_the_same_report(monkeypatch, tmp_path, options, vary, tier):
    """runner.compared_records: past COMPARE_FROM_DISK_BYTES the check's comparisons read the trace it
    just wrote (through the fast path, forced here for small payloads), and the report is the one the
    records in memory give."""
    import detllm
    from detllm.pipeline import runner

    def report(name: str) -> str:
        out = detllm.check(backend="fake", options=options, vary_batch=vary, tier=tier, runs=3, max_new_tokens=24,
                           out=tmp_path / name)
        rep = json.loads((out.out_dir / "report.json").read_text())
        return json.dumps({k: rep[k] for k in ("status", "category", "causes", "info", "first_divergence", "comparisons", "magnitude")},
                          sort_keys=True)

    memory = report("memory")
    read = []
    real = trace.load_records
    monkeypatch.setattr(trace, "load_records", lambda *a, **k: read.append(a[0]) or real(*a, **k))
    monkeypatch.setattr(runner, "COMPARE_FROM_DISK_BYTES", 0)
    monkeypatch.setattr(trace, "FAST_PATH_MIN_BYTES", 0)
    monkeypatch.setattr(trace, "FAST_PATH_AFTER", 0)
    disk = report("disk")
    assert read and read[0].name == "trace.jsonl", "the check did not read its trace back"
    assert disk == memory


# ------------------------------------------------------------------ the arrays reported from are never written


def test_payload_arrays_are_read_only(tmp_path):
    """A divergence is reported from the arrays the drift was computed on: an in-place write into
    them (a view numpy did not copy) raises instead of changing the numbers reported."""
    left, _ = _pair(tmp_path, "drift")
    records, _ = trace.load_records(left / artifacts.TRACE)
    p = arrays.payload(records[3])
    for name in ("ids", "lps", "top_ids", "top_lps"):
        arr = getattr(p, name)
        assert not arr.flags.writeable, name
        with pytest.raises(ValueError, match="read-only"):
            arr[0] += 1


def _step0_flips(k: int, what: str) -> tuple[list[dict], list[dict]]:
    """Seven prompts of 60 tokens, logprobs normalised as an engine's; the middle five (the records
    load_records leaves as raw payloads) differ at step 0: `flip`, the left's token at p 0.30 over
    0.25 (a confident gap of 0.18) and the right's at 0.275 over 0.274995 (a tie); `drift`, the
    same tokens with every logprob moved by 1e-5. The top-k's mass is 0.6, so a top-k
    renormalised in place (log 0.6 added) turns the left's gap negative and the flip a tie."""
    import math

    probs = [0.30, 0.25, 0.03, 0.01, 0.01]
    left, right = [], []
    for i in range(7):
        ids = [10 + (i + s) % 40 for s in range(60)]
        lps = [math.log(probs[0])] * 60
        tops = [[[t + j, math.log(q)] for j, q in enumerate(probs)][:k] for t in ids]
        a = _record(i, ids, lps, tops)
        b = json.loads(json.dumps(a))
        if 1 <= i <= 5 and what == "flip":
            t = ids[0]
            b["token_ids"][0], b["token_texts"][0] = t + 1, f" w{t + 1}"
            b["text"] = "".join(b["token_texts"])
            b["logprobs"][0] = math.log(0.275)
            b["top_logprobs"][0] = [[t + 1, math.log(0.275)], [t, math.log(0.274995)],
                                    *[[t + j, math.log(q)] for j, q in enumerate(probs) if j > 1]][:k]
        elif 1 <= i <= 5:
            b["logprobs"] = [lp + 1e-5 for lp in b["logprobs"]]
            b["top_logprobs"] = [[[t, lp + 1e-5] for t, lp in s] for s in b["top_logprobs"]]
        left.append(a)
        right.append(b)
    return left, right


@pytest.mark.parametrize("k,what", [(1, "flip"), (5, "flip"), (1, "drift"), (5, "drift")])
def test_fast_path_holds_to_the_in_memory_reference(monkeypatch, tmp_path, k, what):
    """R1: k == 1 (--logprobs 1) and step-0 flips of middle records, where the drift's
    renormalisation once wrote into the top-k the first divergence is then reported from. The
    comparison `check` makes in memory (plain records), the one `diff` makes from disk (drift) and
    the one verify re-derives (from disk, no drift) give the same divergences, figure for figure."""
    from detllm.compare.engine import compare

    monkeypatch.setattr(trace, "FAST_PATH_AFTER", 0)
    monkeypatch.setattr(trace, "FAST_PATH_MIN_BYTES", 0)
    left, right = _step0_flips(k, what)
    lf, rf = _folder(tmp_path, "l", left), _folder(tmp_path, "r", right)
    kw = dict(name="c", kind="run", left_label="run_0@batch_1", right_label="run_1@batch_1", required=True,
              check_logprobs=True, noise_floor=1e-4)

    def from_disk(drift: bool) -> dict:
        a, _ = trace.load_records(lf / artifacts.TRACE)
        b, _ = trace.load_records(rf / artifacts.TRACE)
        return compare(a, b, drift=drift, **kw)

    memory, disk, lean = compare(left, right, **kw), from_disk(True), from_disk(False)
    assert memory["prompts_diverged"] == 5
    if what == "flip" and k == 5:
        assert memory["first_divergence"]["magnitude"]["label"] == "confident_flip"
    for key in ("first_divergence", "divergences", "prompts_diverged", "status"):
        want = json.dumps(memory[key], sort_keys=True)
        assert json.dumps(disk[key], sort_keys=True) == want, key
        assert json.dumps(lean[key], sort_keys=True) == want, key
    assert json.dumps(disk["drift"], sort_keys=True) == json.dumps(memory["drift"], sort_keys=True)


@pytest.mark.parametrize("logprobs", [1, 5])
def test_a_large_check_with_step0_flips_verifies_and_packs(monkeypatch, tmp_path, logprobs):
    """R1 end to end: a check whose trace is compared from disk (forced here: 16 MB and more in
    use) with step-0 flips on middle prompts writes the report the records in memory give, and
    `verify` re-derives that verdict from the sealed trace, so `pack` packs the honest folder."""
    import detllm
    from detllm.pipeline import runner
    from detllm.commands.pack import create_pack
    from detllm.commands.verify import verify

    options = {"diverge": "prompt=1,pos=0,run=1;prompt=2,pos=0,run=1;prompt=3,pos=0,run=1"}
    prompts = [f"prompt number {i}" for i in range(5)]

    def check(name: str):
        out = detllm.check(backend="fake", options=options, prompts=prompts, tier=2, runs=2, max_new_tokens=40,
                           logprobs=logprobs, out=tmp_path / name)
        rep = json.loads((out.out_dir / "report.json").read_text())
        return out.out_dir, json.dumps({k: rep[k] for k in ("status", "first_divergence", "comparisons")}, sort_keys=True)

    _, memory = check("memory")
    monkeypatch.setattr(runner, "COMPARE_FROM_DISK_BYTES", 0)
    monkeypatch.setattr(trace, "FAST_PATH_MIN_BYTES", 0)
    monkeypatch.setattr(trace, "FAST_PATH_AFTER", 0)
    folder, disk = check("disk")
    assert '"status": "FAIL"' in disk and disk == memory
    assert verify(folder).verdict is not None
    assert create_pack(folder, tmp_path / "big.tar.gz").is_file()
