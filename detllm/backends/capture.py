"""What a backend hands back when asked to capture its internals (`detllm locate`, the training
item's hooks): the request (`CaptureSpec`), one captured module or op (`CapturedTensor`) and the
whole capture (`Capture`). Plain records only: how a backend hooks its engine lives in that
backend (and the torch hook machinery in `detllm.taps`); comparing two captures is `locate`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# what a backend can capture, least to most: its Capabilities.capture names the most it offers
CAPTURE_LEVELS = ("none", "layers", "modules", "ops")

# the kinds of computation a captured tensor comes from (locate.json's `kind`)
CAPTURE_KINDS = ("embedding", "norm", "gemm", "attention", "rotary", "softmax", "activation", "all_reduce",
                 "residual", "layer", "logits", "other")


@dataclass(frozen=True)
class Graft:
    """locate's graft: at the captured step, overwrite this module's or op's output for the row under
    test with `value` (the other side's captured output there, numpy, the row's real positions)."""

    name: str  # as CapturedTensor.name: "model.layers.0.self_attn.q_proj" or ".../torch.linear#0"
    value: Any


@dataclass(frozen=True)
class CaptureSpec:
    """What to capture while a recorded batch is re-run."""

    step: int  # the generated-token position to capture at: 0 is the prefill that yields token 0
    row: int  # the batch row of the prompt under test (its index in the requests passed)
    level: str = "modules"  # one of CAPTURE_LEVELS[1:]; a backend may capture less and says so in Capture.notes
    max_bytes: int = 512 * 2**20  # bound on the captured tensors kept; past it, layer boundaries only (noted)
    reference: bool = True  # also evaluate each captured module in float64 on its own captured inputs
    backward: bool = False  # also capture gradients (backward hooks), where the backend trains (hf)
    in_pass_kv: bool = False  # a prefill's attention also keeps the K/V it wrote (compared with a decode's cached K/V)
    graft: Graft | None = None  # overwrite one output at `step` (locate's causal test); a backend without it refuses
    run_to: int | None = None  # generate on through this step (> step) after the capture (a graft judged where the traces differ)
    time_bare: bool = False  # also time the captured step's forward without capture (Capture.seconds["bare"])
    ops_through: str | None = None  # level ops: ops captured until this module completes (a modules capture named it), modules after
    guide: bool = False  # level modules: inside each decoder layer its attentions only (locate's guide before an ops capture)
    warm_up: tuple = ()  # batches (tuples of Request) run first, after a cold start, to rebuild a cache the batch found warm (vLLM's prefix cache)


UNCAPTURED_PREFIX = "cached_prefix_not_captured"  # CapturedTensor.input_names of an attention that read a prefix cache no capture holds


@dataclass
class CapturedTensor:
    """One module's (or op's) output at the captured step, for the prompt's row only."""

    name: str  # Hugging Face module path, e.g. "model.layers.1.mlp.down_proj"; an op adds "/<op>#k" (hf: "/torch.linear#0", torch functions)
    kind: str  # one of CAPTURE_KINDS
    order: int  # execution order within the captured step (0 first)
    output: Any  # numpy array: the row's output, as the engine computed it (its dtype kept)
    inputs: list[Any] = field(default_factory=list)  # numpy arrays: the row's inputs (attention: incl. cached K/V)
    input_shapes: list[tuple[int, ...]] = field(default_factory=list)  # as the engine saw them (whole batch)
    output_shape: tuple[int, ...] = ()  # as the engine produced it (whole batch)
    ref_error: float | None = None  # max |output - the same module in float64 on the same inputs|; None: not evaluated
    cached_from_step: int | None = None  # attention: the step that wrote the K/V it read (None: not cached input)
    input_names: list[str] = field(default_factory=list)  # one per input: "arg0", keyword names, "past_keys"/"past_values"
    dtype: str = ""  # the engine's dtype of the output ("bfloat16" where `output` holds it widened to float32, exactly)
    phase: str = "forward"  # forward | backward (gradient wrt the module's output) | param_grad
    cached_steps: list[int] = field(default_factory=list)  # attention: per cached position kept, the step that wrote it
    positions: list[int] | None = None  # the sequence positions `output`'s token axis holds (None: every position
    # of the step, in order); llama.cpp's last layer, e.g., keeps only the rows that yield logits
    whole: bool | None = None  # True: kept whole, other prompts' rows included (no row of the prompt to cut); False: only
    # the prompt's rows (the capture cut them, or the forward held no other); None: not said (locate judges by shape)
    reeval: Any = None  # a call that sets ref_error when the reference is evaluated on demand (hf); None: nothing pending


@dataclass
class Capture:
    """A re-run's outputs up to the captured step (so the caller can check it reproduced the
    recorded trace) and the tensors captured at that step."""

    generations: list[Any]  # base.Generation per request, steps 0..spec.step
    tensors: list[CapturedTensor]
    level: str  # what was captured in the end (may be below the level asked for)
    notes: list[str] = field(default_factory=list)  # what was and was not captured, in plain words
    engine: dict[str, Any] = field(default_factory=dict)  # how the engine ran the re-run (its own facts)
    seconds: dict[str, list[float]] = field(default_factory=dict)  # [wall, cpu] s: "captured" (the re-run with capture),
    # "bare" (the same re-run without it, where the backend measures it), "reference" (float64 evaluated on demand)
