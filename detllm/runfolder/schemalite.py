"""A small validator for the JSON Schema keywords detllm's own schemas use, compiled to Python closures.

Owns only a first answer for small artifacts as they are written and read (schema_io.validate): True when the
object surely is valid, False when it surely is not, None when it cannot be sure (a keyword, a type or
a string it does not decide exactly). Only True ends validation; anything else goes to jsonschema-rs
and jsonschema as before. It exists to keep jsonschema-rs (~9 MiB resident) out of a small process.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Optional
from urllib.parse import urldefrag, urljoin

Check = Callable[[Any], Optional[bool]]  # True valid, False invalid, None not known here

_ANNOTATIONS = frozenset({"$schema", "$id", "$defs", "$comment", "title", "description", "examples", "default",
                          "deprecated", "readOnly", "writeOnly"})
_NUMBER_BOUNDS = {"minimum": lambda x, b: x >= b, "maximum": lambda x, b: x <= b,
                  "exclusiveMinimum": lambda x, b: x > b, "exclusiveMaximum": lambda x, b: x < b}
# regex syntax that Python's re and ECMA-262 read alike on ASCII text without line breaks: literals,
# classes, groups, lookaheads, quantifiers, anchors, \uXXXX, and escapes of punctuation (no \d \w \s \b)
_SAFE_PATTERN = re.compile(r"(?:[^\\]|\\[\\./\-\[\](){}*+?^$|]|\\u[0-9a-fA-F]{4})*")
_PLAIN_TEXT = re.compile(r"[\x00-\x09\x0b\x0c\x0e-\x7f]*")  # ASCII, no \n or \r (where `$` differs)


def _kind(x: Any) -> Optional[str]:
    """The JSON type of a plain Python value; None for anything else (a str or int subclass, a tuple,
    a non-finite float), which this validator leaves to the others."""
    t = type(x)
    if x is None:
        return "null"
    if t is bool:
        return "boolean"
    if t is int:
        return "integer"
    if t is float:
        return "number" if math.isfinite(x) else None
    if t is str:
        return "string"
    if t is list:
        return "array"
    if t is dict:
        return "object" if all(type(k) is str for k in x) else None
    return None


def _type_matches(kind: str, name: str, x: Any) -> Optional[bool]:
    if name == "number":
        return kind in ("integer", "number")
    if name == "integer" and kind == "number":
        return None if x.is_integer() else False  # 2.0: jsonschema and jsonschema-rs decide
    return kind == name


def _equal(a: Any, b: Any) -> Optional[bool]:
    """JSON equality (1 == 1.0, True != 1); None when either side is not plain JSON."""
    ka, kb = _kind(a), _kind(b)
    if ka is None or kb is None:
        return None
    numbers = ("integer", "number")
    if ka in numbers and kb in numbers:
        return a == b
    if ka != kb:
        return False
    if ka == "array":
        if len(a) != len(b):
            return False
        return _all(_equal(x, y) for x, y in zip(a, b))
    if ka == "object":
        if a.keys() != b.keys():
            return False
        return _all(_equal(a[k], b[k]) for k in a)
    return a == b


def _all(results) -> Optional[bool]:
    """Kleene AND: False if any is False, True if all are True, else None."""
    unknown = False
    for r in results:
        if r is False:
            return False
        if r is None:
            unknown = True
    return None if unknown else True


class Compiler:
    """Compiles the schemas of one schema_version, read by their $id through `load`, into checks; each
    $ref is compiled once, when first called, and may refer to itself."""

    def __init__(self, load: Callable[[str], Optional[dict[str, Any]]]):
        self.load = load  # $id -> that schema (None: not one of ours), read when a check first needs it
        self.docs: dict[str, Optional[dict[str, Any]]] = {}
        self.compiled: dict[tuple[str, str], Check] = {}

    def root(self, doc_id: str) -> Check:
        return self._ref(doc_id, "")

    def _ref(self, doc_id: str, pointer: str) -> Check:
        """The check of the schema at doc_id#pointer, compiled when first called (a FAIL report's causes are
        compiled only when one is written; a schema may refer to itself)."""
        key, compiled = (doc_id, pointer), self.compiled

        def check(x: Any) -> Optional[bool]:
            c = compiled.get(key)
            if c is None:
                node = self._resolve(doc_id, pointer)
                c = compiled[key] = self._never if node is None else self._node(node, doc_id)
            return c(x)
        return check

    def _doc(self, doc_id: str) -> Any:
        if doc_id not in self.docs:
            self.docs[doc_id] = self.load(doc_id)
        return self.docs[doc_id]

    def _resolve(self, doc_id: str, pointer: str) -> Any:
        node = self._doc(doc_id)
        for part in (p.replace("~1", "/").replace("~0", "~") for p in pointer.split("/")[1:]):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    @staticmethod
    def _never(x: Any) -> Optional[bool]:
        return None

    def _node(self, schema: Any, base: str) -> Check:
        if schema is True:
            return lambda x: True
        if schema is False:
            return lambda x: False
        if not isinstance(schema, dict) or any(k not in _ANNOTATIONS and k not in _KEYWORDS for k in schema):
            return self._never  # a keyword not handled here: the whole answer is left to the others
        if "$id" in schema and schema["$id"] != base:
            return self._never
        groups = dict.fromkeys(_KEYWORDS[k] for k in schema if k in _KEYWORDS)  # each group compiled once
        checks = [build(self, schema, base) for build in groups]
        if len(checks) == 1:
            return checks[0]
        return lambda x: _all(c(x) for c in checks)

    # ------------------------------------------------------------------ keywords

    def _type(self, s: dict, base: str) -> Check:
        names = s["type"] if isinstance(s["type"], list) else [s["type"]]

        def check(x: Any) -> Optional[bool]:
            kind = _kind(x)
            if kind is None:
                return None
            results = [_type_matches(kind, n, x) for n in names]
            return True if True in results else (None if None in results else False)
        return check

    def _const(self, s: dict, base: str) -> Check:
        want = s["const"]
        return lambda x: _equal(x, want)

    def _enum(self, s: dict, base: str) -> Check:
        options = list(s["enum"])

        def check(x: Any) -> Optional[bool]:
            results = [_equal(x, o) for o in options]
            return True if True in results else (None if None in results else False)
        return check

    def _ref_kw(self, s: dict, base: str) -> Check:
        url, pointer = urldefrag(urljoin(base, s["$ref"]))
        if pointer and not pointer.startswith("/"):
            return self._never
        return self._ref(url, pointer)

    def _object(self, s: dict, base: str) -> Check:
        """properties, required and additionalProperties together (additionalProperties reads properties)."""
        props = {k: self._node(v, base) for k, v in (s.get("properties") or {}).items()}
        required = list(s.get("required") or [])
        extra = s.get("additionalProperties", True)
        extra_check = None if extra is True else self._node(extra, base)

        def check(x: Any) -> Optional[bool]:
            kind = _kind(x)
            if kind != "object":  # (a dict with a key that is not a str is not plain JSON: not known)
                return True if kind is not None else None
            results = [k in x for k in required]
            for k, v in x.items():
                c = props.get(k)
                if c is not None:
                    results.append(c(v))
                elif extra_check is not None:
                    results.append(extra_check(v))
            return _all(results)
        return check

    def _array(self, s: dict, base: str) -> Check:
        """prefixItems, items, minItems and maxItems together (items reads prefixItems)."""
        prefix = [self._node(v, base) for v in s.get("prefixItems") or []]
        rest = self._node(s["items"], base) if "items" in s else None
        lo, hi = s.get("minItems", 0), s.get("maxItems")

        def check(x: Any) -> Optional[bool]:
            if type(x) is not list:
                return True if _kind(x) is not None else None
            results = [len(x) >= lo, hi is None or len(x) <= hi]
            results += [c(v) for c, v in zip(prefix, x)]
            if rest is not None:
                results += [rest(v) for v in x[len(prefix):]]
            return _all(results)
        return check

    def _bound(self, s: dict, base: str) -> Check:
        bounds = [(_NUMBER_BOUNDS[k], s[k]) for k in _NUMBER_BOUNDS if k in s]

        def check(x: Any) -> Optional[bool]:
            kind = _kind(x)
            if kind is None:
                return None
            if kind not in ("integer", "number"):
                return True
            return all(ok(x, b) for ok, b in bounds)
        return check

    def _pattern(self, s: dict, base: str) -> Check:
        pattern = s["pattern"]
        if not _SAFE_PATTERN.fullmatch(pattern) or re.search(r"\(\?[^!=:]|\{,", pattern):  # (?P< (?i) {,n}: Python's only
            return self._never
        rx = re.compile(pattern)

        def check(x: Any) -> Optional[bool]:
            kind = _kind(x)
            if kind != "string":
                return None if kind is None else True
            if not _PLAIN_TEXT.fullmatch(x):
                return None
            return rx.search(x) is not None
        return check

    def _if(self, s: dict, base: str) -> Check:
        if "if" not in s:
            return lambda x: True  # then/else alone have no effect
        cond = self._node(s["if"], base)
        then = self._node(s["then"], base) if "then" in s else (lambda x: True)
        other = self._node(s["else"], base) if "else" in s else (lambda x: True)

        def check(x: Any) -> Optional[bool]:
            r = cond(x)
            return None if r is None else (then(x) if r else other(x))
        return check

    def _all_of(self, s: dict, base: str) -> Check:
        subs = [self._node(v, base) for v in s["allOf"]]
        return lambda x: _all(c(x) for c in subs)

    def _any_of(self, s: dict, base: str) -> Check:
        subs = [self._node(v, base) for v in s["anyOf"]]

        def check(x: Any) -> Optional[bool]:
            results = [c(x) for c in subs]
            return True if True in results else (None if None in results else False)
        return check

    def _one_of(self, s: dict, base: str) -> Check:
        subs = [self._node(v, base) for v in s["oneOf"]]

        def check(x: Any) -> Optional[bool]:
            results = [c(x) for c in subs]
            if results.count(True) > 1:
                return False
            if None in results:
                return None
            return results.count(True) == 1
        return check


# keyword -> the builder of its group (properties, required and additionalProperties are read together)
_KEYWORDS: dict[str, Callable[[Compiler, dict, str], Check]] = {
    "type": Compiler._type, "const": Compiler._const, "enum": Compiler._enum, "$ref": Compiler._ref_kw,
    "properties": Compiler._object, "required": Compiler._object, "additionalProperties": Compiler._object,
    "prefixItems": Compiler._array, "items": Compiler._array, "minItems": Compiler._array, "maxItems": Compiler._array,
    "minimum": Compiler._bound, "maximum": Compiler._bound, "exclusiveMinimum": Compiler._bound,
    "exclusiveMaximum": Compiler._bound, "pattern": Compiler._pattern, "if": Compiler._if, "then": Compiler._if,
    "else": Compiler._if, "allOf": Compiler._all_of, "anyOf": Compiler._any_of, "oneOf": Compiler._one_of,
}
