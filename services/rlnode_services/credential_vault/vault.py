"""The vault's logic, apart from HTTP: orgs, tokens, org keys, sealed secrets, unsealing for
services, and the audit trail. Plaintext secrets exist here only inside `put_secret` (to
check that the upload opens) and `unseal_for` (to re-seal it), and only in memory."""

from __future__ import annotations

import secrets as pyrandom
import threading
import time
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from nacl.public import PrivateKey, PublicKey
from nacl.signing import SigningKey
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from rlnode.messages import utc_now
from rlnode.service.auth import (
    JOB_SCOPES,
    LEEWAY_S,
    ORG_SCOPES,
    SERVICE_SCOPES,
    TokenClaims,
    TokenVerifier,
    sign_token,
    verify_key_id,
)
from rlnode.service.db import create_tables, session_scope
from rlnode.service.sealing import (
    SEAL_OVERHEAD,
    SEALED_BOX_ALG,
    SealingError,
    b64decode_strict,
    fingerprint,
    open_sealed,
    public_key_from_b64,
    seal,
)
from rlnode_services.credential_vault.crypto import KeyWrapper, MasterKeyError
from rlnode_services.credential_vault.settings import VaultSettings
from rlnode_services.credential_vault.store import (
    TABLES,
    AuditRecord,
    IssuedToken,
    Org,
    OrgKey,
    Secret,
    VaultMeta,
)

ADMIN_ACTOR = "admin"
# Verifiers refresh their copy of the revocation list this often at most (VaultTokenVerifier).
REVOCATION_MARGIN_S = 120


class VaultError(Exception):
    status = 400

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotFound(VaultError):
    status = 404


class Conflict(VaultError):
    status = 409


class TooLarge(VaultError):
    status = 413


class BadInput(VaultError):
    status = 400


@dataclass(frozen=True)
class Actor:
    """Who is calling: the bootstrap admin, or the holder of a verified token."""

    name: str
    token_id: str | None = None

    @classmethod
    def of(cls, claims: TokenClaims | None) -> Actor:
        return cls(ADMIN_ACTOR) if claims is None else cls(claims.actor, claims.token_id)


@dataclass(frozen=True)
class IssuedTokenResult:
    token: str
    record: IssuedToken


class Vault:
    def __init__(self, engine: Engine, wrapper: KeyWrapper, settings: VaultSettings) -> None:
        self.engine = engine
        self.wrapper = wrapper
        self.settings = settings
        # Serialises key rotation against uploads within this process; on PostgreSQL the org
        # row is also locked, for several vault replicas.
        self._write_lock = threading.Lock()
        self.signing_key: SigningKey
        self.verifier: TokenVerifier

    # -- start-up ----------------------------------------------------------------------

    def initialise(self) -> None:
        """Create tables, check the master key, load (or create) the token-signing key.
        Raises MasterKeyError when the master key is not this vault's."""
        create_tables(self.engine, *TABLES)
        with session_scope(self.engine) as s:
            check = s.get(VaultMeta, "master_key_check")
            if check is None:
                s.add(VaultMeta(name="master_key_check", value=self.wrapper.check_value()))
                s.add(VaultMeta(name="master_key_id", value=self.wrapper.master_key_id.encode()))
            else:
                self.wrapper.verify_check_value(check.value)
            wrapped = s.get(VaultMeta, "signing_key_wrapped")
            if wrapped is None:
                self.signing_key = SigningKey.generate()
                data_key, ciphertext = self.wrapper.wrap(
                    bytes(self.signing_key), "vault:signing-key"
                )
                s.add(VaultMeta(name="signing_key_wrapped", value=data_key))
                s.add(VaultMeta(name="signing_key_ciphertext", value=ciphertext))
            else:
                ciphertext_row = s.get(VaultMeta, "signing_key_ciphertext")
                if ciphertext_row is None:
                    raise MasterKeyError("the vault's signing key is incomplete in the database")
                self.signing_key = SigningKey(
                    self.wrapper.unwrap(wrapped.value, ciphertext_row.value, "vault:signing-key")
                )
        self.verifier = TokenVerifier(self.signing_key.verify_key, is_revoked=self.is_revoked)

    @property
    def verify_key_id(self) -> str:
        return verify_key_id(self.signing_key.verify_key)

    # -- orgs and their keys -----------------------------------------------------------

    def create_org(self, org_id: str, name: str | None) -> tuple[Org, OrgKey, IssuedTokenResult]:
        with self._write_lock, session_scope(self.engine) as s:
            if s.get(Org, org_id) is not None:
                raise Conflict(f"org {org_id!r} exists already")
            org = Org(org_id=org_id, name=name or org_id)
            s.add(org)
            s.flush()
            key = self._new_org_key(s, org_id)
            self._audit(s, org_id, Actor(ADMIN_ACTOR), "org.create", key_id=key.key_id)
        token = self.issue_token(
            "org", "initial-admin", org_id, ORG_SCOPES, None, Actor(ADMIN_ACTOR)
        )
        return org, key, token

    def get_org(self, org_id: str) -> Org:
        with Session(self.engine) as s:
            org = s.get(Org, org_id)
            if org is None:
                raise NotFound(f"no org {org_id!r}")
            return org

    def current_key(self, org_id: str) -> OrgKey:
        with Session(self.engine) as s:
            return self._current_key(s, org_id)

    def rotate_key(self, org_id: str, actor: Actor) -> tuple[OrgKey, int]:
        """A new key pair; every secret re-sealed to it; the old private key destroyed."""
        with self._write_lock, session_scope(self.engine) as s:
            self._lock_org(s, org_id)
            old = self._current_key(s, org_id)
            old_private = self._private_key(old)
            new = self._new_org_key(s, org_id)
            resealed = 0
            for secret in s.exec(select(Secret).where(Secret.org_id == org_id)):
                value = open_sealed(
                    secret.ciphertext, self._private_key_for(s, secret.key_id, old, old_private)
                )
                secret.ciphertext = b64decode_strict(
                    seal(value, PublicKey(new.public_key)), "sealed"
                )
                secret.key_id = new.key_id
                secret.updated_at = utc_now()
                s.add(secret)
                resealed += 1
                del value
            old.retired_at = utc_now()
            old.wrapped_data_key = None
            old.encrypted_private_key = None
            s.add(old)
            self._audit(
                s,
                org_id,
                actor,
                "key.rotate",
                key_id=new.key_id,
                detail=f"replaced {old.key_id}; re-sealed {resealed} secret(s)",
            )
        return new, resealed

    def _new_org_key(self, s: Session, org_id: str) -> OrgKey:
        private = PrivateKey.generate()
        key_id = f"k_{pyrandom.token_hex(8)}"
        data_key, ciphertext = self.wrapper.wrap(bytes(private), self._purpose(org_id, key_id))
        key = OrgKey(
            key_id=key_id,
            org_id=org_id,
            public_key=bytes(private.public_key),
            wrapped_data_key=data_key,
            encrypted_private_key=ciphertext,
        )
        s.add(key)
        s.flush()
        return key

    @staticmethod
    def _purpose(org_id: str, key_id: str) -> str:
        # Binds the ciphertext to its row: a wrapped key copied to another org does not open.
        return f"org:{org_id}:key:{key_id}"

    def _private_key(self, key: OrgKey) -> PrivateKey:
        if key.wrapped_data_key is None or key.encrypted_private_key is None:
            raise Conflict(f"key {key.key_id} was retired and its private key destroyed")
        raw = self.wrapper.unwrap(
            key.wrapped_data_key, key.encrypted_private_key, self._purpose(key.org_id, key.key_id)
        )
        return PrivateKey(raw)

    def _private_key_for(
        self, s: Session, key_id: str, current: OrgKey, current_private: PrivateKey
    ) -> PrivateKey:
        if key_id == current.key_id:
            return current_private
        key = s.get(OrgKey, key_id)
        if key is None:
            raise NotFound(f"no key {key_id!r}")
        return self._private_key(key)

    def _current_key(self, s: Session, org_id: str) -> OrgKey:
        if s.get(Org, org_id) is None:
            raise NotFound(f"no org {org_id!r}")
        key = s.exec(
            select(OrgKey).where(OrgKey.org_id == org_id, col(OrgKey.retired_at).is_(None))
        ).first()
        if key is None:
            raise NotFound(f"org {org_id!r} has no current key")
        return key

    def _lock_org(self, s: Session, org_id: str) -> None:
        org = s.exec(select(Org).where(Org.org_id == org_id).with_for_update()).first()
        if org is None:
            raise NotFound(f"no org {org_id!r}")

    # -- tokens ------------------------------------------------------------------------

    def issue_token(
        self,
        kind: str,
        subject: str,
        org_id: str | None,
        scopes: AbstractSet[str],
        ttl_s: int | None,
        actor: Actor,
        job_id: str | None = None,
    ) -> IssuedTokenResult:
        allowed = {"org": ORG_SCOPES, "service": SERVICE_SCOPES, "job": JOB_SCOPES}[kind]
        unknown = sorted(set(scopes) - allowed)
        if unknown:
            raise BadInput(
                f"{kind} tokens cannot carry {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}"
            )
        if not scopes:
            raise BadInput("a token needs at least one scope")
        default_ttl = {
            "org": self.settings.org_token_ttl_s,
            "service": self.settings.service_token_ttl_s,
            "job": self.settings.job_token_ttl_s,
        }[kind]
        ttl = ttl_s or default_ttl
        if ttl > self.settings.max_token_ttl_s:
            raise BadInput(
                f"ttl_s {ttl} is longer than the maximum {self.settings.max_token_ttl_s}"
            )
        if org_id is not None:
            self.get_org(org_id)
        now = int(time.time())
        claims = TokenClaims(
            token_id=f"t_{pyrandom.token_hex(12)}",
            kind=kind,
            subject=subject,
            org_id=org_id,
            scopes=frozenset(scopes),
            issued_at=now,
            expires_at=now + ttl,
            key_id=self.verify_key_id,
            job_id=job_id,
        )
        token = sign_token(self.signing_key, claims)
        record = IssuedToken(
            token_id=claims.token_id,
            kind=kind,
            subject=subject,
            org_id=org_id,
            scopes=" ".join(sorted(claims.scopes)),
            issued_at=datetime.fromtimestamp(now, UTC),
            expires_at=datetime.fromtimestamp(claims.expires_at, UTC),
        )
        with session_scope(self.engine) as s:
            s.add(record)
            self._audit(
                s,
                org_id,
                actor,
                "token.issue",
                detail=f"{kind} token {claims.token_id} for {subject!r}",
            )
        return IssuedTokenResult(token, record)

    def list_tokens(self, org_id: str) -> list[IssuedToken]:
        with Session(self.engine) as s:
            return list(
                s.exec(
                    select(IssuedToken)
                    .where(IssuedToken.org_id == org_id)
                    .order_by(col(IssuedToken.issued_at))
                )
            )

    def revoke_token(self, token_id: str, org_id: str | None, actor: Actor) -> None:
        """Revoke one of `org_id`'s tokens (or a service token when `org_id` is None)."""
        with session_scope(self.engine) as s:
            record = s.get(IssuedToken, token_id)
            if record is None or not (
                record.org_id == org_id if org_id is not None else record.kind == "service"
            ):
                raise NotFound(f"no token {token_id!r} here")
            if record.revoked_at is None:
                record.revoked_at = utc_now()
                s.add(record)
                self._audit(s, record.org_id, actor, "token.revoke", detail=f"token {token_id}")

    def is_revoked(self, token_id: str) -> bool:
        with Session(self.engine) as s:
            record = s.get(IssuedToken, token_id)
            # A token the vault has no record of was not issued by this vault's database.
            return record is None or record.revoked_at is not None

    def revoked_token_ids(self) -> list[str]:
        # Listed until verifiers would refuse the token for its expiry anyway: past its
        # expiry plus their leeway (and a margin for their cached copy of this list).
        still_accepted_after = utc_now() - timedelta(seconds=LEEWAY_S + REVOCATION_MARGIN_S)
        with Session(self.engine) as s:
            rows = s.exec(
                select(IssuedToken.token_id).where(
                    col(IssuedToken.revoked_at).is_not(None),
                    col(IssuedToken.expires_at) > still_accepted_after,
                )
            )
            return sorted(rows)

    # -- secrets -----------------------------------------------------------------------

    def put_secret(
        self, org_id: str, name: str, key_id: str, ciphertext_b64: str, actor: Actor
    ) -> tuple[Secret, bool]:
        limit = self.settings.max_secret_bytes + SEAL_OVERHEAD
        # Checked on the text first, so an oversized upload is refused before it is decoded.
        if len(ciphertext_b64) > (limit + 2) // 3 * 4:
            raise TooLarge(
                f"a secret may be at most {self.settings.max_secret_bytes} bytes before sealing"
            )
        try:
            ciphertext = b64decode_strict(ciphertext_b64, "ciphertext_b64")
        except SealingError as e:
            raise BadInput(str(e)) from None
        if len(ciphertext) > limit:
            raise TooLarge(
                f"a secret may be at most {self.settings.max_secret_bytes} bytes before sealing"
            )
        if len(ciphertext) <= SEAL_OVERHEAD:
            raise BadInput("ciphertext_b64 is too short to be a sealed box with a value in it")
        with self._write_lock, session_scope(self.engine) as s:
            self._lock_org(s, org_id)
            current = self._current_key(s, org_id)
            if key_id != current.key_id:
                named = s.get(OrgKey, key_id)
                if named is None or named.org_id != org_id:
                    raise BadInput(
                        f"key_id {key_id!r} is not a key of org {org_id!r}; seal to the current key "
                        f"{current.key_id} (GET /v1/orgs/{org_id}/public-key)"
                    )
                raise Conflict(
                    f"key_id {key_id!r} was rotated out; fetch the current public key "
                    f"({current.key_id}) and seal the value again"
                )
            try:
                value = open_sealed(ciphertext, self._private_key(current))
            except SealingError as e:
                raise BadInput(
                    f"{e}; seal the value to key {current.key_id} of org {org_id!r}"
                ) from None
            size = len(value)
            del value
            if size > self.settings.max_secret_bytes:
                raise TooLarge(f"a secret may be at most {self.settings.max_secret_bytes} bytes")
            existing = s.exec(
                select(Secret).where(Secret.org_id == org_id, Secret.name == name)
            ).first()
            now = utc_now()
            if existing is None:
                secret = Secret(
                    org_id=org_id,
                    name=name,
                    key_id=key_id,
                    ciphertext=ciphertext,
                    created_at=now,
                    updated_at=now,
                )
            else:
                secret = existing
                secret.key_id, secret.ciphertext, secret.updated_at = key_id, ciphertext, now
            s.add(secret)
            self._audit(
                s,
                org_id,
                actor,
                "secret.put",
                secret_name=name,
                key_id=key_id,
                detail="replaced" if existing else "created",
            )
            s.flush()
            s.refresh(secret)
            return secret, existing is None

    def list_secrets(self, org_id: str) -> list[Secret]:
        self.get_org(org_id)
        with Session(self.engine) as s:
            return list(s.exec(select(Secret).where(Secret.org_id == org_id).order_by(Secret.name)))

    def get_secret(self, org_id: str, name: str) -> Secret:
        with Session(self.engine) as s:
            secret = self._find_secret(s, org_id, name)
            return secret

    def delete_secret(self, org_id: str, name: str, actor: Actor) -> None:
        with self._write_lock, session_scope(self.engine) as s:
            secret = self._find_secret(s, org_id, name)
            s.delete(secret)
            self._audit(s, org_id, actor, "secret.delete", secret_name=name)

    @staticmethod
    def _find_secret(s: Session, org_id: str, name: str) -> Secret:
        secret = s.exec(select(Secret).where(Secret.org_id == org_id, Secret.name == name)).first()
        if secret is None:
            raise NotFound(f"org {org_id!r} has no secret {name!r}")
        return secret

    def unseal_for(
        self, org_id: str, name: str, recipient_b64: str, job_id: str | None, actor: Actor
    ) -> tuple[str, str, str]:
        """The secret re-sealed to `recipient`; returns (sealed_b64, key_id, fingerprint)."""
        try:
            recipient = public_key_from_b64(recipient_b64)
        except SealingError as e:
            raise BadInput(f"recipient_public_key: {e}") from None
        with session_scope(self.engine) as s:
            secret = self._find_secret(s, org_id, name)
            key = s.get(OrgKey, secret.key_id)
            # A secret's key_id is a foreign key, and key rows are never deleted (retiring one
            # keeps its row), so the key a secret was sealed to is always there.
            assert key is not None, f"secret {name!r} names key {secret.key_id!r}, which is gone"
            value = open_sealed(secret.ciphertext, self._private_key(key))
            sealed = seal(value, recipient)
            del value
            print_ = fingerprint(recipient)
            self._audit(
                s,
                org_id,
                actor,
                "secret.unseal",
                secret_name=name,
                key_id=key.key_id,
                job_id=job_id,
                detail=f"re-sealed to recipient {print_}",
            )
        return sealed, key.key_id, print_

    # -- audit -------------------------------------------------------------------------

    def audit_trail(self, org_id: str, limit: int, action: str | None = None) -> list[AuditRecord]:
        self.get_org(org_id)
        with Session(self.engine) as s:
            query = select(AuditRecord).where(AuditRecord.org_id == org_id)
            if action:
                query = query.where(AuditRecord.action == action)
            return list(s.exec(query.order_by(col(AuditRecord.id).desc()).limit(limit)))

    @staticmethod
    def _audit(
        s: Session,
        org_id: str | None,
        actor: Actor,
        action: str,
        *,
        secret_name: str | None = None,
        key_id: str | None = None,
        job_id: str | None = None,
        detail: str = "",
    ) -> None:
        s.add(
            AuditRecord(
                org_id=org_id,
                actor=actor.name,
                token_id=actor.token_id,
                action=action,
                secret_name=secret_name,
                key_id=key_id,
                job_id=job_id,
                detail=detail,
            )
        )


__all__ = [
    "SEALED_BOX_ALG",
    "Actor",
    "BadInput",
    "Conflict",
    "NotFound",
    "TooLarge",
    "Vault",
    "VaultError",
]
