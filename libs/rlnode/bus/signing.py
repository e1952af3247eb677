"""Records carry their producer's signature (docs/security.md).

Each service holds an Ed25519 key of its own, made at start-up, and a certificate for it
from the vault (`POST /v1/record-keys` with the service's token): the vault's signature
over the service's name, the key, the id of the service token that asked (revoking that
token revokes the certificate) and an expiry. Every record the service publishes carries

- ``rlnode-cert``: the certificate, ``rlc1.<payload>.<signature>`` (base64url JSON
  ``{"svc", "pub", "tid", "iat", "exp", "kid"}``; not a token: no route takes it);
- ``rlnode-sig``: the service's signature over BLAKE3(topic, key, value).

A consumer checks the certificate with the vault's verify key (which every service holds
already for tokens), the signature with the certified key, and then, once the record is
decoded, that this service may produce this record on this topic (`topics.may_produce`).
Users' job requests are not signed: they carry a job token instead.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import blake3
import orjson
from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey

from rlnode.service.auth import (
    LEEWAY_S,
    AuthError,
    VaultTokenVerifier,
    envelope_parts,
    open_envelope,
    sign_envelope,
)

if TYPE_CHECKING:
    from aiokafka.structs import ConsumerRecord

log = logging.getLogger("rlnode.bus.signing")

CERT_PREFIX = "rlc1"
CERT_HEADER = "rlnode-cert"
SIG_HEADER = "rlnode-sig"
MAX_CERTIFICATES = 1024  # verified certificates kept (one per producing process)


class RecordRefused(Exception):
    """The record's producer could not be established, or may not produce it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def record_digest(topic: str, key: bytes | None, value: bytes) -> bytes:
    hasher = blake3.blake3(topic.encode())
    hasher.update(b"\0" + (key or b"") + b"\0")
    hasher.update(value)
    return hasher.digest()


@dataclass(frozen=True)
class Certificate:
    service: str
    public_key: VerifyKey
    token_id: str  # the service token that asked for it
    expires_at: int


def issue_certificate(
    vault_key: SigningKey,
    key_id: str,
    service: str,
    public_key: bytes,
    token_id: str,
    expires_at: int,
) -> str:
    """The vault's side: certify `public_key` as `service`'s record key."""
    fields = {
        "svc": service,
        "pub": base64.b64encode(public_key).decode(),
        "tid": token_id,
        "iat": int(time.time()),
        "exp": expires_at,
        "kid": key_id,
    }
    return sign_envelope(vault_key, CERT_PREFIX, fields)


def read_certificate(text: str, vault_key: VerifyKey) -> Certificate:
    parts = envelope_parts(text, CERT_PREFIX)
    if parts is None:
        raise RecordRefused("the producer's certificate is malformed")
    try:
        data = open_envelope(parts, vault_key)
        return Certificate(
            service=str(data["svc"]),
            public_key=VerifyKey(base64.b64decode(str(data["pub"]), validate=True)),
            token_id=str(data["tid"]),
            expires_at=int(data["exp"]),
        )
    except (BadSignatureError, ValueError, KeyError, TypeError, orjson.JSONDecodeError):
        raise RecordRefused("the producer's certificate is not the vault's") from None


class RecordSigner:
    """This process's record key and its certificate from the vault."""

    def __init__(self, vault_url: str, service_token: str) -> None:
        self.vault_url = vault_url
        self._service_token = service_token
        self._key = SigningKey.generate()
        self._certificate: bytes | None = None

    async def start(self) -> None:
        """Have the key certified (once per process)."""
        if self._certificate is None:
            answer = await asyncio.to_thread(self._certify)
            self._certificate = answer["certificate"].encode()

    def _certify(self) -> dict:
        from rlnode.sdk.vault import VaultClient

        with VaultClient(self.vault_url, self._service_token) as vault:
            return vault.certify_record_key(bytes(self._key.verify_key))

    def headers(self, topic: str, key: bytes | None, value: bytes) -> list[tuple[str, bytes]]:
        if self._certificate is None:
            raise RuntimeError("start the signer (have its key certified) before publishing")
        signature = self._key.sign(record_digest(topic, key, value)).signature
        return [(CERT_HEADER, self._certificate), (SIG_HEADER, signature)]


class RecordVerifier:
    """Who produced a record: checked against the vault's key and its revocation list (both
    from a `VaultTokenVerifier`, refreshed off the event loop)."""

    def __init__(self, tokens: VaultTokenVerifier) -> None:
        self.tokens = tokens
        self._certificates: dict[bytes, Certificate] = {}

    async def producer(self, record: ConsumerRecord) -> str:
        """The name of the service that signed `record`; RecordRefused if none did. While the
        vault cannot be reached for its key or revocations, waits (the record is not at
        fault, and is neither taken nor refused meanwhile)."""
        delay = 0.5
        while self.tokens.needs_refresh():
            try:
                await asyncio.to_thread(self.tokens.refresh)
            except AuthError as e:
                log.error(
                    "cannot check record signatures (%s); retrying in %.1fs", e.message, delay
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
        return self.producer_now(record)

    def producer_now(self, record: ConsumerRecord) -> str:
        headers = dict(record.headers or ())
        certificate_bytes, signature = headers.get(CERT_HEADER), headers.get(SIG_HEADER)
        if certificate_bytes is None or signature is None:
            raise RecordRefused(
                "unsigned: records on this topic must be signed by the rlnode service that "
                "produces them"
            )
        certificate = self._certificates.get(certificate_bytes)
        if certificate is None:
            assert self.tokens.verify_key is not None
            certificate = read_certificate(
                certificate_bytes.decode(errors="replace"), self.tokens.verify_key
            )
            if len(self._certificates) >= MAX_CERTIFICATES:
                self._certificates.clear()
            self._certificates[certificate_bytes] = certificate
        if certificate.expires_at + LEEWAY_S < time.time():
            raise RecordRefused(f"the certificate of {certificate.service!r} has expired")
        if self.tokens.is_revoked(certificate.token_id):
            raise RecordRefused(f"the certificate of {certificate.service!r} was revoked")
        value = record.value or b""
        try:
            certificate.public_key.verify(record_digest(record.topic, record.key, value), signature)
        except BadSignatureError:
            raise RecordRefused(
                f"the signature does not match the record: not produced by {certificate.service!r} as it is"
            ) from None
        return certificate.service


def signing_for(settings: Any) -> dict[str, Any]:
    """The signer and verifier of a service's bus, from its settings (`vault_url`,
    `service_token`): `Bus(kafka, service=..., **signing_for(settings))`. Without a token the
    service publishes unsigned records, which consumers refuse: it says so once."""
    token = settings.service_token.get_secret_value() if settings.service_token else None
    if token is None:
        log.warning(
            "no service token: the records this service publishes are unsigned, and every "
            "consumer will refuse them (set its SERVICE_TOKEN; rlnode up does)"
        )
    return {
        "signer": RecordSigner(settings.vault_url, token) if token else None,
        "verifier": RecordVerifier(VaultTokenVerifier(settings.vault_url)),
    }
