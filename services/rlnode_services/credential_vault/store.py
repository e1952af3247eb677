"""The vault's tables. Nothing here ever holds a plaintext secret or a usable private key:
secrets are sealed boxes, private keys are wrapped under the master key."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Column, Index, LargeBinary, UniqueConstraint
from sqlmodel import Field, SQLModel

from rlnode.messages import utc_now
from rlnode.service.db import UTCDateTime


class VaultMeta(SQLModel, table=True):
    """Vault-wide values: the master-key check and the wrapped token-signing key."""

    __tablename__ = "vault_meta"
    name: str = Field(primary_key=True, max_length=64)
    value: bytes = Field(sa_column=Column(LargeBinary, nullable=False))


class Org(SQLModel, table=True):
    __tablename__ = "vault_orgs"
    org_id: str = Field(primary_key=True, max_length=128)
    name: str = Field(max_length=200)
    created_at: datetime = Field(
        default_factory=utc_now, sa_column=Column(UTCDateTime(), nullable=False)
    )


class OrgKey(SQLModel, table=True):
    """An org's X25519 key pair. The current one has no `retired_at`; a retired one has its
    private key destroyed once every secret was re-sealed to its successor."""

    __tablename__ = "vault_org_keys"
    key_id: str = Field(primary_key=True, max_length=64)
    org_id: str = Field(foreign_key="vault_orgs.org_id", index=True, max_length=128)
    public_key: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    wrapped_data_key: bytes | None = Field(
        default=None, sa_column=Column(LargeBinary, nullable=True)
    )
    encrypted_private_key: bytes | None = Field(
        default=None, sa_column=Column(LargeBinary, nullable=True)
    )
    created_at: datetime = Field(
        default_factory=utc_now, sa_column=Column(UTCDateTime(), nullable=False)
    )
    retired_at: datetime | None = Field(
        default=None, sa_column=Column(UTCDateTime(), nullable=True)
    )


class Secret(SQLModel, table=True):
    __tablename__ = "vault_secrets"
    __table_args__ = (UniqueConstraint("org_id", "name"),)
    id: int | None = Field(default=None, primary_key=True)
    org_id: str = Field(foreign_key="vault_orgs.org_id", max_length=128)
    name: str = Field(max_length=128)
    key_id: str = Field(foreign_key="vault_org_keys.key_id", max_length=64)
    ciphertext: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    created_at: datetime = Field(
        default_factory=utc_now, sa_column=Column(UTCDateTime(), nullable=False)
    )
    updated_at: datetime = Field(
        default_factory=utc_now, sa_column=Column(UTCDateTime(), nullable=False)
    )


class IssuedToken(SQLModel, table=True):
    """What was issued, for listing and revocation. The token itself is not kept: it is
    shown once, and verified by its signature."""

    __tablename__ = "vault_tokens"
    token_id: str = Field(primary_key=True, max_length=64)
    kind: str = Field(max_length=16)
    subject: str = Field(max_length=200)
    org_id: str | None = Field(default=None, index=True, max_length=128)
    scopes: str = Field(max_length=1000, description="space-separated")
    issued_at: datetime = Field(sa_column=Column(UTCDateTime(), nullable=False))
    expires_at: datetime = Field(sa_column=Column(UTCDateTime(), nullable=False))
    revoked_at: datetime | None = Field(
        default=None, sa_column=Column(UTCDateTime(), nullable=True)
    )


class AuditRecord(SQLModel, table=True):
    """Who did what to which secret or key, for which job. Never a value."""

    __tablename__ = "vault_audit"
    __table_args__ = (Index("ix_vault_audit_org_ts", "org_id", "id"),)
    id: int | None = Field(default=None, primary_key=True)
    ts: datetime = Field(default_factory=utc_now, sa_column=Column(UTCDateTime(), nullable=False))
    org_id: str | None = Field(default=None, max_length=128)
    actor: str = Field(max_length=250)
    token_id: str | None = Field(default=None, max_length=64)
    action: str = Field(max_length=64)
    secret_name: str | None = Field(default=None, max_length=128)
    key_id: str | None = Field(default=None, max_length=64)
    job_id: str | None = Field(default=None, max_length=128)
    detail: str = Field(default="", max_length=2000)


TABLES = (VaultMeta, Org, OrgKey, Secret, IssuedToken, AuditRecord)
