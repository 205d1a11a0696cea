"""Training packs: K training steps run and committed step by step in a hash chain (parameters,
gradients, batches, RNG state), checkpoints beside them, and the verify/replay/diff of such packs;
trainer-vs-engine logprob parity (docs/training.md). Uses torch directly for its own training loop
and reaches inference engines only through the Backend interface.
"""
