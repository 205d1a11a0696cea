"""The bottom of the artifact stack: schemas, stamping, JSON text and atomic writes.

Owns loading and applying schemas/*.schema.json (each file under its own schema_version),
the `schema_version`/`artifact_type` header, non-finite-safe JSON text and the
write-to-temp-then-rename rule. Imports nothing of detllm but errors, versions and schemalite
(which imports none), so records, env, artifacts, integrity and pack can all build on it without
a cycle.
Does not own the run-folder layout (artifacts.py) or manifests (integrity.py).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..core.errors import ArtifactError
from ..core.versions import CURRENT as SCHEMA_VERSION  # what this detllm writes; the bump rule is in versions.py
from ..core.versions import READABLE as READABLE_SCHEMA_VERSIONS  # each file is validated against its own version's schemas


def schema_dir(version: str = SCHEMA_VERSION) -> Path:
    """Schemas ship inside the wheel as detllm/schemas; in a source checkout they are ../schemas.
    The current version's schemas sit at the top; each older version's frozen copy in v<N>/."""
    here = Path(__file__).resolve().parents[1]  # detllm/ (this file is detllm/runfolder/schema_io.py)
    for cand in (here / "schemas", here.parent / "schemas"):
        if cand.is_dir():
            return cand if version == SCHEMA_VERSION else cand / f"v{version}"
    raise ArtifactError("detllm's JSON schemas are missing from this installation", hint="reinstall detllm")


@lru_cache(maxsize=None)
def load_schema(artifact_type: str, version: str = SCHEMA_VERSION) -> dict[str, Any]:
    path = schema_dir(version) / f"{artifact_type}.schema.json"
    if not path.is_file():
        raise ArtifactError(f"no schema for artifact_type {artifact_type!r} at schema_version {version!r}")
    return json.loads(path.read_text())


@lru_cache(maxsize=None)
def _schemas(version: str) -> tuple[dict[str, Any], ...]:
    """Every schema of a version, read once for both validators of every artifact type."""
    return tuple(json.loads(p.read_text()) for p in sorted(schema_dir(version).glob("*.schema.json")))


@lru_cache(maxsize=None)
def _validator(artifact_type: str, version: str = SCHEMA_VERSION):
    from jsonschema import Draft202012Validator
    from referencing import Registry, Resource

    registry = Registry().with_resources([(s["$id"], Resource.from_contents(s)) for s in _schemas(version)])
    # the schemas themselves are checked against the metaschema by tests/test_schemas.py
    return Draft202012Validator(load_schema(artifact_type, version), registry=registry)


@lru_cache(maxsize=None)
def _fast_validator(artifact_type: str, version: str = SCHEMA_VERSION):
    """jsonschema-rs's validator of the same schema (~400x faster: 2 ms, not 0.95 s, for a diff
    report of 1,000 divergences), or None where it is not installed or cannot build it."""
    try:
        import jsonschema_rs
    except ImportError:
        return None
    try:
        registry = jsonschema_rs.Registry([(s["$id"], s) for s in _schemas(version)])
        return jsonschema_rs.Draft202012Validator(load_schema(artifact_type, version), registry=registry)
    except Exception:  # noqa: BLE001 - a schema it cannot take: jsonschema alone decides
        return None


@lru_cache(maxsize=None)
def _lite_validator(artifact_type: str, version: str = SCHEMA_VERSION):
    """schemalite's check of a schema: True where the object surely is valid, else False or None."""
    return _lite_compiler(version).root(load_schema(artifact_type, version)["$id"])


@lru_cache(maxsize=None)
def _lite_compiler(version: str):
    from .schemalite import Compiler

    def load(doc_id: str) -> dict[str, Any] | None:  # an $id of ours names its file: .../schemas/<type>.schema.json
        name = doc_id.rsplit("/", 1)[-1]
        if not name.endswith(".schema.json"):
            return None
        try:
            doc = load_schema(name[: -len(".schema.json")], version)
        except ArtifactError:
            return None
        return doc if doc.get("$id") == doc_id else None

    return Compiler(load)


_LITE_MAX_CHARS = 1 << 16  # a larger artifact (a diff report) is validated faster by jsonschema-rs than in Python


def validate(obj: Any, artifact_type: str, *, where: str = "", size: int | None = None) -> None:
    """Raise ArtifactError naming the first violation, against the schema of the object's own
    schema_version (a folder written by an older detllm is read under its own rules). What
    jsonschema-rs finds valid is valid (tests/test_schema_io.py holds it to jsonschema's
    answers); anything else is judged, and its violation named, by jsonschema. An artifact being
    written or read whose JSON text has `size` <= _LITE_MAX_CHARS characters is first given to schemalite,
    whose True is final (tests/test_schemalite.py holds it to jsonschema's answers): a small process
    then never loads jsonschema-rs (~9 MiB resident)."""
    version = obj.get("schema_version") if isinstance(obj, dict) else None
    if version not in READABLE_SCHEMA_VERSIONS:
        version = SCHEMA_VERSION  # the const in the schema then names the problem
    if size is not None and size <= _LITE_MAX_CHARS and _lite_validator(artifact_type, version)(obj) is True:
        return
    fast = _fast_validator(artifact_type, version)
    try:
        if fast is not None and fast.is_valid(obj):
            return  # else jsonschema decides, and names the violation as it always has
    except (ValueError, TypeError, OverflowError):
        pass  # a value it cannot take (an int past 64 bits): jsonschema decides
    err = next(iter(_validator(artifact_type, version).iter_errors(obj)), None)
    if err is not None:
        loc = "/".join(str(p) for p in err.absolute_path) or "(top level)"
        raise ArtifactError(f"{where or artifact_type}: schema violation at {loc}: {err.message[:200]}")


def check_header(obj: Any, artifact_type: str, where: str) -> None:
    """The object is a dict of the expected artifact_type at a schema_version this detllm reads."""
    if not isinstance(obj, dict):
        raise ArtifactError(f"{where}: expected a JSON object")
    if obj.get("artifact_type") != artifact_type:
        raise ArtifactError(f"{where}: artifact_type is {obj.get('artifact_type')!r}, expected {artifact_type!r}")
    if obj.get("schema_version") not in READABLE_SCHEMA_VERSIONS:
        raise ArtifactError(
            f"{where}: schema_version {obj.get('schema_version')!r} is not one this detllm reads ({', '.join(READABLE_SCHEMA_VERSIONS)})",
            hint="upgrade detllm",
        )


def stamp(artifact_type: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"schema_version": SCHEMA_VERSION, "artifact_type": artifact_type, **body}


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def finite(obj: Any) -> Any:
    """JSON has no NaN/Infinity: non-finite floats become null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dumps(obj: Any, *, indent: int | None = 2) -> str:
    """An artifact's JSON: non-finite floats as null, UTF-8 text, indented."""
    return to_json(finite(obj), indent=indent, ensure_ascii=False, allow_nan=False)


_FORMAT_MIN_CHARS = 1 << 18  # below this, json's own indenting costs less than loading msgspec


def to_json(obj: Any, *, indent: int | None = 2, ensure_ascii: bool = True, allow_nan: bool = True) -> str:
    """json.dumps(obj, indent=indent, ...), byte for byte, faster for a large object. json indents
    in Python, ~7x slower than its C encoder (0.27 s for a 2.5 MB diff report): a large object
    is written compact by the C encoder and re-indented by msgspec, which copies each number and
    string as written (tests/test_schema_io.py holds the two to the same bytes)."""
    compact = json.dumps(obj, ensure_ascii=ensure_ascii, allow_nan=allow_nan)
    if indent is None:
        return compact
    if len(compact) < _FORMAT_MIN_CHARS:
        return json.dumps(obj, indent=indent, ensure_ascii=ensure_ascii, allow_nan=allow_nan)
    import msgspec

    return msgspec.json.format(compact.encode(), indent=indent).decode()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _umask()  # read once at import: os.umask can only be read by setting it


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temporary name in the same folder, fsync, then rename over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; artifacts are read by CI uploaders and other users
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(folder: Path, name: str, obj: dict[str, Any]) -> Path:
    """Validate against the schema named by obj['artifact_type'], then write atomically."""
    try:  # the usual artifact has no NaN or inf: no copy made to replace them (finite() walks it all)
        text = to_json(obj, ensure_ascii=False, allow_nan=False)
    except ValueError:
        obj = finite(obj)
        text = to_json(obj, ensure_ascii=False, allow_nan=False)
    validate(obj, obj["artifact_type"], where=name, size=len(text))
    path = folder / name
    atomic_write_text(path, text + "\n")
    return path


__all__ = ["READABLE_SCHEMA_VERSIONS", "SCHEMA_VERSION", "atomic_write_text", "check_header", "dumps", "finite", "load_schema",
           "schema_dir", "stamp", "to_json", "utc_now", "validate", "write_json"]
