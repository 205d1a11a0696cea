"""Build the built-in `tiny` model offline: a random Llama with a locally trained BPE tokenizer.

Same bytes on every build (fixed seed, fixed corpus, explicit torch.Generator), so
every machine and every engine sees the same weights. Owns building only; caching
and lookup live in models/__init__.py.
"""

from __future__ import annotations

from pathlib import Path

SEED = 20261122  # the one seed every tiny weight is drawn from
VOCAB_SIZE = 512  # BPE vocabulary, including the one special token
EOS = "<|endoftext|>"  # id 0: bos, eos and pad

# A fixed corpus so the BPE merges are the same on every build (no download).
CORPUS = """\
The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid.
Once upon a time there was a small robot who lived in a quiet town by the sea.
Every morning the robot walked to the harbour and counted the boats that came in.
Deterministic inference means the same input gives the same output, token for token.
Batch size, threads, kernels and library versions can all change the numbers a model computes.
A repro pack holds the environment, the configuration and the trace of every generated token.
def add(a, b):\n    return a + b\n\nprint(add(2, 3))
The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 1000 3.14159 2.71828
Questions? Answers! Lists; items, commas, and (parentheses) [brackets] {braces} "quotes".
Machine learning models predict the next token from the tokens that came before it.
When two runs disagree, the first divergent token tells you where to look.
""" * 4


def build_tokenizer():
    """A byte-level BPE tokenizer trained on CORPUS, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS, unk_token=None
    )


def build_model(vocab_size: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,  # vLLM's CPU attention wants a head size it has kernels for
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        torch_dtype="float32",
    )
    with torch.device("cpu"):
        model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                # std 0.5: small random weights give a flat distribution and degenerate greedy text
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * 0.5)
    model.eval()
    return model


def build(dest: Path) -> Path:
    """Write the tiny model as a plain HF folder at `dest` (created; must not exist)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keep stderr for detllm's one-line messages
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer))
    dest.mkdir(parents=True)
    model.save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)
    return dest
