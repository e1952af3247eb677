"""The vault's key hierarchy.

    master key (VAULT_MASTER_KEY / VAULT_MASTER_KEY_FILE; never stored)
      └─ wraps (SecretBox) a fresh data key per protected key
           └─ encrypts (XChaCha20-Poly1305, bound to what the key is for) one private key:
              an org's X25519 key, or the vault's Ed25519 token-signing key

A master-key check value in the database tells a wrong master key from a right one at
start-up, before anything is decrypted or written.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import stat
from pathlib import Path

from nacl import bindings
from nacl.exceptions import CryptoError
from nacl.secret import SecretBox
from nacl.utils import random as random_bytes

from rlnode.service.app import StartupError

CHECK_PLAINTEXT = b"rlnode.vault.master-key-check.v1"
_AEAD_NONCE = bindings.crypto_aead_xchacha20poly1305_ietf_NPUBBYTES


class MasterKeyError(StartupError):
    """The vault cannot start: no master key, an unreadable one, or the wrong one."""


def new_master_key() -> str:
    return base64.b64encode(random_bytes(SecretBox.KEY_SIZE)).decode()


def load_master_key(value: str | None, file: Path | None) -> bytes:
    if value and file:
        raise MasterKeyError("set VAULT_MASTER_KEY or VAULT_MASTER_KEY_FILE, not both")
    if not value and not file:
        raise MasterKeyError(
            "no master key: set VAULT_MASTER_KEY (32 random bytes, base64) or "
            "VAULT_MASTER_KEY_FILE; `rlnode vault master-key` prints a new one. Keep it: "
            "without it the stored secrets cannot be opened"
        )
    source = "VAULT_MASTER_KEY"
    if file:
        source = f"VAULT_MASTER_KEY_FILE ({file})"
        try:
            mode = file.stat().st_mode
            value = file.read_text().strip()
        except OSError as e:
            raise MasterKeyError(f"cannot read {source}: {e.strerror}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise MasterKeyError(
                f"{source} is readable by other users (mode {stat.S_IMODE(mode):o}); run chmod 600 on it"
            )
    try:
        key = base64.b64decode(value or "", validate=True)
    except (binascii.Error, ValueError):
        raise MasterKeyError(f"{source} is not valid base64") from None
    if len(key) != SecretBox.KEY_SIZE:
        raise MasterKeyError(f"{source} must decode to {SecretBox.KEY_SIZE} bytes, not {len(key)}")
    return key


def master_key_id(key: bytes) -> str:
    """Safe to log and store: tells keys apart without revealing them."""
    return hashlib.blake2b(key, digest_size=8, person=b"rlnode-vault-mk").hexdigest()


class KeyWrapper:
    def __init__(self, master_key: bytes) -> None:
        self._box = SecretBox(master_key)
        self.master_key_id = master_key_id(master_key)

    def check_value(self) -> bytes:
        return self._box.encrypt(CHECK_PLAINTEXT)

    def verify_check_value(self, check: bytes) -> None:
        try:
            ok = self._box.decrypt(check) == CHECK_PLAINTEXT
        except CryptoError:
            ok = False
        if not ok:
            raise MasterKeyError(
                f"the master key (id {self.master_key_id}) does not open this vault's keys: it "
                "is not the key the vault's database was created with"
            )

    def wrap(self, secret: bytes, purpose: str) -> tuple[bytes, bytes]:
        """Encrypt `secret` under a fresh data key bound to `purpose`; returns
        (data key wrapped under the master key, nonce + ciphertext)."""
        data_key = random_bytes(bindings.crypto_aead_xchacha20poly1305_ietf_KEYBYTES)
        nonce = os.urandom(_AEAD_NONCE)
        sealed = bindings.crypto_aead_xchacha20poly1305_ietf_encrypt(
            secret, purpose.encode(), nonce, data_key
        )
        return self._box.encrypt(data_key), nonce + sealed

    def unwrap(self, wrapped_key: bytes, ciphertext: bytes, purpose: str) -> bytes:
        try:
            data_key = self._box.decrypt(wrapped_key)
            return bindings.crypto_aead_xchacha20poly1305_ietf_decrypt(
                ciphertext[_AEAD_NONCE:], purpose.encode(), ciphertext[:_AEAD_NONCE], data_key
            )
        except CryptoError:
            raise MasterKeyError(
                f"stored key material for {purpose!r} does not decrypt: wrong master key, or the "
                "row was altered or moved"
            ) from None
