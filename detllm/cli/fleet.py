"""`detllm fleet` commands: parse -> call the library (fleet/) -> render -> exit code."""

from __future__ import annotations
