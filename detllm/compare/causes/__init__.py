"""Why two selections of trace records differ: every recorded difference as a cause with its
evidence, ranked. One implementation for `check` (selections of one folder) and `diff` (two
folders); reads artifacts only, and docs/causes.md says what each code means. Re-exports only.

A difference is routed by what it is, not by which file holds it: what the user requested is
CONFIG (config.py); what the machine or the engine chose where nothing was requested (threads
in effect, dtype "auto" resolved, hardware, kernel paths) is ENV (environment.py); what follows
from the batch sizes (llama.cpp slots, vLLM max_num_seqs) is batch evidence (variance.py);
what never changes the computation (tier, mode, ports, timeouts) and fields recorded with
different meanings by two schema versions are never causes (notes.py). The weights, tokenizer
and prompts are inputs.py's; classifier.py runs them all, codes.py ranks and merges.
"""

from __future__ import annotations

from .classifier import differences, explain
from .codes import ADVICE, RANK, TITLES, merge, merge_batch_sizes, rank
from .config import BATCH_DERIVED, INERT_CONFIG, INERT_OPTIONS, LOGPROBS_COUNT_MATTERS, dtype_in_effect
from .notes import Notes, schema_versions
from .sides import Side, flat_diff
from .variance import server_batching

__all__ = ["ADVICE", "BATCH_DERIVED", "INERT_CONFIG", "INERT_OPTIONS", "LOGPROBS_COUNT_MATTERS", "RANK", "TITLES", "Notes",
           "Side", "differences", "dtype_in_effect", "explain", "flat_diff", "merge", "merge_batch_sizes", "rank",
           "schema_versions", "server_batching"]
