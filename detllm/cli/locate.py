"""`detllm locate` commands: parse -> call the library (locate/) -> render -> exit code."""

from __future__ import annotations
