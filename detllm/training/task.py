"""train-check's built-in task: a causal language model (a built-in model or a local folder)
trained with dropout on (`attention_dropout`, eager attention, `model.train()`) on a small fixed
text shipped here, tokenized by the model's own tokenizer, with AdamW. Owns the Task interface
the step loop drives (draw a batch from the data-order generator, compute a micro-batch's loss)
and the config sections it writes; a user's --script task implements the same interface.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import UsageError

TASK_NAME = "detllm-text/1"
ATTENTION_DROPOUT = 0.1
DTYPES = ("float32", "bfloat16", "float16", "float64")
# The data set: plain prose written for detllm (no licence question), fixed forever for TASK_NAME;
# a changed text is a new task name.
CORPUS = """\
A lighthouse keeper kept a notebook of every ship that passed. Each evening he wrote the hour,
the wind and the colour of the sea, and each morning he read the entries of the night before.
Over the years the notebook grew into a shelf of notebooks, and the shelf into a small library.
Visitors asked him why he wrote it all down. He said that a record is only useful if it is
complete, and that the one night he skipped would be the night someone needed.

The baker on the hill started work at four. Flour, water, salt and a little yesterday's dough:
the same four things every day, weighed on the same brass scale. Some mornings the bread rose
higher and some mornings it was flat, and she kept a chart to learn why. Warm kitchens, old flour,
a draught from the door. When she changed one thing at a time she could see which one mattered.

In the workshop by the river, two clocks hung side by side. They were built from the same plans
by the same hands, yet after a month one ran a minute ahead. The clockmaker opened both and laid
every wheel on the bench in order. The difference was a single spring, wound a little tighter.
Find the first part that differs, he told his apprentice, and you have found where to look.

Numbers follow rules. Two plus three is five, seven times six is forty-two, and a hundred divided
by four is twenty-five. Yet a machine adding a long list of small numbers can give two answers
for the same list if it adds them in a different order, because each sum is rounded as it goes.
The rounding is tiny, but it is not nothing, and over many steps the tiny differences can grow.

A gardener planted a row of beans from one packet, in one bed, on one afternoon. She watered them
from the same can. By midsummer the plants at the sunny end were twice as tall as the ones in the
shade. Same seed, same soil, same water: the sun was the variable nobody had written down.

The map maker checked her survey twice, walking the same path with the same chain. Where the two
walks agreed she inked the line; where they disagreed she walked it a third time. A map, she said,
is a promise that the next traveller will find the road where the line says it is.
""" * 2


def data_sha256() -> str:
    return hashlib.sha256(CORPUS.encode("utf-8")).hexdigest()


def task_section(*, batch_size: int, seq_len: int, attention_dropout: float = ATTENTION_DROPOUT) -> dict[str, Any]:
    """train_config.json's `task` for the built-in task."""
    return {"kind": "builtin", "name": TASK_NAME, "data_sha256": data_sha256(), "batch_size": batch_size, "seq_len": seq_len,
            "attention_dropout": attention_dropout, "attn_implementation": "eager"}


def optimizer_section(lr: float = 1e-3) -> dict[str, Any]:
    """train_config.json's `optimizer`: AdamW, its for-loop implementation (no foreach, no fused)."""
    return {"name": "AdamW", "lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01, "implementation": "for-loop"}


@dataclass
class Batch:
    """One step's data: the sample indexes (the data order), and its micro-batches of token ids."""

    samples: list[int]
    micro: list[Any]  # [rows, columns] int64 tensors, in order


@dataclass
class Task:
    """What the step loop drives: a model in training mode, its optimizer (and, for a script, a
    scheduler and a scaler), a way to draw the next batch from the data-order generator and a loss."""

    model: Any
    optimizer: Any
    tokens: Any  # 1-dim int64 tensor: the tokenized data set
    batch_size: int
    seq_len: int
    grad_accumulation: int = 1
    scheduler: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    def next_batch(self, data: Any) -> Batch:
        """batch_size windows of seq_len tokens at offsets drawn from `data` (a torch.Generator),
        split into grad_accumulation micro-batches."""
        import torch

        offsets = torch.randint(0, int(self.tokens.numel()) - self.seq_len + 1, (self.batch_size,), generator=data)
        rows = torch.stack([self.tokens[o:o + self.seq_len] for o in offsets.tolist()])
        return Batch(offsets.tolist(), list(rows.chunk(self.grad_accumulation)))

    def loss(self, micro: Any) -> Any:
        """Mean next-token cross-entropy of one micro-batch (labels = inputs, shifted by the model)."""
        return self.model(input_ids=micro, labels=micro).loss


def check_task_args(*, batch_size: int, seq_len: int, grad_accumulation: int, dtype: str) -> None:
    if batch_size < 1 or seq_len < 2:
        raise UsageError(f"batch size {batch_size} and sequence length {seq_len} must be at least 1 and 2")
    if grad_accumulation < 1 or batch_size % grad_accumulation:
        raise UsageError(f"gradient accumulation {grad_accumulation} must divide the batch size {batch_size}")
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}", hint=f"one of {', '.join(DTYPES)}")


def build_task(config: dict[str, Any], model_path: Path) -> Task:
    """The built-in task of `config` (train_config.json's document) on the model folder; a
    --script config's task is the script's (script.py; `model_path` is then the script)."""
    if config["task"]["kind"] == "script":
        from .script import build_script_task

        return build_script_task(config, model_path)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # stderr keeps detllm's own lines
    task, opt = config["task"], config["optimizer"]
    dtype = getattr(torch, config["dtype"])
    tok = AutoTokenizer.from_pretrained(str(model_path))
    tokens = torch.tensor(tok(CORPUS, add_special_tokens=False)["input_ids"], dtype=torch.int64)
    if tokens.numel() < task["seq_len"] + 1:
        raise UsageError(f"the data set is {tokens.numel()} tokens with this tokenizer, fewer than --seq-len {task['seq_len']}")
    model = AutoModelForCausalLM.from_pretrained(str(model_path), attention_dropout=task["attention_dropout"],
                                                 attn_implementation=task["attn_implementation"], dtype=dtype)
    model.train()
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=opt["lr"], betas=tuple(opt["betas"]), eps=opt["eps"],
                                  weight_decay=opt["weight_decay"], foreach=False, fused=False)
    return Task(model, optimizer, tokens, task["batch_size"], task["seq_len"], config["grad_accumulation"])


__all__ = ["ATTENTION_DROPOUT", "Batch", "CORPUS", "DTYPES", "TASK_NAME", "Task", "build_task", "check_task_args", "data_sha256",
           "optimizer_section", "task_section"]
