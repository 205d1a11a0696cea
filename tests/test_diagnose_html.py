"""diagnosis.html in a real browser: `diagnose` writes it beside diagnosis.txt/.md, in the report
page's style and under its Content-Security-Policy; headless Chromium renders the conclusion, the
ranked knobs and the passing setting, strings from the folder are escaped, and an injected
script does not run."""

from __future__ import annotations

import html

import pytest

from detllm.api import make_config
from detllm.diagnose import diagnose
from detllm.render.html import CSP
from tests.test_html import HOSTILE, chromium, needs_chromium


@pytest.fixture(scope="module")
def diagnosed(tmp_path_factory):
    """A real diagnosis (fake engine, real worker processes): a batch-8 divergence that vanishes at
    threads=1, confirmed in 2 fresh processes; the model name is hostile markup."""
    out = tmp_path_factory.mktemp("diag-html") / "d"
    cfg = make_config(backend="fake", model=HOSTILE, max_new_tokens=6, tier=2, runs=2, vary_batch=(1, 8),
                      options={"diverge": "prompt=0,pos=3,batch=8", "stable_threads": "1"})
    return diagnose(cfg, out=out, budget=10, fresh_repeats=2)


def test_html_is_written_beside_the_text_and_is_self_contained(diagnosed):
    out = diagnosed.out_dir
    assert {p.name for p in out.iterdir()} >= {"diagnosis.json", "diagnosis.txt", "diagnosis.md", "diagnosis.html"}
    page = (out / "diagnosis.html").read_text()
    assert f'<meta http-equiv=\'Content-Security-Policy\' content="{CSP}">' in page
    lowered = page.lower()
    assert "<script" not in lowered and "http://" not in page and "https://" not in page
    assert html.escape(HOSTILE, quote=True) in page and HOSTILE not in page


@needs_chromium
def test_chromium_renders_the_diagnosis(diagnosed, tmp_path):
    doc = diagnosed.doc
    dom = chromium(diagnosed.out_dir / "diagnosis.html", "--dump-dom")
    assert f"<title>detllm diagnosis: fake / {html.escape(HOSTILE, quote=False)}</title>" in dom
    assert '<span class="verdict FAIL">diverges (batch)</span>' in dom
    assert html.escape(doc["conclusion"], quote=False) in dom and "threads=1: PASS at tier 2 in 2/2 fresh-process checks" in dom
    rows = {k["knob"]: k for k in doc["knobs"]}
    assert rows["batch composition"]["verdict"] == "follows" and rows["threads"]["verdict"] == "vanishes"
    for k in doc["knobs"]:
        cell = {"follows": "cell-FAIL", "vanishes": "cell-PASS", "moves": "cell-INFO", "not_followed": "cell-base"}[k["verdict"]]
        assert (f"<tr><td>{k['rank']}</td><td><code>{html.escape(k['knob'], quote=False)}</code></td>"
                f'<td class="{cell}">{k["verdict"]}</td>') in dom
    for p in doc["probes"]:
        assert html.escape(p["name"], quote=False) in dom
    assert "<script" not in dom and "onerror" not in dom.replace("onerror=alert(2)&gt;", "")


@needs_chromium
def test_csp_blocks_an_injected_script_in_the_diagnosis_page(diagnosed, tmp_path):
    page = (diagnosed.out_dir / "diagnosis.html").read_text().replace("</main>", "<script>document.title='pwned'</script></main>")
    evil = tmp_path / "evil.html"
    evil.write_text(page)
    assert "pwned</title>" not in chromium(evil, "--dump-dom")
    control = tmp_path / "control.html"  # without the policy the script runs: the test can fail
    control.write_text(page.replace("http-equiv='Content-Security-Policy'", "name='x'"))
    assert "<title>pwned</title>" in chromium(control, "--dump-dom")
