"""Request and response bodies of the vault's HTTP API."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlnode.messages import ResourceId
from rlnode.service.auth import Scope

# Field names that would mean a client is sending a secret in the clear.
PLAINTEXT_FIELDS = frozenset(
    {"value", "plaintext", "secret", "secret_value", "api_key", "key", "password"}
)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CreateOrg(Strict):
    org_id: ResourceId
    name: str | None = Field(None, max_length=200)


class PublicKeyOut(BaseModel):
    org_id: str
    key_id: str
    public_key: str = Field(description="X25519 public key, base64")
    alg: Literal["libsodium.sealedbox.v1"] = "libsodium.sealedbox.v1"
    created_at: datetime


class TokenOut(BaseModel):
    token: str = Field(description="Shown once; the vault keeps only its id.")
    token_id: str
    kind: Literal["org", "service", "job"]
    subject: str
    org_id: str | None
    scopes: list[str]
    expires_at: datetime


class OrgOut(BaseModel):
    org_id: str
    name: str
    created_at: datetime


class CreatedOrg(OrgOut):
    public_key: PublicKeyOut
    token: TokenOut


class CreateOrgToken(Strict):
    name: str = Field(min_length=1, max_length=200)
    scopes: list[Scope] | None = Field(None, description="Default: every org scope.")
    ttl_s: int | None = Field(None, ge=60)


class CreateJobToken(Strict):
    job_id: ResourceId = Field(description="The one job the token may start or cancel.")


class CertifyRecordKey(Strict):
    public_key: str = Field(min_length=1, max_length=100, description="Ed25519, base64")


class RecordKeyCertificate(BaseModel):
    certificate: str
    service: str
    expires_at: datetime


class CreateServiceToken(Strict):
    service: str = Field(min_length=1, max_length=200, pattern=r"^[a-z0-9][a-z0-9._/-]*$")
    scopes: list[Scope] = Field(min_length=1)
    org_id: ResourceId | None = Field(None, description="Omit for a node-wide service token.")
    ttl_s: int | None = Field(None, ge=60)


class TokenInfo(BaseModel):
    token_id: str
    kind: str
    subject: str
    org_id: str | None
    scopes: list[str]
    issued_at: datetime
    expires_at: datetime
    revoked_at: datetime | None


class UploadSecret(Strict):
    """A secret sealed on the client to the org's current public key. Plaintext is refused."""

    name: ResourceId
    key_id: str = Field(min_length=1, max_length=64)
    ciphertext_b64: str = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _no_plaintext(cls, data: Any) -> Any:
        if isinstance(data, dict) and PLAINTEXT_FIELDS & {str(k).lower() for k in data}:
            raise ValueError(
                "the vault takes only ciphertext: seal the value with the org's public key "
                "first (`rlnode secrets set` does), and send {name, key_id, ciphertext_b64}; "
                "nothing was stored"
            )
        return data


class SecretInfo(BaseModel):
    org_id: str
    name: str
    key_id: str
    created_at: datetime
    updated_at: datetime


class UnsealFor(Strict):
    recipient_public_key: str = Field(min_length=1, max_length=200, description="X25519, base64")
    job_id: ResourceId | None = None


class Unsealed(BaseModel):
    name: str
    key_id: str = Field(description="The org key the secret was stored under.")
    alg: Literal["libsodium.sealedbox.v1"] = "libsodium.sealedbox.v1"
    sealed_b64: str = Field(description="The secret sealed to the recipient's public key.")
    recipient_fingerprint: str


class RotatedKey(PublicKeyOut):
    resealed: int


class AuditOut(BaseModel):
    id: int
    ts: datetime
    org_id: str | None
    actor: str
    token_id: str | None
    action: str
    secret_name: str | None
    key_id: str | None
    job_id: str | None
    detail: str


class VerifyKeyOut(BaseModel):
    key_id: str
    alg: Literal["ed25519"] = "ed25519"
    public_key: str


class RevocationsOut(BaseModel):
    token_ids: list[str]


class ErrorOut(BaseModel):
    detail: str
