"""check --cache-probe against a real HTTP server on loopback whose warm answer differs from its
cold one (a prefix cache that computes differently): the FAIL it writes is the verdict verify
re-derives (one function, checkverdict.check_verdict), with the run's noise floor, so the
honest folder verifies and packs (review R2)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import assert_valid_run
from tests.test_openai_stub import Stub


class WarmDiffers(Stub):
    """The second and later answers to a prompt move the last logprob by 1e-3 and report the prompt
    tokens served from cache, as a server whose cached prefix computes differently would."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}
        super().__init__()

    def answer(self, body: dict) -> dict:
        doc = super().answer(body)
        key = str(body["prompt"])
        self.seen[key] = self.seen.get(key, 0) + 1
        if self.seen[key] > 1 and doc["choices"][0]["logprobs"] is not None:
            lps = doc["choices"][0]["logprobs"]["token_logprobs"]
            lps[-1] += 1e-3
            doc["usage"]["prompt_tokens_details"] = {"cached_tokens": 3}
        return doc


@pytest.fixture
def warm_differs():
    s = WarmDiffers()
    yield s
    s.close()


def test_an_honest_cache_probe_fail_verifies_and_packs(cli, warm_differs, tmp_path):
    out = tmp_path / "probe"
    r = cli("check", "--backend", "openai", "--base-url", warm_differs.url, "--model", "stub-model", "--cache-probe",
            "--tier", "2", "--prompt", "hello there", "--prompt", "general kenobi", "--max-new-tokens", "4",
            "--out", out, "--no-progress")
    assert r.exit_code == 1, r.output
    report = assert_valid_run(out, failed=True)
    assert report["category"] == "CACHE_VARIANCE"
    first = report["first_divergence"]
    assert first["kind"] == "logprob" and report["comparisons"][0]["name"] == "warm vs cold"
    assert first["noise_floor"] is not None, "the probe labels its divergence against the run's noise floor"
    v = cli("verify", out)
    assert v.exit_code == 0, v.output
    assert "verdict re-derived from the trace: FAIL (CACHE_VARIANCE)" in v.stdout
    p = cli("pack", out, "-o", tmp_path / "probe.tar.gz")
    assert p.exit_code == 0, p.output
    assert cli("verify", tmp_path / "probe.tar.gz").exit_code == 0


def test_a_probe_folder_edited_to_run_variance_is_refused(cli, warm_differs, tmp_path):
    """verify re-derives a probe folder by the probe's own report maker: the plain check's category is not accepted."""
    out = tmp_path / "probe"
    cli("check", "--backend", "openai", "--base-url", warm_differs.url, "--model", "stub-model", "--cache-probe",
        "--tier", "2", "--prompt", "hello there", "--max-new-tokens", "4", "--out", out, "--no-progress")
    from detllm.runfolder.integrity import seal

    rep = json.loads((out / "report.json").read_text())
    rep["category"] = "RUN_VARIANCE"
    (out / "report.json").write_text(json.dumps(rep, indent=2) + "\n")
    seal(out)
    v = cli("verify", out)
    assert v.exit_code == 6 and "report.json: category is 'RUN_VARIANCE', but the sealed trace gives 'CACHE_VARIANCE'" in v.stderr, v.output
