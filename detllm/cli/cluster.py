"""The shell of `check --ray ADDRESS --per node|accelerator_type|resource:NAME` (docs/ray.md): refuses
what does not apply, calls detllm.cluster.driver.ray_check and prints the fleet's outputs; ray is
imported only below, once --ray is given.
"""

from __future__ import annotations

from ..core.errors import UsageError
from ..runfolder.artifacts import check_output_file


def ray_check(command, cfg, address, per, hold, base_url, prompts, prompt, prompt_file, out, as_json, junit, html,
              redact, redact_vars, ship_model=False) -> int:
    """`check --ray ADDR`: detllm.cluster.driver.ray_check, then the fleet's outputs (cli/fleet.py)."""
    from ..cluster.driver import ray_check as run_ray
    from ..core.prompts import resolve_prompts
    from .fleet import emit_fleet

    if command != "check":
        raise UsageError(f"--ray runs a check on each node: use `detllm check`, not `detllm {command}`")
    if base_url:
        raise UsageError("--ray runs the engine on the cluster's nodes; --base-url names endpoints", hint="give one of them")
    check_output_file(junit, "--junit")
    check_output_file(html, "--html")
    prompt_set = resolve_prompts(prompts, texts=prompt or (), jsonl_file=prompt_file)
    outcome = run_ray(cfg, address, per=per, prompt_set=prompt_set, out=out, redact=redact, redact_env_vars=redact_vars,
                      hold=_hold(hold), ship_model=ship_model)
    return emit_fleet(outcome, as_json=as_json, junit=junit, html=html)


def _hold(hold: str | None) -> tuple[str, str] | None:
    """--ray-test-hold NODE_ID_PREFIX:DIR (hidden, for tests: cluster/task.py _hold)."""
    if hold is None:
        return None
    node, sep, folder = hold.partition(":")
    if not sep or not node or not folder:
        raise UsageError(f"--ray-test-hold expects NODE_ID_PREFIX:DIR, got {hold!r}")
    return node, folder
