"""What a model is, by content: `ModelIdentity` and the `WeightFile`s it lists.

Plain records every backend returns from `model_identity()` and run_config.json carries.
Owns no hashing (hashing.py fills them in) and no loading (the backends).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WeightFile:
    file: str  # path relative to the model folder
    sha256: str
    size: int  # bytes


@dataclass(frozen=True)
class ModelIdentity:
    id: str  # what the user passed (built-in name, path or hub id)
    path: str | None  # resolved local path
    revision: str | None
    format: str  # safetensors, pytorch, gguf, fake
    weights: tuple[WeightFile, ...]
    weights_sha256: str | None  # sha256 over the sorted (file, sha256) list; None: not hashed (a remote server's weights)
    tokenizer_sha256: str | None  # sha256 over the tokenizer files' contents, not their paths; None: not hashed (remote)
    quantization: str | None = None  # e.g. Q4_1 for a GGUF file
    config_sha256: str | None = None  # sha256 over the computation-relevant fields of config.json + generation_config.json (None: inside the weights file, as in GGUF)
    config_files_sha256: str | None = None  # sha256 over those files' bytes: a cosmetic re-save changes only this
    chat_template_sha256: str | None = None  # the chat template's text, apart from tokenizer_sha256 (None: no template)
    remote: str | None = None  # why the digests are None ("weights not hashed: remote ..."); omitted from run_config when None

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["weights"] = [dataclasses.asdict(w) for w in self.weights]
        if self.remote is None:
            del d["remote"]
        return d


__all__ = ["ModelIdentity", "WeightFile"]
