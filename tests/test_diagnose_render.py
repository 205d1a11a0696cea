"""diagnose's renderings never call a FAIL they were asked about "no divergence" when it did
not reproduce here: they say the FAIL did not reproduce (txt, md and html alike)."""

from __future__ import annotations

from detllm.diagnose.render import baseline_words, render_html, render_markdown, render_text


def _doc(diverged: bool, status: str | None) -> dict:
    return {"backend": "hf", "model": "tiny", "tier_requested": 2, "conclusion": "Could not reproduce the diff's FAIL here.",
            "baseline": {"diverged": diverged, "kinds": ["diff"] if diverged else [], "diverged_batch_sizes": [], "first": None,
                         "max_abs_logprob_diff": None, "argmax_flips": 0, "prompts_diverged": 0},
            "source": {"kind": "diff", "path": "d", "status": status, "recorded_causes": ["ENV_MISMATCH"]},
            "knobs": [], "passing_settings": None, "probes": [], "skipped_knobs": [], "not_run": [],
            "prefill_vs_decode": None, "budget": {"probes": 12, "seconds": None, "probes_used": 1, "seconds_used": 1.0,
                                                  "exhausted": False}}


def test_a_fail_that_did_not_reproduce_is_said_so_in_every_rendering():
    doc = _doc(False, "FAIL")
    assert baseline_words(doc) == "the FAIL did not reproduce here"
    assert render_text(doc).splitlines()[0].endswith(": the FAIL did not reproduce here")
    assert "**The FAIL did not reproduce here.**" in render_markdown(doc)
    page = render_html(doc)
    assert "the FAIL did not reproduce here" in page and "no divergence" not in page.lower()
    assert "no divergence" not in render_text(doc).lower()


def test_a_passing_source_and_a_reproduced_fail_keep_their_words():
    assert baseline_words(_doc(False, "PASS")) == "no divergence"
    assert baseline_words(_doc(True, "FAIL")) == "diverges (diff)"
