"""The check pipeline: run prompts through a backend (runner, batching, fresh processes), the probes a
check runs itself (control, cacheprobe), the one verdict maker of a check (checkverdict) and its
re-derivation from a sealed trace (rederive). Reaches an engine only through backends.base/registry;
knows nothing of the commands above it."""
