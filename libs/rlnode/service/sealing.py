"""libsodium sealed boxes (X25519 + XSalsa20-Poly1305), as the vault, its clients and the
services that receive secrets use them. A sealed box can be opened only by the holder of
the recipient's private key; the sender stays anonymous."""

from __future__ import annotations

import base64
import binascii
import hashlib

from nacl.exceptions import CryptoError
from nacl.public import PrivateKey, PublicKey, SealedBox
from nacl.signing import VerifyKey

SEALED_BOX_ALG = "libsodium.sealedbox.v1"
SEAL_OVERHEAD = 48  # ephemeral public key (32) + MAC (16)


class SealingError(ValueError):
    pass


def b64decode_strict(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise SealingError(f"{what} is not valid base64") from None


def public_key_from_b64(text: str) -> PublicKey:
    raw = b64decode_strict(text, "the public key")
    if len(raw) != PublicKey.SIZE:
        raise SealingError(f"a public key has {PublicKey.SIZE} bytes, this one {len(raw)}")
    return PublicKey(raw)


def public_key_b64(key: PublicKey | VerifyKey) -> str:
    """A public key (X25519 for sealing, or the vault's Ed25519 verify key) as base64."""
    return base64.b64encode(bytes(key)).decode()


def fingerprint(key: PublicKey) -> str:
    """A short id of a public key, safe to log and audit."""
    return hashlib.sha256(bytes(key)).hexdigest()[:16]


def seal(value: bytes, recipient: PublicKey) -> str:
    """Seal `value` to `recipient`; base64 text."""
    return base64.b64encode(SealedBox(recipient).encrypt(value)).decode()


def open_sealed(ciphertext: bytes, private_key: PrivateKey) -> bytes:
    try:
        return SealedBox(private_key).decrypt(ciphertext)
    except CryptoError:
        raise SealingError(
            "the ciphertext does not open with this key: it was tampered with, or sealed to "
            "another key"
        ) from None


def generate_keypair() -> PrivateKey:
    return PrivateKey.generate()
