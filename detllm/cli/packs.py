"""`detllm verify`, `detllm replay` and `detllm pack`: the commands on a sealed run folder or
.tar.gz pack (docs/integrity.md). verify checks it offline, replay re-runs its recorded config
and diffs against it, pack writes its sealed files to a reproducible archive.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from .shell import ProgressBar, SignKey, app, emit, guarded


@app.command(help="Check a run folder or .tar.gz pack offline: every file against manifest.json, the trace's hash chain, "
                  "every schema and, with --pubkey, the Ed25519 signature. No engine is imported. "
                  "Exit 0 verified, 5 not a pack or schema error, 6 integrity error (names the first changed file or trace line).")
def verify(
    pack: Annotated[Path, typer.Argument(help="A sealed run folder or .tar.gz pack.")],
    pubkey: Annotated[Optional[Path], typer.Option("--pubkey", help="Ed25519 public key (PEM or ssh-ed25519): manifest.sig must verify.")] = None,
    weights: Annotated[Optional[Path], typer.Option("--weights", help="Training packs: a safetensors file that must be the weights the "
                                                    "final commitment names (read without torch).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    def body() -> int:
        from ..runfolder.seedlayout import refuse_seed_layout
        from ..commands.verify import verify as verify_pack

        refuse_seed_layout(pack)
        if weights is not None and not weights.is_file():
            from ..core.errors import UsageError

            raise UsageError(f"--weights {str(weights)!r} is not a file")
        res = verify_pack(pack, pubkey=pubkey, weights=weights)
        typer.echo(json.dumps(res.to_json(), indent=2) if as_json else "\n".join(res.lines()))
        return 0

    guarded(body)


@app.command(help="Re-run a pack's recorded config and prompts on this machine, then diff against the pack. "
                  "Refuses (exit 7) when the local weights differ from the pack's.")
def replay(
    pack: Annotated[Path, typer.Argument(help="A sealed run folder or .tar.gz pack (recorded with prompt text).")],
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Folder for the replay (default: a new folder under artifacts/).")] = None,
    force: Annotated[bool, typer.Option(help="Write into an existing non-detllm folder.")] = False,
    allow_model_change: Annotated[bool, typer.Option("--allow-model-change", help="Replay even when the local weights differ from the pack's.")] = False,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Load the model from here instead of the recorded name or path (weights are still checked).")] = None,
    sign_key: SignKey = None,
    pubkey: Annotated[Optional[Path], typer.Option("--pubkey", help="Replay only a pack whose manifest.sig verifies with this Ed25519 public key.")] = None,
    base_url: Annotated[Optional[str], typer.Option("--base-url", help="openai packs: the server to replay against (never taken from the pack).")] = None,
    api_key_env: Annotated[Optional[str], typer.Option("--api-key-env", metavar="NAME", help="openai packs: the variable holding the key (never taken from the pack).")] = None,
    allow_pack_option: Annotated[Optional[list[str]], typer.Option("--allow-pack-option", metavar="NAME", help="Take this code-loading option from the pack (trust_remote_code, attn_implementation, bin; script: a training pack's copy of its --script); refused or dropped otherwise.")] = None,
    sample: Annotated[Optional[str], typer.Option("--sample", metavar="k/N", help="Training packs: re-run k of N segments from their checkpoints (default: the whole run from genesis).")] = None,
    sample_seed: Annotated[Optional[int], typer.Option("--sample-seed", help="Training packs: choose the --sample segments from this seed (default: the system's random source).")] = None,
    checkpoints: Annotated[Optional[Path], typer.Option("--checkpoints", help="Training packs: the checkpoints folder (default: packed inside, else beside the pack).")] = None,
    script: Annotated[Optional[str], typer.Option("--script", metavar="PATH[:FUNCTION]", help="Training packs made with --script: the script to run (its sha256 must be the recorded one).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print report.json instead of the verdict.")] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Progress bar on stderr.")] = True,
) -> None:
    def body() -> int:
        from ..commands.replay import replay as replay_pack
        from ..runfolder.seedlayout import refuse_seed_layout
        from ..training.pack import TrainingOutcome
        from .training import emit_training

        refuse_seed_layout(pack)
        with ProgressBar(progress and not as_json) as bar:
            outcome = replay_pack(pack, out=out, force=force, allow_model_change=allow_model_change, model=model,
                                  sign_key=sign_key, pubkey=pubkey, progress=bar, base_url=base_url, api_key_env=api_key_env,
                                  allow_pack_options=tuple(allow_pack_option or ()), sample=sample, sample_seed=sample_seed,
                                  checkpoints=checkpoints, script=script)
        if isinstance(outcome, TrainingOutcome):  # a training pack (docs/training.md)
            return emit_training(outcome, as_json)
        return emit(outcome, as_json=as_json)

    guarded(body)


@app.command("pack", help="Verify a sealed run folder and write exactly its sealed files to a reproducible .tar.gz.")
def pack_cmd(
    run_dir: Annotated[Path, typer.Argument(help="A sealed detllm run folder.")],
    dest: Annotated[Path, typer.Option("--output", "-o", help="The pack to write (.tar.gz).")],
    force: Annotated[bool, typer.Option(help="Overwrite an existing pack file.")] = False,
    with_checkpoints: Annotated[bool, typer.Option("--with-checkpoints", help="Training packs: also pack the checkpoints (under checkpoints/, each checked by digest); left out otherwise.")] = False,
    checkpoints: Annotated[Optional[Path], typer.Option("--checkpoints", help="Training packs: where the checkpoints are (default: beside the pack, where train-check wrote them).")] = None,
) -> None:
    def body() -> int:
        from ..commands.pack import create_pack, fleet_failures

        path = create_pack(run_dir, dest, force=force, with_checkpoints=with_checkpoints, checkpoints=checkpoints)
        typer.echo(f"packed {run_dir} into {path} ({path.stat().st_size} bytes)")
        for name, error in fleet_failures(run_dir).items():
            typer.echo(f"{name}: failed ({error}); packed as it was left, marked incomplete by its detllm.partial")
        return 0

    guarded(body)
