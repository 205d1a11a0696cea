"""`detllm pack` and reading .tar.gz packs: reproducible archives, readable wherever a folder is,
and extraction that refuses every unsafe member and never loads anything but JSON."""

from __future__ import annotations

import io
import json
import pickle
import tarfile
import tempfile
from pathlib import Path

import pytest

import detllm
from detllm.runfolder import artifacts
from detllm.core.errors import IntegrityError
from detllm.runfolder.archive import Limits, extract
from detllm.runfolder.artifacts import load_run as load_pack


@pytest.fixture(scope="module")
def sealed_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("packsrc") / "run"
    detllm.check(backend="fake", out=out)
    return out


@pytest.fixture(scope="module")
def pack(sealed_run, tmp_path_factory) -> Path:
    return detllm.create_pack(sealed_run, tmp_path_factory.mktemp("pack") / "run.tar.gz")


# ---------------------------------------------------------------- creating


def test_pack_roundtrip_and_reproducible_bytes(cli, sealed_run, tmp_path):
    r = cli("pack", sealed_run, "-o", tmp_path / "a.tar.gz")
    assert r.exit_code == 0, r.output
    detllm.create_pack(sealed_run, tmp_path / "b" / "a.tar.gz")
    assert (tmp_path / "a.tar.gz").read_bytes() == (tmp_path / "b" / "a.tar.gz").read_bytes()
    with tarfile.open(tmp_path / "a.tar.gz") as tar:
        members = tar.getmembers()
    assert {m.name.split("/")[0] for m in members} == {"a"}, "one top-level folder named after the pack"
    assert all(m.mtime == 0 and m.uid == 0 and m.uname == "" for m in members)
    listed = {f["path"] for f in json.loads((sealed_run / "manifest.json").read_text())["files"]}
    assert {m.name.removeprefix("a/") for m in members if m.isfile()} == listed | {"manifest.json"}


def test_pack_refuses_a_tampered_or_unsealed_folder(cli, sealed_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(sealed_run, run)
    (run / "report.txt").write_text("edited\n")
    r = cli("pack", run, "-o", tmp_path / "x.tar.gz")
    assert r.exit_code == 6 and "report.txt" in r.stderr
    (run / "manifest.json").unlink()
    assert cli("pack", run, "-o", tmp_path / "x.tar.gz").exit_code == 5
    assert not (tmp_path / "x.tar.gz").exists()


def test_pack_refuses_bad_destinations(cli, sealed_run, pack, tmp_path):
    assert cli("pack", sealed_run, "-o", tmp_path / "x.zip").exit_code == 2
    r = cli("pack", sealed_run, "-o", sealed_run / "x.tar.gz")
    assert r.exit_code == 2 and "inside the run folder" in r.stderr
    r = cli("pack", sealed_run, "-o", pack)
    assert r.exit_code == 2 and "exists" in r.stderr
    assert cli("pack", sealed_run, "-o", pack, "--force").exit_code == 0


# ---------------------------------------------------------------- reading packs where folders go


def test_verify_report_and_load_run_read_a_pack(cli, pack, sealed_run):
    r = cli("verify", pack)
    assert r.exit_code == 0 and "12 trace records chained" in r.stdout, r.output
    rep = cli("report", pack, "--format", "json")
    assert rep.exit_code == 0 and json.loads(rep.stdout)["status"] == "PASS"
    run = load_pack(pack)
    assert run.path == pack and len(run.records) == 12
    assert run.records == artifacts.load_run(sealed_run).records


def test_diff_and_replay_read_a_pack(cli, pack, sealed_run, tmp_path):
    r = cli("diff", pack, f"{sealed_run}::run_1")
    assert r.exit_code == 0, r.output
    r = cli("replay", pack, "--out", tmp_path / "r", "--no-progress")
    assert r.exit_code == 0, r.output


def test_extraction_leaves_no_temporary_folder(cli, pack, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert cli("verify", pack).exit_code == 0
    assert list(tmp_path.iterdir()) == []


def test_not_a_tar_gz_is_an_artifact_error(cli, tmp_path):
    bogus = tmp_path / "bogus.tar.gz"
    bogus.write_bytes(b"this is not gzip")
    r = cli("verify", bogus)
    assert r.exit_code == 5 and "not a readable .tar.gz pack" in r.stderr


# ---------------------------------------------------------------- unsafe archives


def make_tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes | None = b"{}", linkname: str = "") -> tuple:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info, (data if kind == tarfile.REGTYPE else None)


UNSAFE = {
    "absolute": ([member("/tmp/detllm-evil.json")], "absolute or unsafe path"),
    "dotdot": ([member("run/../../detllm-evil.json")], "leaves the pack"),
    "backslash": ([member("run\\..\\evil.json")], "absolute or unsafe path"),
    "symlink": ([member("run/link.json", tarfile.SYMTYPE, linkname="/etc/passwd")], "is a symlink"),
    "hardlink": ([member("run/a.json"), member("run/b.json", tarfile.LNKTYPE, linkname="run/a.json")], "is a hard link"),
    "fifo": ([member("run/fifo.json", tarfile.FIFOTYPE)], "is a fifo"),
    "device": ([member("run/dev.json", tarfile.CHRTYPE)], "is a device"),
    "duplicate": ([member("run/a.json"), member("run/A.json")], "appears twice"),
    "pickle": ([member("run/model.pkl", data=b"cos\nsystem\n(S'true'\ntR.")], "not a detllm artifact"),
    "python": ([member("run/sitecustomize.py", data=b"print('pwned')")], "not a detllm artifact"),
}


@pytest.mark.parametrize("case", sorted(UNSAFE))
def test_unsafe_members_are_refused(cli, tmp_path, case):
    members, needle = UNSAFE[case]
    archive = make_tar(tmp_path / f"{case}.tar.gz", members)
    r = cli("verify", archive)
    assert r.exit_code == 6, r.output
    assert needle in r.stderr
    assert not Path("/tmp/detllm-evil.json").exists() and not (tmp_path.parent / "detllm-evil.json").exists()


def test_limits_on_members_sizes_and_totals(tmp_path):
    many = make_tar(tmp_path / "many.tar.gz", [member(f"run/{i}.json") for i in range(6)])
    with pytest.raises(IntegrityError, match="more than 5 members"):
        extract(many, tmp_path / "a", Limits(max_members=5))
    big = make_tar(tmp_path / "big.tar.gz", [member("run/big.json", data=b"x" * 100)])
    with pytest.raises(IntegrityError, match="over the 50-byte limit"):
        extract(big, tmp_path / "b", Limits(max_member_bytes=50))
    total = make_tar(tmp_path / "total.tar.gz", [member(f"run/{i}.json", data=b"x" * 40) for i in range(3)])
    with pytest.raises(IntegrityError, match="add up to more than 100 bytes"):
        extract(total, tmp_path / "c", Limits(max_total_bytes=100))
    deep = make_tar(tmp_path / "deep.tar.gz", [member("/".join(["d"] * 10) + "/x.json")])
    with pytest.raises(IntegrityError, match="nested deeper"):
        extract(deep, tmp_path / "d", Limits())


class _Boom:
    """Unpickling this writes a marker file: proof that something loaded the pickle."""

    marker: Path

    def __reduce__(self):
        return (Path.write_text, (self.marker, "unpickled"))


def test_a_pickle_in_a_pack_or_folder_is_never_loaded(cli, sealed_run, tmp_path):
    import shutil

    boom = _Boom()
    boom.marker = tmp_path / "UNPICKLED"
    payload = pickle.dumps(boom)
    # in a folder: not in the manifest, so verify names it; load_run, report and replay never open it
    run = tmp_path / "run"
    shutil.copytree(sealed_run, run)
    (run / "model.pkl").write_bytes(payload)
    (run / "hook.py").write_text(f"open({str(boom.marker)!r}, 'w').write('imported')\n")
    r = cli("verify", run)
    assert r.exit_code == 6 and "hook.py: is not in the manifest" in r.stderr
    assert cli("report", run).exit_code == 0
    assert len(artifacts.load_run(run).records) == 12
    # in an archive: refused at extraction, before any file is written
    with tarfile.open(sealed_run.parent / "x.tar.gz", "w:gz") as tar:
        for p in sorted(run.rglob("*")):
            tar.add(p, arcname=f"run/{p.relative_to(run)}", recursive=False)
    for cmd in (["verify"], ["report"], ["replay", "--out", str(tmp_path / "replayed")]):
        r = cli(*cmd[:1], sealed_run.parent / "x.tar.gz", *cmd[1:])
        assert r.exit_code == 6 and "not a detllm artifact" in r.stderr, r.output
    assert not boom.marker.exists()
    assert not (tmp_path / "replayed").exists()


# ---------------------------------------------------------------- bounded reading (issue 11)


def test_a_huge_pax_header_is_refused_before_tarfile_reads_it(cli, tmp_path):
    archive = tmp_path / "pax.tar.gz"
    with tarfile.open(archive, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        info, data = member("run/a.json")
        info.size = len(data)
        info.pax_headers = {"comment": "x" * (64 << 20)}  # 64 MiB of header that compresses to ~64 KiB
        tar.addfile(info, io.BytesIO(data))
    assert archive.stat().st_size < 1 << 20
    r = cli("verify", archive)
    assert r.exit_code == 6, r.output
    assert "a PAX extended header of" in r.stderr and "over the 4096-byte limit" in r.stderr


def test_a_huge_gnu_long_name_is_refused(cli, tmp_path):
    archive = tmp_path / "gnu.tar.gz"
    with tarfile.open(archive, "w:gz", format=tarfile.GNU_FORMAT) as tar:
        info, data = member("run/" + "n" * 100_000 + ".json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    r = cli("verify", archive)
    assert r.exit_code == 6 and "a GNU long name of" in r.stderr, r.output


def test_a_gzip_bomb_is_cut_off_at_the_decompressed_cap(tmp_path):
    import gzip

    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo("run/a.json")
        info.size = 50 << 20
        tar.addfile(info, io.BytesIO(b"\0" * info.size))
    bomb = tmp_path / "bomb.tar.gz"
    bomb.write_bytes(gzip.compress(raw.getvalue(), 9))
    assert bomb.stat().st_size < 1 << 20  # 50 MiB of zeros compress ~1000:1
    with pytest.raises(IntegrityError, match="over the 1048576-byte limit"):
        extract(bomb, tmp_path / "x", Limits(max_member_bytes=1 << 20))
    # a member declaring less than it holds: the stream past the declared end is never decompressed in full
    with pytest.raises(IntegrityError, match="decompresses to more than|add up to more than"):
        extract(bomb, tmp_path / "y", Limits(max_member_bytes=64 << 20, max_total_bytes=10 << 20))
    assert not (tmp_path / "y" / "run" / "a.json").exists()


def test_the_default_limits_are_the_documented_ones():
    docs = (Path(__file__).parent.parent / "docs" / "integrity.md").read_text()
    limits = Limits()
    assert f"more than {limits.max_members:,} members is refused" in docs
    assert f"a member over {limits.max_member_bytes >> 30} GiB, members adding up to over {limits.max_total_bytes >> 30} GiB" in docs
    assert f"GNU long name/link over {limits.max_header_bytes >> 10} KiB is refused" in docs


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the peak RSS from /proc")
def test_verify_of_a_pax_bomb_stays_in_bounded_memory(tmp_path):
    """A ~256 KB pack whose PAX header holds 256 MiB: tarfile would read it whole; verify must not."""
    import subprocess
    import sys

    archive = tmp_path / "paxbomb.tar.gz"
    with tarfile.open(archive, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        info, data = member("run/a.json")
        info.size = len(data)
        info.pax_headers = {"comment": "x" * (256 << 20)}
        tar.addfile(info, io.BytesIO(data))
    assert archive.stat().st_size < 2 << 20
    # VmHWM (peak RSS of this program's memory; ru_maxrss would carry the forking parent's peak over exec)
    probe = ("import sys\nfrom detllm.core.errors import IntegrityError\nfrom detllm.commands.verify import verify\n"
             "try:\n    verify(sys.argv[1])\nexcept IntegrityError as exc:\n    print(exc.message)\n"
             "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))\n")
    out = subprocess.run([sys.executable, "-c", probe, str(archive)], capture_output=True, text=True, timeout=120)
    message, peak_kib = out.stdout.strip().splitlines()
    assert "PAX extended header" in message, out.stderr
    assert int(peak_kib) < 200 * 1024, f"verify peaked at {int(peak_kib) // 1024} MiB"


# ---------------------------------------------------------------- the fast reading path (issue 12)


def test_a_corrupt_deflate_stream_is_an_artifact_error(cli, pack, tmp_path, monkeypatch):
    """Flipped bits inside the compressed data: igzip's own error class is caught like zlib's, and
    each damaged pack gets the answer it gets through the stdlib's gzip (exit code, first words)."""
    import sys

    data = pack.read_bytes()
    damaged = []
    for at in range(20, len(data) - 16, max(1, (len(data) - 36) // 16)):
        bad = bytearray(data)
        bad[at] ^= 0x55
        damaged.append(tmp_path / f"bad{at}.tar.gz")
        damaged[-1].write_bytes(bytes(bad))

    def answers() -> list[tuple[int, str]]:
        out = []
        for p in damaged:
            r = cli("verify", p)
            assert r.exit_code in (0, 5, 6) and "Traceback" not in r.output, r.output
            out.append((r.exit_code, r.stderr.split("(")[0]))
        return out

    with_isal = answers()
    monkeypatch.setitem(sys.modules, "isal", None)  # import isal -> ImportError: the stdlib's gzip
    with_gzip = answers()
    # the same packs refused; the words may differ: igzip can meet the bad checksum before the stdlib's
    # streaming reader meets a garbled tar header (a member "over the size limit", exit 6) or the reverse
    assert [code != 0 for code, _ in with_isal] == [code != 0 for code, _ in with_gzip]
    assert any(code == 5 and "not a readable .tar.gz pack" in err for code, err in with_isal)


@pytest.mark.parametrize("without", ["isal", "copy_file_range"])
def test_packs_read_the_same_without_isal_or_copy_file_range(cli, pack, monkeypatch, without):
    """The fallbacks (stdlib gzip; reading members through tarfile) give the same answers."""
    import os
    import sys

    said = [cli("verify", pack)]
    if without == "isal":
        monkeypatch.setitem(sys.modules, "isal", None)  # import isal -> ImportError
    else:
        monkeypatch.delattr(os, "copy_file_range", raising=False)
    said.append(cli("verify", pack))
    assert [(r.exit_code, r.stdout) for r in said] == [(said[0].exit_code, said[0].stdout)] * 2 and said[0].exit_code == 0


def test_a_pack_whose_member_data_is_cut_short_is_refused(cli, pack, tmp_path):
    import gzip

    raw = gzip.decompress(pack.read_bytes())
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(gzip.compress(raw[: len(raw) // 2]))  # ends inside a member, no end-of-archive blocks
    r = cli("verify", cut)
    assert r.exit_code == 5 and "not a readable .tar.gz pack" in r.stderr, r.output
