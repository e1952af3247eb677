"""The vault's key hierarchy: master key loading, check value, purpose-bound wrapping."""

from __future__ import annotations

import base64

import pytest

from rlnode.service.sealing import SealingError, generate_keypair, open_sealed, seal
from rlnode_services.credential_vault.crypto import (
    KeyWrapper,
    MasterKeyError,
    load_master_key,
    new_master_key,
)


def test_new_master_keys_load_and_differ(tmp_path) -> None:
    a, b = new_master_key(), new_master_key()
    assert a != b and len(load_master_key(a, None)) == 32
    path = tmp_path / "mk"
    path.write_text(a + "\n")
    path.chmod(0o600)
    assert load_master_key(None, path) == base64.b64decode(a)


def test_master_key_problems_are_named(tmp_path) -> None:
    with pytest.raises(MasterKeyError, match="no master key"):
        load_master_key(None, None)
    with pytest.raises(MasterKeyError, match="not both"):
        load_master_key(new_master_key(), tmp_path / "x")
    with pytest.raises(MasterKeyError, match="cannot read"):
        load_master_key(None, tmp_path / "missing")
    with pytest.raises(MasterKeyError, match="must decode to 32 bytes, not 16"):
        load_master_key(base64.b64encode(b"x" * 16).decode(), None)


def test_the_check_value_tells_keys_apart() -> None:
    right = KeyWrapper(base64.b64decode(new_master_key()))
    check = right.check_value()
    right.verify_check_value(check)
    wrong = KeyWrapper(base64.b64decode(new_master_key()))
    with pytest.raises(MasterKeyError, match="does not open this vault's keys"):
        wrong.verify_check_value(check)
    assert right.master_key_id != wrong.master_key_id


def test_wrapped_keys_open_only_for_their_purpose_and_master() -> None:
    wrapper = KeyWrapper(base64.b64decode(new_master_key()))
    wrapped, ciphertext = wrapper.wrap(b"private-key-bytes", "org:acme:key:k_1")
    assert b"private-key-bytes" not in ciphertext + wrapped
    assert wrapper.unwrap(wrapped, ciphertext, "org:acme:key:k_1") == b"private-key-bytes"
    with pytest.raises(MasterKeyError, match="does not decrypt"):
        wrapper.unwrap(wrapped, ciphertext, "org:globex:key:k_1")  # moved to another org's row
    with pytest.raises(MasterKeyError):
        KeyWrapper(base64.b64decode(new_master_key())).unwrap(
            wrapped, ciphertext, "org:acme:key:k_1"
        )
    tampered = ciphertext[:-1] + bytes([ciphertext[-1] ^ 1])
    with pytest.raises(MasterKeyError):
        wrapper.unwrap(wrapped, tampered, "org:acme:key:k_1")


def test_sealed_boxes_open_only_for_their_recipient() -> None:
    alice, bob = generate_keypair(), generate_keypair()
    sealed = base64.b64decode(seal(b"hello", alice.public_key))
    assert open_sealed(sealed, alice) == b"hello"
    with pytest.raises(SealingError, match="sealed to another key"):
        open_sealed(sealed, bob)
