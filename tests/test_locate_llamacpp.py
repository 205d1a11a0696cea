"""`detllm locate` hf against llama.cpp on `tiny` F32 (the same weights as GGUF), one sequence: the
llama.cpp side re-run through the llamacpp backend's capture (the detllm-dump target of the pinned
build), aligned by name with hf's modules, and the first op that differs named with its shapes."""

from __future__ import annotations

import pytest

import detllm
from detllm.locate import locate

from .conftest import llama_server_or_fail

pytestmark = pytest.mark.engine

PROMPT = ["The capital of France is"]


def test_hf_against_llamacpp_names_the_first_op_in_layer_0(tmp_path):
    llama_server_or_fail()
    for backend in ("hf", "llamacpp"):
        detllm.run(backend=backend, model="tiny", dtype="float32", max_new_tokens=2, tier=2, prompts=PROMPT,
                   out=tmp_path / backend)
    doc = locate(str(tmp_path / "hf"), str(tmp_path / "llamacpp"), out=tmp_path / "loc").doc
    assert doc["status"] == "located", doc["line"]
    assert doc["left"]["reproduced"] and doc["right"]["reproduced"]
    op = doc["first_bitwise_op"]
    assert op["module"].startswith("model.layers.0.") and op["step"] == 0, op["module"]
    assert op["output_shape"]["left"] and op["output_shape"]["right"]
    layers = [r for r in doc["layers"] if r["kind"] == "layer"]
    assert layers and layers[0]["output_equal"] is False  # the first layer boundary already differs across engines
