"""One exception tree for detllm; each class names the exit code the CLI returns.

The library raises these and never prints or exits; the CLI catches `DetllmError`
once and prints one line. Native errors are translated at the boundary with
`raise SomeError(...) from exc`.

    DetllmError                     (root, never raised directly)
    ├── UsageError              2   bad flags, prompt files, model names or paths
    ├── TierUnsupportedError    3   strict mode: the backend cannot enforce the tier
    ├── BackendUnavailableError 4   engine/binary/CUDA missing (says how to install)
    ├── ArtifactError           5   not a detllm folder, unknown schema_version, schema violation
    ├── IntegrityError          6   verify: manifest, hash chain or signature does not match
    ├── ModelChangedError       7   replay: local weights differ from the pack's
    └── BackendError            8   the engine failed while running (crash, server died)
Exit 0 is PASS, exit 1 is FAIL (a divergence was found); neither is an exception.
"""

from __future__ import annotations

EXIT_PASS = 0
EXIT_FAIL = 1
EXIT_UNVERIFIED_STRICT = 3  # strict: an axis the check varied was not shown engaged (the folder is written and sealed)


class DetllmError(Exception):
    """Root of every error detllm raises on purpose."""

    exit_code = 2

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint  # what the user should do next, shown after the message

    def one_line(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class UsageError(DetllmError):
    exit_code = 2


class TierUnsupportedError(DetllmError):
    exit_code = 3


class BackendUnavailableError(DetllmError):
    exit_code = 4


class ArtifactError(DetllmError):
    exit_code = 5


class IntegrityError(DetllmError):
    exit_code = 6


class ModelChangedError(DetllmError):
    exit_code = 7


class BackendError(DetllmError):
    exit_code = 8


EXIT_CODES: dict[int, str] = {
    0: "PASS: every required comparison agreed",
    1: "FAIL: a divergence was found",
    2: "usage error: bad input, nothing was written",
    3: "strict: a tier or an axis could not be enforced or shown (a tier the backend cannot enforce: refused, nothing "
       "run; an axis not shown engaged: status UNVERIFIED, the folder written and sealed)",
    4: "backend unavailable: engine, binary or device missing",
    5: "artifact error: not a detllm run folder, unknown schema_version or schema violation",
    6: "integrity error: manifest, hash chain or signature mismatch",
    7: "replay refused: the local model's weights differ from the pack's",
    8: "backend error: the engine failed while running",
}
