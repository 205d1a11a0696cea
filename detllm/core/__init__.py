"""The base every layer may use: config, errors (one tree, an exit code per class), hashing,
identity, versions, prompts, model files, chatter, what is process-wide (processwide, children),
the test-only perturbation and the float64 re-evaluation. Imports nothing else of detllm."""
