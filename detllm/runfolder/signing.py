"""Ed25519 signatures over manifest.json (manifest.sig), for the optional extra detllm[sign].

Owns loading keys, writing the signature and checking it. `cryptography` is imported only
when a key is used; without it the error says what to install. Does not own what is signed
(integrity.py: the manifest's exact bytes) or when (pipeline/outcome.write_report).
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.errors import IntegrityError, UsageError

_GENPKEY = "openssl genpkey -algorithm ed25519 -out key.pem"


def _crypto():
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as exc:
        raise UsageError("signing needs the 'cryptography' package", hint="install detllm[sign]") from exc
    return serialization, ed25519, InvalidSignature


@dataclass(frozen=True)
class Signer:
    """An Ed25519 private key, loaded and checked before anything runs."""

    key: Any  # cryptography Ed25519PrivateKey

    def sign(self, data: bytes) -> str:
        """manifest.sig: the 64-byte signature over `data`, base64, one line."""
        return base64.b64encode(self.key.sign(data)).decode("ascii") + "\n"

    @property
    def key_sha256(self) -> str:
        return key_sha256(self.key.public_key())


def load_signing_key(path: str | Path) -> Signer:
    """An unencrypted PEM (PKCS#8) Ed25519 private key, as `openssl genpkey -algorithm ed25519` writes."""
    serialization, ed25519, _ = _crypto()
    data = _read_key(path, "--sign-key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"--sign-key {str(path)!r} is not an unencrypted PEM private key ({str(exc).splitlines()[0][:120]})",
                         hint=f"create one with: {_GENPKEY}") from exc
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise UsageError(f"--sign-key {str(path)!r} is not an Ed25519 key", hint=f"create one with: {_GENPKEY}")
    return Signer(key)


def load_public_key(path: str | Path):
    """A PEM Ed25519 public key (`openssl pkey -in key.pem -pubout`) or an OpenSSH `ssh-ed25519` line."""
    serialization, ed25519, _ = _crypto()
    data = _read_key(path, "--pubkey")
    try:
        key = (serialization.load_ssh_public_key(data) if data.lstrip().startswith(b"ssh-")
               else serialization.load_pem_public_key(data))
    except (ValueError, TypeError) as exc:
        raise UsageError(f"--pubkey {str(path)!r} is not a PEM or OpenSSH public key") from exc
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise UsageError(f"--pubkey {str(path)!r} is not an Ed25519 public key")
    return key


def key_sha256(public_key) -> str:
    """sha256 of the raw 32-byte public key: how verify names the key that signed."""
    serialization, _, _ = _crypto()
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def check_signature(sig_path: Path, signed: bytes, pubkey: str | Path | None) -> tuple[str, str | None]:
    """("verified", key sha256) or, without a key, ("not checked" | "absent", None).
    IntegrityError when a key is given and the signature is missing or does not verify."""
    if pubkey is None:
        return ("not checked" if sig_path.exists() else "absent"), None
    key = load_public_key(pubkey)
    _, _, InvalidSignature = _crypto()
    if not sig_path.is_file() or sig_path.is_symlink():
        raise IntegrityError(f"{sig_path.name}: missing, so the pack is not signed", hint="verify without --pubkey, or ask for a signed pack")
    try:
        key.verify(base64.b64decode(sig_path.read_bytes().strip(), validate=True), signed)
    except (ValueError, InvalidSignature) as exc:
        raise IntegrityError(f"{sig_path.name}: does not verify manifest.json with {str(pubkey)!r}",
                             hint="the manifest changed after signing, or another key signed it") from exc
    return "verified", key_sha256(key)


def _read_key(path: str | Path, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise UsageError(f"{flag} {str(path)!r} cannot be read ({exc.__class__.__name__})") from exc
