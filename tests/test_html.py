"""report.html in a real browser: headless Chromium (Debian's `chromium`, installed by
scripts/install.sh --engines) renders the page, and the DOM it builds must hold the verdict,
the divergent token and the top cause. Text from packs is escaped, and the page's
Content-Security-Policy stops even an injected inline script.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

import detllm
from detllm.render.html import CSP, render_html

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (scripts/install.sh --engines installs it)")
HOSTILE = "<script>alert(1)</script>\"'><img src=x onerror=alert(2)>"


def chromium(page: Path, *args: str) -> str:
    """Run headless Chromium on a local file with no network at all; returns stdout."""
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
           "--host-resolver-rules=MAP * ~NOTFOUND", "--user-data-dir=" + str(page.parent / ".chromium"), *args, page.as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.fixture(scope="module")
def fake_fail(tmp_path_factory):
    """A check that fails at prompt 0, token 3 (the fake backend's injected divergence), with a hostile prompt."""
    tmp = tmp_path_factory.mktemp("html")
    o = detllm.check(backend="fake", prompts=[HOSTILE, "plain prompt"], runs=2, vary_batch=[1, 2], tier=2,
                     options={"diverge": "prompt=0,pos=3,run=1"}, out=tmp / "check")
    assert o.status == "FAIL"
    return o


def test_page_is_self_contained_and_escaped(cli, fake_fail, tmp_path):
    out = tmp_path / "r.html"
    r = cli("report", fake_fail.out_dir, "--format", "html", "--out", out)
    assert r.exit_code == 0, r.output
    page = out.read_text()
    assert f'<meta http-equiv=\'Content-Security-Policy\' content="{CSP}">' in page
    assert "script-src 'none'" in CSP and "connect-src 'none'" in CSP and "default-src 'none'" in CSP
    lowered = page.lower()
    assert "<script" not in lowered and "onerror=" not in lowered.replace("onerror=alert(2)&gt;", "")
    assert "http://" not in page and "https://" not in page and "src=" not in lowered.replace("src=x", "")
    assert html_escaped(HOSTILE) in page  # the prompt is shown, as text


def html_escaped(text: str) -> str:
    import html

    return html.escape(text, quote=True)


def test_check_html_flag_matches_report_format_html(cli, tmp_path):
    page = tmp_path / "c.html"
    r = cli("check", "-b", "fake", "--opt", "diverge=prompt=1,pos=2,run=1", "--out", tmp_path / "c", "--html", page)
    assert r.exit_code == 1, r.output
    again = cli("report", tmp_path / "c", "--format", "html")
    assert again.exit_code == 0 and again.output == page.read_text()
    assert "Comparison matrix" in again.output and "cell-FAIL" in again.output


def test_html_flag_refused_before_anything_runs(cli, tmp_path):
    r = cli("check", "-b", "fake", "--out", tmp_path / "c", "--html", tmp_path)
    assert r.exit_code == 2 and not (tmp_path / "c").exists()


@needs_chromium
def test_chromium_renders_the_fake_fail(fake_fail, tmp_path):
    d = fake_fail.report["first_divergence"]
    page = tmp_path / "fail.html"
    from detllm.commands.report import render_path

    page.write_text(render_path(fake_fail.out_dir, "html"))
    dom = chromium(page, "--dump-dom")
    assert "detllm check: FAIL" in dom.replace("<span class=\"verdict FAIL\">", "").replace("</span>", "")
    assert f'<span class="tok div" title="token {d["token_index"]} · id {d["left"]["token_id"]}' in dom
    assert fake_fail.report["causes"][0]["code"] in dom
    assert "<script" not in dom


@needs_chromium
def test_csp_blocks_an_injected_inline_script(fake_fail, tmp_path):
    """Were a renderer bug to let a script through, the page's own policy still stops it."""
    page = tmp_path / "evil.html"
    html = render_html(fake_fail.report).replace("</main>", "<script>document.title='pwned'</script></main>")
    page.write_text(html)
    dom = chromium(page, "--dump-dom")
    assert "<title>detllm check: FAIL</title>" in dom and "pwned</title>" not in dom
    unprotected = tmp_path / "control.html"  # the same page without the policy runs the script: the test can fail
    unprotected.write_text(html.replace("http-equiv='Content-Security-Policy'", "name='x'"))
    assert "<title>pwned</title>" in chromium(unprotected, "--dump-dom")


@needs_chromium
@pytest.mark.engine
def test_real_cross_engine_fail_renders(smollm2_sides, cli, tmp_path):
    """hf (fp32) vs llama.cpp (Q4_1) on SmolLM2-135M: the run folders test_cross_engine made."""
    hf, ll = smollm2_sides
    page = tmp_path / "report.html"
    r = cli("diff", hf, ll, "--tier", "1", "--out", tmp_path / "d", "--html", page)
    assert r.exit_code == 1, r.output
    rep = json.loads((tmp_path / "d" / "report.json").read_text())
    d = rep["first_divergence"]
    assert d["kind"] == "token" and rep["causes"][0]["code"] == "BACKEND_MISMATCH"
    dom = chromium(page, "--dump-dom")
    import html as _html

    for side in ("left", "right"):
        shown = _html.escape(d[side]["token_text"].replace(" ", "\u00b7"), quote=False)
        assert f'title="token {d["token_index"]} · id {d[side]["token_id"]}' in dom and shown in dom
    assert "BACKEND_MISMATCH" in dom and "llamacpp" in dom and "Q4_1" in dom
    png = tmp_path / "report.png"
    chromium(page, "--hide-scrollbars", "--window-size=1200,1500", f"--screenshot={png}")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
