"""The composite action (action.yml, docs/ci.md) run here: its shell steps are executed as GitHub
runs them (`bash --noprofile --norc -eo pipefail`, with CI, GITHUB_OUTPUT and GITHUB_STEP_SUMMARY
set), with the inputs substituted. The install step makes a fresh venv and pip-installs detllm
from this repository with a light extra (openai: no torch); the gate runs the fake backend there,
and the action's default arguments run the real hf tiny model with the dev venv's detllm."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
ACTION = yaml.safe_load((ROOT / "action.yml").read_text())
STEPS = ACTION["runs"]["steps"]
EXPR = re.compile(r"\$\{\{\s*(.*?)\s*\}\}")


def defaults(**given: str) -> dict[str, str]:
    unknown = set(given) - set(ACTION["inputs"])
    assert not unknown, f"not inputs of action.yml: {unknown}"
    return {**{k: str(v.get("default", "")) for k, v in ACTION["inputs"].items()}, **given}


class Runner:
    """What GitHub gives a composite action's steps, for the expressions these steps use: inputs,
    github.action_path, runner.temp and earlier steps' outputs. Any other expression fails the test."""

    def __init__(self, tmp: Path, inputs: dict[str, str]) -> None:
        self.tmp, self.inputs, self.outputs = tmp, inputs, {}
        self.workspace = tmp / "workspace"
        self.workspace.mkdir(exist_ok=True)
        self.summary = tmp / "step_summary.md"
        (tmp / "runner-temp").mkdir(exist_ok=True)

    def value(self, expr: str) -> str:
        if expr.startswith("inputs."):
            return self.inputs[expr.removeprefix("inputs.")]
        if expr == "github.action_path":
            return str(ROOT)
        if expr == "runner.temp":
            return str(self.tmp / "runner-temp")
        m = re.fullmatch(r"steps\.([\w-]+)\.outputs\.([\w-]+)", expr)
        assert m, f"action.yml uses an expression this test does not provide: {expr}"
        return self.outputs.get(m[1], {}).get(m[2], "")

    def expand(self, text: str) -> str:
        return EXPR.sub(lambda m: self.value(m[1]), text)

    def run(self, step_id: str) -> subprocess.CompletedProcess:
        step = next(s for s in STEPS if s.get("id") == step_id)
        assert step["shell"] == "bash"
        out = self.tmp / f"output-{step_id}"
        out.write_text("")
        script = self.tmp / f"{step_id}.sh"
        script.write_text(self.expand(step["run"]))
        env = {k: v for k, v in os.environ.items() if not k.startswith("GITHUB_")}  # this job's own, if it runs in Actions
        env.update({k: self.expand(str(v)) for k, v in step.get("env", {}).items()})
        env.update(CI="true", GITHUB_ACTIONS="true", GITHUB_OUTPUT=str(out), GITHUB_STEP_SUMMARY=str(self.summary),
                   GITHUB_WORKSPACE=str(self.workspace), RUNNER_TEMP=str(self.tmp / "runner-temp"))
        p = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", str(script)], cwd=self.workspace, env=env,
                           capture_output=True, text=True, timeout=600)
        self.outputs[step_id] = dict(line.split("=", 1) for line in out.read_text().splitlines() if "=" in line)
        return p


def test_the_action_keeps_the_run_folder_and_caches_the_model_caches():
    cache = next(s for s in STEPS if s.get("uses", "").startswith("actions/cache@"))
    assert cache["with"]["path"].split() == ["~/.cache/detllm", "~/.cache/huggingface"]
    assert cache["with"]["key"] == "${{ steps.key.outputs.key }}"
    upload = next(s for s in STEPS if s.get("uses", "").startswith("actions/upload-artifact@"))
    assert upload["if"] == "always()", "a FAIL's run folder is the one to keep"
    assert upload["with"]["path"] == "${{ inputs.out }}"
    assert "--mode strict" in ACTION["inputs"]["args"]["default"], "a requested tier is really checked"


def test_the_action_installs_from_the_repository_into_a_fresh_venv_and_gates(tmp_path):
    """pip install '<repo>[openai]' into a new venv (no torch, nothing from the dev venv); --version;
    then three gates: a PASS whose tier was downgraded (warning), the same in strict mode (exit 3), a FAIL."""
    act = Runner(tmp_path, defaults(extras="openai", python=sys.executable,
                                    args="--backend fake --tier 3 --vary-batch 1,2 --max-new-tokens 4 --prompt 'Hello there' --prompt Hi"))
    key = act.run("key")
    assert key.returncode == 0, key.stderr
    assert re.fullmatch(r"detllm-Linux-[\w]+-[0-9a-f]{16}-v1", act.outputs["key"]["key"])
    inst = act.run("install")
    assert inst.returncode == 0, inst.stderr[-3000:]
    detllm_bin = Path(act.outputs["install"]["detllm"])
    venv = tmp_path / "runner-temp" / "detllm-venv"
    assert detllm_bin == venv / "bin" / "detllm" and inst.stdout.startswith("detllm 0.2.0 ")
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import detllm, importlib.util as u; print(detllm.__file__, u.find_spec('torch'))"],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path)
    where, torch = probe.stdout.split()
    assert Path(where).is_relative_to(venv) and torch == "None", "installed into the fresh venv, without torch"

    gate = act.run("gate")  # best effort: tier 3 asked, the fake enforces 2
    warning = "detllm: warning: tier 3 requested, tier 2 checked (best-effort mode downgraded it; pass --mode strict to fail instead)"
    assert gate.returncode == 0 and act.outputs["gate"]["exit-code"] == "0", gate.stderr
    assert gate.stdout.startswith("detllm check: PASS") and gate.stderr == warning + "\n"
    run = act.workspace / act.outputs["gate"]["run-folder"]
    assert json.loads((run / "report.json").read_text())["summary"]["prompts"] == 2, "quoted args arrive as one argument each"
    assert act.summary.read_text().startswith("> **Warning:** tier 3 requested")
    props = {p.get("name") for p in ET.parse(act.workspace / "detllm-out" / "junit.xml").getroot().iter("property")}
    assert "detllm.warning" in props
    assert subprocess.run([str(detllm_bin), "verify", str(run)], capture_output=True, timeout=120).returncode == 0

    act.inputs["args"] += " --mode strict"
    gate = act.run("gate")
    assert (gate.returncode, act.outputs["gate"]["exit-code"]) == (3, "3")
    assert gate.stderr.startswith("detllm: error: tier 3 refused in strict mode")

    act.inputs.update(args="--backend fake --opt diverge=prompt=0,pos=1,run=1 --max-new-tokens 4", out="fail-out")
    gate = act.run("gate")
    assert (gate.returncode, act.outputs["gate"]["exit-code"]) == (1, "1")
    assert "next: detllm diagnose fail-out/run " in gate.stdout
    root = ET.parse(act.workspace / "fail-out" / "junit.xml").getroot()
    assert root.get("failures") == "1" and "# detllm check: FAIL: RUN_VARIANCE" in act.summary.read_text()


@pytest.mark.engine
def test_the_action_default_arguments_pass_on_the_real_hf_tiny_model(tmp_path):
    """The defaults a user starts from (hf tiny, tier 2, --mode strict, batch 1 and 2) are a real
    gate that passes here: tier 2 is enforced by hf, so strict mode does not refuse it."""
    act = Runner(tmp_path, defaults())
    act.outputs["install"] = {"detllm": str(Path(sys.executable).parent / "detllm")}  # the dev venv's hf install
    gate = act.run("gate")
    assert gate.returncode == 0, gate.stdout + gate.stderr
    assert gate.stdout.startswith("detllm check: PASS\ntier 2  backend hf  model tiny") and gate.stderr == ""
    report = json.loads((act.workspace / "detllm-out" / "run" / "report.json").read_text())
    assert report["tier"] == {"requested": 2, "effective": 2} and report["summary"]["batch_sizes"] == [1, 2]


def test_docs_ci_job_and_inputs_agree_with_the_action():
    doc = (ROOT / "docs" / "ci.md").read_text()
    job = yaml.safe_load(doc.split("```yaml\n", 1)[1].split("```", 1)[0])
    step = next(s for s in job["jobs"]["determinism"]["steps"] if s.get("id") == "detllm")
    assert set(step["with"]) <= set(ACTION["inputs"])
    assert "--mode strict" in step["with"]["args"]
    listed = re.findall(r"`([\w-]+)`", doc.split("Inputs: ", 1)[1].split("\n\n", 1)[0])
    assert set(ACTION["inputs"]) <= set(listed), "docs/ci.md lists every input"
