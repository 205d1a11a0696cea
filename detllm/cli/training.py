"""`detllm training` commands: parse -> call the library (training/) -> render -> exit code."""

from __future__ import annotations
