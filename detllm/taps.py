"""Hooks on a torch module tree: capture each module's (and, optionally, each aten op's) inputs and
outputs, forward and backward, under Hugging Face module names; and the test-only perturbation of
one module's output or weight. Used by the torch backends' capture (locate) and by the training
loop. torch is imported lazily, inside the functions that need it.
"""
