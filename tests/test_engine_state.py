"""Process-wide engine state that must not leak into a later run (issue 9, items 11-13):
identity caches keyed on content, vLLM's batch-invariant mode refused once it leaked,
TF32 read and set through torch's new fp32_precision API."""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
import types

import numpy as np
import pytest

from detllm.core import hashing, processwide
from detllm.backends.vllm import engine as vllm_engine
from detllm.core.errors import BackendError
from detllm.models import builtin_path


def _edit_in_place_keeping_size_and_mtime(path) -> None:
    """Scale the last 4 KiB of weights by 1.5, same size, and set mtime back to what it was."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(-4096, os.SEEK_END)
        vals = np.frombuffer(f.read(4096), dtype=np.float32) * np.float32(1.5)
        f.seek(-4096, os.SEEK_END)
        f.write(vals.astype(np.float32).tobytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns)


@pytest.fixture
def tiny_copy(tmp_path):
    dest = tmp_path / "tiny"
    shutil.copytree(builtin_path("tiny"), dest)
    return dest


# ------------------------------------------------------------------ item 11: caches keyed on content


def test_file_hash_sees_a_same_size_edit_with_mtime_set_back(tiny_copy, monkeypatch):
    monkeypatch.setattr(hashing, "RACY_NS", 0)  # treat the fresh copy as old: the memo is used
    weights = tiny_copy / "model.safetensors"
    before = hashing.sha256_file(weights)
    assert hashing.sha256_file(weights) == before  # unchanged: served from the memo
    _edit_in_place_keeping_size_and_mtime(weights)
    assert hashing.sha256_file(weights) != before
    assert hashing.sha256_file(weights) == hashing.sha256_bytes(weights.read_bytes())


def test_a_file_changed_just_before_its_hash_is_hashed_again(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 64)
    hashing.sha256_file(f)
    key = next(k for k in hashing._memo if k[0] == str(f.resolve()))
    hashing._memo[key] = ("0" * 64, hashing._memo[key][1])  # a stale entry under the same key
    assert hashing.sha256_file(f) == hashing.sha256_bytes(b"a" * 64), "a racy entry is never trusted"


def _counted_slow_prehash(monkeypatch, delay: float) -> list:
    """hashing._hash_file, counted per call; on the prehash thread its first read is `delay` s slow
    (after the hash's start time is taken), so a caller's sha256_file of the same file arrives while
    that hash is in flight and began before the call."""
    calls, real, real_sha = [], hashing._hash_file, hashlib.sha256

    def counted(path, key, busy, chunk=hashing._CHUNK):
        calls.append(threading.current_thread().name)
        return real(path, key, busy, chunk)

    class Slow:
        def __init__(self):
            self.h, self.slept = real_sha(), threading.current_thread().name != hashing._PRE_THREAD

        def update(self, data):
            if not self.slept:
                self.slept = True
                time.sleep(delay)
            self.h.update(data)

        def hexdigest(self):
            return self.h.hexdigest()

    monkeypatch.setattr(hashing, "_hash_file", counted)
    monkeypatch.setattr(hashing, "hashlib", types.SimpleNamespace(sha256=lambda *a: real_sha(*a) if a else Slow()))
    return calls


def _until_in_flight() -> None:
    """Return once the prehash thread has marked its file in flight (it then sleeps in its first read)."""
    deadline = time.monotonic() + 30
    while not hashing._inflight:
        assert time.monotonic() < deadline, "the prehash thread never started"
        time.sleep(0.001)


def _asked_while_prehashing(f, monkeypatch) -> list:
    """sha256_file(f) asked while a prehash of f is in flight (its read began before the call); the
    hash it returns checked against the bytes; the threads that read f, in order."""
    calls = _counted_slow_prehash(monkeypatch, 0.3)
    thread = hashing.prehash([f])
    _until_in_flight()
    assert hashing.sha256_file(f) == hashing.sha256_bytes(f.read_bytes())
    thread.join()
    return calls


def test_a_file_being_prehashed_is_waited_for_and_read_once(tmp_path, monkeypatch):
    monkeypatch.setattr(hashing, "RACY_NS", 0)  # the fresh file counts as old: the other thread's hash may be used
    f = tmp_path / "w.bin"
    f.write_bytes(os.urandom(3 << 20))
    calls = _asked_while_prehashing(f, monkeypatch)
    assert calls == [hashing._PRE_THREAD], calls  # read once, by the prehash thread; the caller waited
    assert not hashing._inflight


def test_a_racy_file_hashed_by_another_thread_before_the_call_is_read_again(tmp_path, monkeypatch):
    f = tmp_path / "w.bin"  # just written: changed within RACY_NS of any hash taken now
    f.write_bytes(os.urandom(1 << 20))
    calls = _asked_while_prehashing(f, monkeypatch)
    # the thread's read may have begun before the call and the file is racy: the caller reads it itself
    assert sorted(calls) == sorted([hashing._PRE_THREAD, "MainThread"]), calls


def test_prehash_of_a_file_it_cannot_read_leaves_the_error_to_the_caller(tmp_path):
    missing = tmp_path / "gone.bin"
    hashing.prehash([missing]).join()
    assert not hashing._inflight
    with pytest.raises(FileNotFoundError):
        hashing.sha256_file(missing)


def test_eight_threads_asking_one_version_read_its_metadata_once(monkeypatch):
    from detllm.runfolder import env

    reads = []

    def version(name):
        reads.append(name)
        time.sleep(0.05)  # the other threads ask while this read is on
        return "1.0"

    env._dist_version.cache_clear()
    monkeypatch.setattr(env.metadata, "version", version)
    try:
        threads = [threading.Thread(target=env.dist_version, args=("somedist",)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert reads == ["somedist"] and env.dist_version("somedist") == "1.0"
    finally:
        env._dist_version.cache_clear()


@pytest.mark.engine
def test_hf_reloads_a_model_edited_in_place(tiny_copy):
    from detllm.backends.hf import HFBackend

    first = HFBackend(str(tiny_copy))
    before = first.model_identity().weights_sha256
    assert HFBackend(str(tiny_copy)).model is first.model  # unchanged files: loaded once per process
    norm = first.model.state_dict()["model.norm.weight"].clone()  # the last tensor in the file
    _edit_in_place_keeping_size_and_mtime(tiny_copy / "model.safetensors")
    second = HFBackend(str(tiny_copy))
    assert second.model is not first.model, "a same-size in-place edit must not reuse the stale model"
    assert second.model_identity().weights_sha256 != before
    assert bool((second.model.state_dict()["model.norm.weight"] == norm * 1.5).all()), "the reload holds the edited weights"


# ------------------------------------------------------------------ item 12: vLLM batch-invariant leak


def test_batch_invariant_mode_left_on_refuses_a_later_hf_run(monkeypatch, cli, tmp_path):
    monkeypatch.setattr(processwide, "_BI_STARTED", True)
    out = tmp_path / "run"
    res = cli("check", "--backend", "hf", "--model", "tiny", "--runs", "2", "--out", out, "--no-progress")
    assert res.exit_code == 8, res.output
    assert "batch-invariant mode was switched on earlier in this process" in res.output
    assert "new process" in res.output and "Traceback" not in res.output
    assert not out.exists(), "refused before anything was written"


@pytest.mark.engine
def test_an_hf_backend_built_before_the_mode_leaked_is_refused_too(monkeypatch):
    from detllm.backends.hf import HFBackend

    b = HFBackend("tiny")
    monkeypatch.setattr(processwide, "_BI_STARTED", True)
    with pytest.raises(BackendError, match="the hf backend would compute with it"):
        with b.determinism(tier=1, seed=0, threads=None):
            pass


def test_batch_invariant_state_is_read_from_vllms_own_flag(monkeypatch):
    import sys
    import types

    assert not processwide.batch_invariant_in_process()
    for name in processwide._BI_MODULES_LOADED:  # the module vLLM keeps its flag in, whichever release
        if name in sys.modules:
            monkeypatch.setattr(sys.modules[name], "_batch_invariant_MODE", True)
            break
    else:
        # vLLM not imported in this process: the bookkeeping reads only sys.modules, never imports it
        mod = types.ModuleType(processwide._BI_MODULES_LOADED[-1])
        mod._batch_invariant_MODE = True
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    assert processwide.batch_invariant_in_process()
    with pytest.raises(BackendError, match="cannot be switched off"):
        processwide.refuse_after_batch_invariant("the hf backend")


def test_engine_without_batch_invariant_is_refused_before_vllm_starts(monkeypatch):
    monkeypatch.setattr(processwide, "_BI_STARTED", True)
    monkeypatch.setattr(vllm_engine, "_ENGINE", None)
    with pytest.raises(BackendError, match="an engine without batch_invariant"):
        vllm_engine.start_engine(("k",), {"VLLM_BATCH_INVARIANT": "0"}, {})


# ------------------------------------------------------------------ item 13: TF32 through the new API


@pytest.fixture
def torch_tf32():
    torch = pytest.importorskip("torch")
    saved = processwide.read_tf32(torch)
    yield torch
    processwide.write_tf32(torch, saved)


def test_tf32_uses_the_new_api_and_survives_a_mixed_state(torch_tf32):
    torch = torch_tf32
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip("torch < 2.9 has only the legacy allow_tf32 flags")
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # as user code or vLLM would
    with pytest.raises(RuntimeError):
        torch.backends.cuda.matmul.allow_tf32  # noqa: B018 - the legacy read that used to crash a run
    saved = processwide.read_tf32(torch)
    assert saved["cuda.matmul.fp32_precision"] == "tf32"
    now = processwide.disable_tf32(torch)
    assert processwide.tf32_is_off(now) and set(now) == {f"{p}.{a}" for p, a in processwide.TF32_NEW_API}
    processwide.write_tf32(torch, saved)
    assert processwide.read_tf32(torch) == saved


@pytest.mark.engine
def test_hf_run_after_the_new_api_was_used_is_not_a_traceback(torch_tf32, tmp_path):
    import detllm

    torch_tf32.backends.cuda.matmul.fp32_precision = "tf32"
    outcome = detllm.check(backend="hf", model="tiny", runs=2, max_new_tokens=4, out=tmp_path / "c")
    assert outcome.status == "PASS"
    assert torch_tf32.backends.cuda.matmul.fp32_precision == "tf32", "restored after the run"


def test_tf32_failures_are_backend_errors():
    class Matmul:
        @property
        def fp32_precision(self):
            raise RuntimeError("mix of the legacy and new APIs\nmore")

    class Torch:
        class backends:
            class cuda:
                matmul = Matmul()

    with pytest.raises(BackendError, match="cannot read torch's TF32 setting torch.backends.cuda.matmul.fp32_precision"):
        processwide.read_tf32(Torch)
