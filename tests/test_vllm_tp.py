"""tensor_parallel_size > 1 on the vllm backend's CPU build: vLLM's own multiprocessing executor
with one worker process per rank, each bound to its cores by VLLM_CPU_OMP_THREADS_BIND.

The engine tests run detllm in a process of their own (the workers are spawned and cannot share
the session's in-process engine): a real `detllm sweep --axis tensor_parallel_size=1,2` that
compares TP=2 with TP=1, and an engine killed with SIGKILL whose workers must die with it.
Descendants are read from /proc. The option checks need no engine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from detllm.backends.vllm import VLLMOptions, build_platform, installed_vllm
from detllm.backends.vllm.options import threads_bind, validate
from detllm.core.errors import UsageError

FOUND = installed_vllm()
CPU = FOUND is not None and build_platform(*FOUND) == "cpu"
needs_cpu_vllm = pytest.mark.skipif(not CPU, reason="tensor parallelism over CPU worker processes needs the vllm-cpu build")
TWO_CORES = len(os.sched_getaffinity(0)) >= 2


# ------------------------------------------------------------------ no engine needed


def test_binding_is_explicit_one_core_per_rank_by_default():
    tp2 = VLLMOptions(tensor_parallel_size=2)
    assert threads_bind(VLLMOptions(), None, [0, 1]) is None  # the in-process engine binds nothing
    assert threads_bind(tp2, None, [0, 1]) == "0|1"
    assert threads_bind(tp2, 2, [0, 1, 2, 3, 5]) == "0-1|2-3"
    assert threads_bind(VLLMOptions(tensor_parallel_size=3), 1, [4, 7, 9]) == "4|7|9"
    assert threads_bind(VLLMOptions(tensor_parallel_size=2, cpu_threads_bind="0-1|0-1"), 2, [0, 1]) == "0-1|0-1"
    with pytest.raises(UsageError) as err:
        threads_bind(tp2, 2, [0, 1])  # 2 ranks x 2 threads on 2 cores: refused, not oversubscribed silently
    assert "needs 4 cores" in err.value.one_line() and "cpu_threads_bind" in err.value.one_line()


def test_a_default_binding_is_chosen_by_the_machine_a_given_one_by_the_user():
    """Review E6: detllm's default binding is not the user's (diff counts a user value as CONFIG)."""
    from detllm.backends.vllm.options import _binding

    ranks = [{"rank": 0, "cpus": [0], "omp_threads": 1}, {"rank": 1, "cpus": [1], "omp_threads": 1}]
    assert _binding("0|1", ranks, user=False).chosen_by == "machine"
    assert "chosen by detllm" in _binding("0|1", ranks, user=False).note
    assert _binding("0|1", ranks, user=True).chosen_by == "user"


def test_tensor_parallel_is_no_longer_refused_on_cpu_and_bad_bindings_are():
    validate(VLLMOptions(tensor_parallel_size=2), "cpu")
    validate(VLLMOptions(tensor_parallel_size=2, cpu_threads_bind="auto"), "cpu")
    validate(VLLMOptions(tensor_parallel_size=2, cpu_threads_bind="0,2-3|1"), "cpu")
    bad = {"0|1": 1, "0": 2, "0|1|2": 2, "a|b": 2, "0-|1": 2, "0;1": 2}
    for bind, tp in bad.items():
        with pytest.raises(UsageError):
            validate(VLLMOptions(tensor_parallel_size=tp, cpu_threads_bind=bind), "cpu")
    with pytest.raises(UsageError, match="only the CPU build"):
        validate(VLLMOptions(tensor_parallel_size=2, cpu_threads_bind="0|1"), "gpu")


# ------------------------------------------------------------------ real engines, in processes of their own


def _children(pid: int) -> set[int]:
    """Every live descendant of `pid` (zombies count as gone: only their table entry is left)."""
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                kids = Path(f"/proc/{p}/task/{tid}/children").read_text().split()
            except OSError:
                continue
            for k in map(int, kids):
                if k not in found and _alive(k):
                    found.add(k)
                    todo.append(k)
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_gone(pids: set[int], seconds: float) -> set[int]:
    deadline = time.monotonic() + seconds
    while (left := {p for p in pids if _alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _cmdlines(pids: set[int]) -> dict[int, str]:
    out = {}
    for p in pids:
        try:
            out[p] = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            pass
    return out


@pytest.fixture(scope="module")
def tp_sweep(tmp_path_factory):
    """`detllm sweep --axis tensor_parallel_size=1,2` at one thread per rank, run by the CLI in a
    process of its own; the descendants seen while it ran (probe worker, vLLM's workers)."""
    if not (CPU and TWO_CORES):
        pytest.skip("needs the vllm-cpu build and two cores")
    out = tmp_path_factory.mktemp("tp") / "sweep"
    cmd = [sys.executable, "-m", "detllm", "sweep", "--backend", "vllm", "--axis", "threads=1",
           "--axis", "tensor_parallel_size=1,2", "--repeats", "2", "--max-new-tokens", "12", "--tier", "2", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: dict[int, str] = {}  # pid -> its command line, read while it lived
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        seen |= _cmdlines(_children(proc.pid) - set(seen))
        time.sleep(0.3)
    if proc.poll() is None:
        proc.kill()
    _, stderr = proc.communicate()
    assert proc.returncode == 0, stderr[-2000:]
    return out, json.loads((out / "sweep.json").read_text()), seen


@pytest.mark.engine
@needs_cpu_vllm
def test_sweep_compares_tp2_with_tp1_and_records_the_binding(tp_sweep):
    out, doc, _ = tp_sweep
    cells = {c["cell"]["tensor_parallel_size"]: c for c in doc["cells"]}
    assert doc["reference_cell"]["tensor_parallel_size"] == "1"
    assert cells["1"]["status"] == cells["2"]["status"] == "ran", doc["cells"]
    tp2 = cells["2"]
    # measured on tiny: tokens equal, logprobs apart by the all-reduce's summation order (~1e-5)
    assert tp2["diverged"] == 0, tp2
    assert tp2["vs_reference_max_abs_logprob_diff"] < 1e-3, tp2
    settings = {s["name"]: s for s in json.loads((out / tp2["folder"] / "determinism_applied.json").read_text())["settings"]}
    assert settings["tensor_parallel_size"]["value"] == 2 and settings["tensor_parallel_size"]["applied"]
    bind = settings["VLLM_CPU_OMP_THREADS_BIND"]
    assert bind["requested"] == "0|1" and bind["value"] == "0|1" and bind["applied"], bind  # as the workers report it
    assert bind["chosen_by"] == "machine", bind  # review E6: no cpu_threads_bind was given, detllm chose it
    assert "rank 0: cores 0, 1 thread(s); rank 1: cores 1, 1 thread(s)" in bind["note"]
    assert settings["threads"]["value"] == 1 and settings["threads"]["applied"]
    assert "2 worker processes" in settings["VLLM_ENABLE_V1_MULTIPROCESSING"]["note"]
    assert settings["attention_backend"]["value"], "read from the workers, where the layers are"
    tp1 = {s["name"]: s for s in json.loads((out / cells["1"]["folder"] / "determinism_applied.json").read_text())["settings"]}
    assert "VLLM_CPU_OMP_THREADS_BIND" not in tp1, "the in-process engine binds no threads"


@pytest.mark.engine
@needs_cpu_vllm
def test_workers_of_a_finished_run_are_gone(tp_sweep):
    _, _, seen = tp_sweep
    spawned = [c for c in seen.values() if "multiprocessing" in c]
    assert len(spawned) >= 2, f"expected two spawned vLLM workers among the descendants, saw {seen}"
    assert not _wait_gone(set(seen), 10), f"left behind: {_cmdlines(set(seen))}"


KEEP_ENGINE = """
import sys
from detllm.backends.vllm import VLLMBackend, VLLMOptions
backend = VLLMBackend("tiny", options=VLLMOptions(tensor_parallel_size=2), threads=1)
backend.engine()
print("READY", flush=True)
sys.stdin.read()
"""


@pytest.mark.engine
@needs_cpu_vllm
def test_workers_die_when_the_engine_process_is_killed_while_it_starts():
    """SIGKILL while vLLM's workers are still starting (before vLLM's own watch on its parent
    begins): the workers' PR_SET_PDEATHSIG (workerside.py) must take them down."""
    if not TWO_CORES:
        pytest.skip("needs two cores")
    proc = subprocess.Popen([sys.executable, "-c", KEEP_ENGINE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    seen: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 240
        while sum("multiprocessing" in c or "Worker" in c for c in seen.values()) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None, "the engine process ended before its workers started"
            seen |= _cmdlines(_children(proc.pid) - set(seen))
            time.sleep(0.1)
        time.sleep(2)  # the workers are importing torch and vLLM, or loading their shard
        seen |= _cmdlines(_children(proc.pid) - set(seen))
        assert sum("multiprocessing" in c or "Worker" in c for c in seen.values()) >= 2, seen
    finally:
        proc.send_signal(signal.SIGKILL)  # no atexit, no shutdown: only what the workers watch themselves
        proc.wait(30)
    # a worker killed mid-import exits when it reaches vLLM's worker init (it checks its parent there):
    # seconds on an idle machine, up to a worker's start-up time on a loaded one
    assert not _wait_gone(set(seen), 180), f"orphans after SIGKILL: {_cmdlines(set(seen))}"
