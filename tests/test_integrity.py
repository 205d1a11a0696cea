"""Manifest, hash chain and `verify`: every tamper scenario is caught and named, the chain is
the one docs/integrity.md spells out byte for byte, and verify never imports torch."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import detllm
from detllm.runfolder import artifacts, schema_io
from detllm.core.errors import ArtifactError, DetllmError, IntegrityError
from detllm.runfolder.integrity import SIG, seal
from detllm.commands.verify import verify

from .conftest import assert_valid_run

TRACE_LINES = 12  # 4 built-in prompts x 3 runs


@pytest.fixture(scope="module")
def sealed_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sealed") / "run"
    detllm.check(backend="fake", tier=2, out=out)
    return out


@pytest.fixture
def run(sealed_run, tmp_path) -> Path:
    """A fresh copy to tamper with."""
    dest = tmp_path / "run"
    shutil.copytree(sealed_run, dest)
    return dest


def lines(folder: Path) -> list[bytes]:
    return (folder / "trace.jsonl").read_bytes().splitlines(keepends=True)


def write_lines(folder: Path, new: list[bytes]) -> None:
    (folder / "trace.jsonl").write_bytes(b"".join(new))


def verify_fails(cli, folder: Path, code: int, *needles: str) -> str:
    r = cli("verify", folder)
    assert r.exit_code == code, r.output
    for n in needles:
        assert n in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1, "one line on stderr"
    return r.stderr


# ---------------------------------------------------------------- the manifest


def test_manifest_lists_every_file_and_is_schema_valid(run):
    assert_valid_run(run)  # validates manifest.json too (artifacts.JSON_FILES)
    manifest = json.loads((run / "manifest.json").read_text())
    on_disk = sorted(p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file() and p.name != "manifest.json")
    assert [f["path"] for f in manifest["files"]] == on_disk
    for f in manifest["files"]:
        data = (run / f["path"]).read_bytes()
        assert (f["sha256"], f["size"]) == (hashlib.sha256(data).hexdigest(), len(data))
    assert manifest["trace"]["records"] == len(manifest["trace"]["record_hashes"]) == TRACE_LINES


def test_chain_is_the_documented_byte_format(run):
    """An independent re-implementation of docs/integrity.md reaches the manifest's genesis and head."""
    manifest = json.loads((run / "manifest.json").read_text())
    rc = (run / "run_config.json").read_bytes()
    model = json.loads(rc)["model"]
    assert manifest["trace"]["chain"] == "detllm-trace-chain/2"
    h = hashlib.sha256(b"detllm-trace-chain/2 genesis\x00" + hashlib.sha256(rc).digest()
                       + hashlib.sha256((run / "env.json").read_bytes()).digest()
                       + hashlib.sha256((run / "determinism_applied.json").read_bytes()).digest()
                       + bytes.fromhex(model["weights_sha256"]) + bytes.fromhex(model["tokenizer_sha256"])).digest()
    assert h.hex() == manifest["trace"]["genesis"]
    for i, line in enumerate((run / "trace.jsonl").read_text(encoding="utf-8").splitlines(), 1):
        canon = json.dumps(json.loads(line), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        h = hashlib.sha256(b"detllm-trace-chain/2 record\x00" + h + hashlib.sha256(canon).digest() + i.to_bytes(8, "little")).digest()
        assert h.hex()[:16] == manifest["trace"]["record_hashes"][i - 1]
    assert h.hex() == manifest["trace"]["head"]


def test_manifest_is_written_last_and_sealing_is_deterministic(tmp_path, monkeypatch):
    written = []
    real = schema_io.atomic_write_text
    spy = lambda p, t: (written.append(Path(p).name), real(p, t))[1]  # noqa: E731
    for module in (schema_io, artifacts):  # integrity writes through schema_io, the runner through artifacts
        monkeypatch.setattr(module, "atomic_write_text", spy)
    out = tmp_path / "run"
    detllm.check(backend="fake", out=out)
    assert written[-1] == "manifest.json"
    first = (out / "manifest.json").read_bytes()
    seal(out)
    assert (out / "manifest.json").read_bytes() == first, "no timestamps: re-sealing the same bytes gives the same manifest"


def test_a_diff_folder_is_sealed_without_a_chain(sealed_run, tmp_path, cli):
    r = cli("diff", sealed_run, f"{sealed_run}::run_1", "--out", tmp_path / "d")
    assert r.exit_code == 0, r.output
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert manifest["trace"] is None and manifest["files"]
    assert cli("verify", tmp_path / "d").exit_code == 0


# ---------------------------------------------------------------- verify: clean


def test_verify_passes_on_an_untouched_run(cli, run):
    r = cli("verify", run)
    assert r.exit_code == 0, r.output
    assert f"{TRACE_LINES} trace records chained" in r.stdout
    assert "signature absent" in r.stdout
    assert "verdict re-derived from the trace: PASS" in r.stdout
    assert "note: unsigned: this shows the files are unchanged since sealing" in r.stdout


def test_verify_json_output(cli, run):
    r = cli("verify", run, "--json")
    assert r.exit_code == 0
    doc = json.loads(r.stdout)
    assert doc["ok"] is True and doc["records"] == TRACE_LINES and doc["signature"] == "absent"


# ---------------------------------------------------------------- verify: tamper scenarios


def test_flipped_byte_in_the_trace_names_the_line(cli, run):
    ls = lines(run)
    b = bytearray(ls[4])
    b[len(b) // 2] ^= 0x01
    ls[4] = bytes(b)
    write_lines(run, ls)
    verify_fails(cli, run, 6, "trace.jsonl line 5")


def test_edited_token_id_reserialised_validly_names_the_line(cli, run):
    ls = lines(run)
    rec = json.loads(ls[6])
    rec["token_ids"][3] += 1
    ls[6] = (json.dumps(rec, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
    write_lines(run, ls)
    assert artifacts.validate(rec, "trace_record") is None  # still a valid record
    verify_fails(cli, run, 6, "trace.jsonl line 7", "does not match the hash chain")


def test_reordered_lines_name_the_first_moved_line(cli, run):
    ls = lines(run)
    ls[2], ls[3] = ls[3], ls[2]
    write_lines(run, ls)
    verify_fails(cli, run, 6, "trace.jsonl line 3", "reordered")


def test_truncated_trace_is_caught(cli, run):
    write_lines(run, lines(run)[:-1])
    verify_fails(cli, run, 6, f"holds {TRACE_LINES - 1} records, the manifest records {TRACE_LINES}")


def test_trace_cut_mid_line_names_the_line(cli, run):
    ls = lines(run)
    write_lines(run, ls[:-1] + [ls[-1][:40]])
    verify_fails(cli, run, 6, f"trace.jsonl line {TRACE_LINES}: not valid JSON")


def test_duplicated_line_is_caught_where_it_was_inserted(cli, run):
    ls = lines(run)
    write_lines(run, ls[:2] + [ls[1]] + ls[2:])
    verify_fails(cli, run, 6, "trace.jsonl line 3")


def test_reserialised_trace_with_the_same_records_is_still_a_changed_file(cli, run):
    recs = [json.loads(x) for x in lines(run)]
    write_lines(run, [(json.dumps(r, indent=None) + "\n").encode() for r in recs])  # ", " and ": " spacing
    verify_fails(cli, run, 6, "trace.jsonl", "re-serialised")


def test_edited_env_json_is_named(cli, run):
    env = json.loads((run / "env.json").read_text())
    env["python"]["version"] = "3.99.0"
    (run / "env.json").write_text(json.dumps(env, indent=2) + "\n")
    verify_fails(cli, run, 6, "env.json: changed after sealing", "more problem")  # + the chain genesis


def test_added_file_is_named(cli, run):
    (run / "notes.txt").write_text("hello\n")
    verify_fails(cli, run, 6, "notes.txt: is not in the manifest")


def test_removed_file_is_named(cli, run):
    (run / "report.txt").unlink()
    verify_fails(cli, run, 6, "report.txt: is listed in the manifest but missing")


def test_edited_chain_in_the_manifest_is_named(cli, run):
    m = json.loads((run / "manifest.json").read_text())
    m["trace"]["record_hashes"][5] = "0" * 16
    (run / "manifest.json").write_text(json.dumps(m, indent=2) + "\n")
    verify_fails(cli, run, 6, "trace.jsonl line 6", "manifest.json's chain was edited")


def test_symlink_in_the_folder_is_refused(cli, run):
    os.symlink("/etc/passwd", run / "passwd.txt")
    verify_fails(cli, run, 6, "passwd.txt: is a symlink")


def test_no_manifest_is_not_a_pack(cli, run):
    (run / "manifest.json").unlink()
    verify_fails(cli, run, 5, "without a manifest")
    verify_fails(cli, run.parent / "missing", 5)


def test_schema_error_sealed_as_is_exits_5(cli, run):
    rep = json.loads((run / "report.json").read_text())
    rep["status"] = "MAYBE"
    (run / "report.json").write_text(json.dumps(rep))
    seal(run)
    verify_fails(cli, run, 5, "report.json", "schema violation")


def test_schema_error_in_a_sealed_trace_line_exits_5(cli, run):
    ls = lines(run)
    rec = json.loads(ls[0])
    rec["finish_reason"] = "eos"
    ls[0] = (json.dumps(rec) + "\n").encode()
    write_lines(run, ls)
    seal(run)
    verify_fails(cli, run, 5, "trace.jsonl line 1: schema violation: finish_reason")


def test_library_raises_the_error_classes(run):
    assert verify(run).records == TRACE_LINES
    (run / "extra.json").write_text("{}")
    with pytest.raises(IntegrityError):
        verify(run)
    (run / "manifest.json").unlink()
    with pytest.raises(ArtifactError):
        verify(run)


# ---------------------------------------------------------------- signing


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    ser = pytest.importorskip("cryptography.hazmat.primitives.serialization")
    ed = pytest.importorskip("cryptography.hazmat.primitives.asymmetric.ed25519")
    d = tmp_path_factory.mktemp("keys")
    out = {}
    for name in ("mine", "other"):
        k = ed.Ed25519PrivateKey.generate()
        (d / f"{name}.pem").write_bytes(k.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8, ser.NoEncryption()))
        (d / f"{name}.pub").write_bytes(k.public_key().public_bytes(ser.Encoding.PEM, ser.PublicFormat.SubjectPublicKeyInfo))
        (d / f"{name}.ssh").write_bytes(k.public_key().public_bytes(ser.Encoding.OpenSSH, ser.PublicFormat.OpenSSH))
        out[name] = d / name
    return out


def test_signed_run_verifies_with_its_key_only(cli, tmp_path, keys):
    out = tmp_path / "run"
    r = cli("check", "--backend", "fake", "--out", out, "--sign-key", f"{keys['mine']}.pem", "--no-progress")
    assert r.exit_code == 0, r.output
    assert (out / SIG).is_file()
    ok = cli("verify", out, "--pubkey", f"{keys['mine']}.pub")
    assert ok.exit_code == 0 and "signature verified by key sha256" in ok.stdout, ok.output
    assert cli("verify", out, "--pubkey", f"{keys['mine']}.ssh").exit_code == 0
    assert "signature not checked" in cli("verify", out).stdout
    bad = cli("verify", out, "--pubkey", f"{keys['other']}.pub")
    assert bad.exit_code == 6 and "manifest.sig: does not verify" in bad.stderr


def test_a_forger_who_reseals_passes_unsigned_verify_but_not_the_signature(cli, tmp_path, keys):
    out = tmp_path / "run"
    detllm.check(backend="fake", out=out, sign_key=f"{keys['mine']}.pem")
    old_sig = (out / SIG).read_bytes()
    rc = json.loads((out / "run_config.json").read_text())
    rc["config"]["seed"] = 7
    (out / "run_config.json").write_text(json.dumps(rc, indent=2) + "\n")
    seal(out)  # the forger recomputes the manifest (and cannot sign it)
    assert not (out / SIG).exists(), "re-sealing without a key drops the stale signature"
    assert cli("verify", out).exit_code == 0, "an unsigned hash catches accidents, not a forger"
    r = cli("verify", out, "--pubkey", f"{keys['mine']}.pub")
    assert r.exit_code == 6 and "manifest.sig: missing" in r.stderr
    (out / SIG).write_bytes(old_sig)  # ... or keeps the old signature
    r = cli("verify", out, "--pubkey", f"{keys['mine']}.pub")
    assert r.exit_code == 6 and "does not verify" in r.stderr


def test_replay_with_pubkey_refuses_an_unsigned_pack(cli, tmp_path, keys):
    signed, unsigned = tmp_path / "signed", tmp_path / "unsigned"
    detllm.check(backend="fake", out=signed, sign_key=f"{keys['mine']}.pem")
    detllm.check(backend="fake", out=unsigned)
    ok = cli("replay", signed, "--pubkey", f"{keys['mine']}.pub", "--out", tmp_path / "r1", "--no-progress")
    assert ok.exit_code == 0, ok.output
    r = cli("replay", unsigned, "--pubkey", f"{keys['mine']}.pub", "--out", tmp_path / "r2")
    assert r.exit_code == 6 and "manifest.sig: missing" in r.stderr
    assert not (tmp_path / "r2").exists()


def test_bad_sign_key_is_refused_before_anything_is_written(cli, tmp_path):
    (tmp_path / "key.pem").write_text("not a key\n")
    out = tmp_path / "run"
    r = cli("check", "--backend", "fake", "--out", out, "--sign-key", tmp_path / "key.pem")
    assert r.exit_code == 2 and "--sign-key" in r.stderr
    assert not out.exists()


def test_missing_cryptography_says_what_to_install(cli, tmp_path, monkeypatch, sealed_run):
    for mod in ("cryptography", "cryptography.hazmat.primitives", "cryptography.hazmat.primitives.asymmetric",
                "cryptography.exceptions"):
        monkeypatch.setitem(sys.modules, mod, None)  # makes `import` raise ImportError
    (tmp_path / "k.pem").write_text("x")
    r = cli("verify", sealed_run, "--pubkey", tmp_path / "k.pem")
    assert r.exit_code == 2 and "install detllm[sign]" in r.stderr
    r = cli("check", "--backend", "fake", "--out", tmp_path / "run", "--sign-key", tmp_path / "k.pem")
    assert r.exit_code == 2 and "install detllm[sign]" in r.stderr


# ---------------------------------------------------------------- no torch


PROBE = """
import sys
from typer.testing import CliRunner
from detllm.cli import app
r = CliRunner().invoke(app, {args!r})
heavy = sorted(m for m in ("torch", "transformers", "vllm", "numpy", "cryptography") if m in sys.modules)
print("EXIT", r.exit_code, "HEAVY", ",".join(heavy) or "-")
"""


def test_verify_does_not_import_torch(sealed_run, tmp_path):
    pack = detllm.create_pack(sealed_run, tmp_path / "p.tar.gz")
    for target in (sealed_run, pack):
        out = subprocess.run([sys.executable, "-c", PROBE.format(args=["verify", str(target)])],
                             capture_output=True, text=True, timeout=120)
        assert out.stdout.strip().splitlines()[-1] == "EXIT 0 HEAVY -", out.stdout + out.stderr


def test_seal_from_the_writers_digests_equals_sealing_from_disk(tmp_path):
    """The runner seals with the TraceWriter's record digests; re-reading the trace gives the same manifest."""
    from detllm.runfolder.integrity import build_manifest

    out = tmp_path / "run"
    detllm.check(backend="fake", vary_batch=(1, 3), out=out)
    written = json.loads((out / "manifest.json").read_text())
    assert build_manifest(out) == written
    lines = (out / "trace.jsonl").read_text().splitlines()
    wrong = [b"\0" * 32] * len(lines)
    assert build_manifest(out, wrong)["trace"]["head"] != written["trace"]["head"]  # the digests are used ...
    assert build_manifest(out, wrong[:-1]) == written  # ... only when they cover every line


# ---------------------------------------------------------------- verify: the verdict follows from the trace (rederive.py)


@pytest.fixture(scope="module")
def failed_check(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("forge") / "fail"
    outcome = detllm.check(backend="fake", options={"diverge": "prompt=2,pos=5,run=1"}, out=out)
    assert outcome.status == "FAIL"
    return out


def forge(src: Path, dest: Path, **fields) -> Path:
    """Copy `src`, edit report.json's fields, re-seal unsigned: what a forger without a key can do."""
    shutil.copytree(src, dest)
    rep = json.loads((dest / "report.json").read_text())
    rep.update(fields)
    (dest / "report.json").write_text(json.dumps(rep, indent=2) + "\n")
    seal(dest)
    return dest


def test_an_untouched_fail_verifies_and_its_verdict_is_re_derived(cli, failed_check):
    r = cli("verify", failed_check)
    assert r.exit_code == 0, r.output
    assert "verdict re-derived from the trace: FAIL (RUN_VARIANCE)" in r.stdout
    assert json.loads(cli("verify", failed_check, "--json").stdout)["verdict"].startswith("verdict re-derived")


def test_a_fail_edited_to_pass_and_resealed_is_refused(cli, failed_check, tmp_path):
    forged = forge(failed_check, tmp_path / "forged", status="PASS", category="PASS", first_divergence=None, causes=[])
    r = cli("verify", forged)
    assert r.exit_code == 6, r.output
    assert r.stderr.startswith("detllm: error: report.json: status is 'PASS', but the sealed trace gives 'FAIL'")
    assert len(r.stderr.strip().splitlines()) == 1
    pack = tmp_path / "forged.tar.gz"
    from detllm.commands.pack import create_pack

    with pytest.raises(IntegrityError, match="report.json: status"):
        create_pack(forged, pack)  # pack verifies first: a forged folder is never packed
    assert not pack.exists()


@pytest.mark.parametrize("field,value,needle", [
    ("category", "BATCH_VARIANCE", "report.json: category is 'BATCH_VARIANCE', but the sealed trace gives 'RUN_VARIANCE'"),
    ("first_divergence", None, "report.json: first_divergence is None, but the sealed trace gives a divergence"),
    ("command", "replay", "report.json: command is 'replay', but run_config.json records 'check'"),
])
def test_each_forged_verdict_field_is_named(cli, failed_check, tmp_path, field, value, needle):
    r = cli("verify", forge(failed_check, tmp_path / "forged", **{field: value}))
    assert r.exit_code == 6 and needle in r.stderr, r.output


def test_a_moved_first_divergence_is_named(cli, failed_check, tmp_path):
    first = json.loads((failed_check / "report.json").read_text())["first_divergence"]
    r = cli("verify", forge(failed_check, tmp_path / "forged", first_divergence={**first, "token_index": first["token_index"] + 1}))
    assert r.exit_code == 6 and "report.json: first_divergence is a divergence at" in r.stderr, r.output


def test_a_run_report_edited_to_pass_is_refused(cli, tmp_path):
    out = detllm.run(backend="fake", out=tmp_path / "run").out_dir
    r = cli("verify", forge(out, tmp_path / "forged", status="PASS", category="PASS"))
    assert r.exit_code == 6 and "report.json: status is 'PASS', but the sealed trace gives 'RECORDED'" in r.stderr


def test_the_verdict_re_derived_in_a_second_process_says_the_same(monkeypatch, failed_check, tmp_path):
    """verify re-derives a large trace's verdict in a second process while it checks the bytes
    (rederive.Ahead): the same answers, the same errors, and an early problem still named first."""
    from detllm.pipeline import rederive

    forged = forge(failed_check, tmp_path / "forged", status="PASS", category="PASS", first_divergence=None, causes=[])
    tampered = tmp_path / "tampered"
    shutil.copytree(failed_check, tampered)
    lines = (tampered / "trace.jsonl").read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].replace(b'"token_ids":[', b'"token_ids":[7,', 1)
    (tampered / "trace.jsonl").write_bytes(b"".join(lines))

    def outcome(folder):
        try:
            return verify(folder).verdict
        except DetllmError as exc:
            return f"{type(exc).__name__}: {exc}"

    here = [outcome(f) for f in (failed_check, forged, tampered)]
    started = []
    real = rederive.Ahead.start
    monkeypatch.setattr(rederive.Ahead, "start", classmethod(lambda cls, folder: started.append(real(folder)) or started[-1]))
    monkeypatch.setattr(rederive, "AHEAD_MIN_BYTES", 0)
    ahead = [outcome(f) for f in (failed_check, forged, tampered)]
    assert ahead == here
    assert here[0].startswith("verdict re-derived from the trace: FAIL")
    assert here[1].startswith("IntegrityError: report.json: status is 'PASS'")
    assert here[2].startswith("IntegrityError: trace.jsonl line 2")
    assert len(started) == 3 and all(a is not None for a in started), "no second process was started"
    assert all(a.proc.poll() is not None for a in started), "a re-deriving process outlived verify"


def test_folders_whose_verdict_cannot_be_re_derived_say_so(cli, failed_check, tmp_path):
    v1 = Path(__file__).parent / "fixtures" / "v1" / "check_fail.tar.gz"
    r = cli("verify", v1)
    assert r.exit_code == 0, r.output
    assert "verdict not re-derived: written under schema_version 1" in r.stdout
    assert cli("diff", failed_check, failed_check, "--out", tmp_path / "d").exit_code == 0
    r = cli("verify", tmp_path / "d")
    assert r.exit_code == 0 and "not re-derived: the comparison itself and the ranking of causes" in r.stdout, r.output


# ---------------------------------------------------------------- the long-array path (tracescan.py)

LINE_EDITS = {  # edits of trace line 2, each a problem verify names (as a schema error when resealed)
    "negative top-k id": (b'"top_logprobs":[[[', b'"top_logprobs":[[[-'),
    "overflowing logprob": (b'"logprobs":[', b'"logprobs":[1e400,'),
    "leading zero": (b'"token_ids":[', b'"token_ids":[01,'),
    "an integer for a step": (b'"top_logprobs":[', b'"top_logprobs":[5,'),
    "an extra step": (b'"top_logprobs":[', b'"top_logprobs":[[],'),  # valid: only the chain breaks
    "a space": (b'"logprobs":[', b'"logprobs":[ '),  # valid JSON: a changed file, the same record
}


@pytest.mark.parametrize("reseal", [False, True], ids=["tampered", "sealed-as-is"])
def test_the_long_path_names_the_same_problems(cli, sealed_run, tmp_path, monkeypatch, reseal):
    """verify says the same thing whether a line's arrays are checked by the patterns or by the
    long path (simdjson + bytes.translate), for edits that break the schema, the JSON or only the chain."""
    from detllm.runfolder import tracescan

    answers = set()
    for name, (old, new) in LINE_EDITS.items():
        run = tmp_path / name.replace(" ", "-")
        shutil.copytree(sealed_run, run)
        ls = lines(run)
        assert old in ls[1]
        ls[1] = ls[1].replace(old, new, 1)
        write_lines(run, ls)
        if reseal:
            try:
                seal(run)
            except ArtifactError:  # a line that is not JSON is never sealed
                assert name == "leading zero"
                continue
        said = []
        for long_value in (4096, 0):
            monkeypatch.setattr(tracescan, "LONG_VALUE", long_value)
            r = cli("verify", run)
            said.append((r.exit_code, r.stderr))
        assert said[0] == said[1], name
        answers.add(said[0][0])
    # tampered: every edit is named as a changed trace line; sealed as-is: schema errors (5), and the
    # valid edits pass the bytes check (0, or 6 where the verdict no longer follows from the trace)
    assert answers == {0, 5, 6} if reseal else answers == {6}


@pytest.mark.parametrize("chunk", [1, 5, 64, 4 << 20])
@pytest.mark.parametrize("data", [b"", b"\n", b'{"a":1}\n\n' + b"x" * 300 + b"\r\nlast, no newline", b"one\ntwo\n"])
def test_lines_yields_every_line_and_hashes_every_byte(tmp_path, monkeypatch, chunk, data):
    """tracescan.Lines over reads of any size (a line across reads, longer than a read; the
    hashing thread starts on the first full read) gives what iterating the file gives."""
    import io

    from detllm.runfolder import tracescan

    monkeypatch.setattr(tracescan, "_CHUNK", chunk)
    p = tmp_path / "t.jsonl"
    p.write_bytes(data)
    reader = tracescan.Lines(p)
    expected = [(n, line.removesuffix(b"\n")) for n, line in enumerate(io.BytesIO(data), 1)]
    assert list(reader) == expected
    assert (reader.sha.hexdigest(), reader.size) == (hashlib.sha256(data).hexdigest(), len(data))


# ---------------------------------------------------------------- R8: every input of the re-derivation is bound


@pytest.fixture(scope="module")
def logprob_fail(tmp_path_factory) -> Path:
    """A FAIL only tier 2 sees: a logprob moved by 1e-6 on a repeat (at tier 1 it would PASS)."""
    out = tmp_path_factory.mktemp("tierforge") / "fail"
    outcome = detllm.check(backend="fake", options={"diverge": "prompt=0,pos=1,run=1,what=logprob"}, tier=2, runs=2,
                           prompts=["hello there", "general kenobi"], max_new_tokens=6, out=out)
    assert outcome.status == "FAIL" and outcome.report["tier"] == {"requested": 2, "effective": 2}
    return out


def _downgrade(src: Path, dest: Path, **caps) -> Path:
    """The review's forgery: tier_effective 2 -> 1 in determinism_applied.json (and, with `caps`, the recorded
    capabilities that would allow it), report.json made the PASS a tier-1 check gives."""
    shutil.copytree(src, dest)
    applied = json.loads((dest / "determinism_applied.json").read_text())
    applied.update(tier_effective=1, downgraded=True, downgrade_reason="backend 'fake' enforces tier 1 at most")
    applied["capabilities"].update(caps)
    (dest / "determinism_applied.json").write_text(json.dumps(applied, indent=2) + "\n")
    rep = json.loads((dest / "report.json").read_text())
    rep.update(status="PASS", category="PASS", first_divergence=None, causes=[], tier={"requested": 2, "effective": 1})
    for c in rep["comparisons"]:
        c.update(status="INFO", required=False)
    (dest / "report.json").write_text(json.dumps(rep, indent=2) + "\n")
    shutil.rmtree(dest / "diffs", ignore_errors=True)
    return dest


def test_a_fail_forged_to_pass_through_the_effective_tier_is_refused(cli, logprob_fail, tmp_path):
    forged = _downgrade(logprob_fail, tmp_path / "forged")
    seal(forged)  # the forger recomputes the manifest
    r = cli("verify", forged)
    assert r.exit_code == 6, r.output
    assert r.stderr.startswith("detllm: error: determinism_applied.json: tier_requested/tier_effective/mode/downgraded "
                               "are [2, 1, 'best-effort', True], but the chained request (tier 2, mode best-effort) under "
                               "the recorded capabilities gives [2, 2, 'best-effort', False]"), r.stderr
    assert cli("pack", forged, "-o", tmp_path / "forged.tar.gz").exit_code == 6
    assert not (tmp_path / "forged.tar.gz").exists()


def test_determinism_applied_is_bound_by_the_chain_genesis(cli, logprob_fail, tmp_path):
    """Edited and the files' digests recomputed, the trace's chain left as it was: h0 no longer matches;
    resealed, the head moves (so a published head or a signature tells)."""
    forged = _downgrade(logprob_fail, tmp_path / "forged", max_tier=1)
    manifest = json.loads((forged / "manifest.json").read_text())
    from detllm.runfolder.integrity import file_digest

    manifest["files"] = [{**f, **dict(zip(("sha256", "size"), file_digest(forged / f["path"])))}
                         for f in manifest["files"] if (forged / f["path"]).is_file()]
    (forged / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    r = cli("verify", forged)
    assert r.exit_code == 6, r.output
    assert "trace.jsonl: chain genesis does not match: run_config.json, env.json, determinism_applied.json" in r.stderr
    head = json.loads((logprob_fail / "manifest.json").read_text())["trace"]["head"]
    assert seal(forged)["trace"]["head"] != head


def test_report_tier_must_follow_from_the_request(cli, logprob_fail, tmp_path):
    forged = forge(logprob_fail, tmp_path / "forged", tier={"requested": 2, "effective": 1})
    r = cli("verify", forged)
    assert r.exit_code == 6 and "report.json: tier is {'requested': 2, 'effective': 1}" in r.stderr, r.output


def test_an_honest_downgraded_check_verifies(cli, tmp_path):
    """Best-effort tier 3 on a backend that enforces tier 1: the gate re-derived at verify time agrees."""
    out = tmp_path / "down"
    outcome = detllm.check(backend="fake", options={"max_tier": "1"}, tier=3, mode="best-effort", vary_batch=(1, 2), out=out)
    assert outcome.report["tier"] == {"requested": 3, "effective": 1}
    r = cli("verify", out)
    assert r.exit_code == 0 and "verdict re-derived from the trace: PASS" in r.stdout, r.output
