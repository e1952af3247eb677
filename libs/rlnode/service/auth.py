"""Tokens issued by the credential vault, and their local verification.

Every service checks tokens itself with the vault's Ed25519 verify key (fetched once from
`GET /v1/verify-key`); only revocations need the vault, and they are cached.

Wire format: ``rln1.<payload>.<signature>``, both parts base64url without padding; the
signature is Ed25519 over ``rln1.<payload>``; the payload is JSON:
``{"jti", "kind": "org"|"service"|"job", "sub", "org", "scopes", "iat", "exp", "kid"}``, and
``"job"`` (the job id) for a job token: short-lived, single-use, for that one job's request
on Kafka, so that no org token ever travels there.
"""

from __future__ import annotations

import base64
import hashlib
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson
from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey

TOKEN_PREFIX = "rln1"
# How far past its expiry a token is still accepted (clock skew between machines). The vault
# lists a revoked token until well after this, so revocation never lapses inside it.
LEEWAY_S = 30


class Scope(StrEnum):
    ORG_ADMIN = (
        "org:admin"  # issue and revoke the org's tokens, rotate its key, read its audit trail
    )
    SECRETS_WRITE = "secrets:write"  # upload and delete sealed secrets
    SECRETS_READ = "secrets:read"  # list secrets (names and times, never values)
    SECRETS_UNSEAL = "secrets:unseal"  # services only: have a secret re-sealed to them
    JOBS_WRITE = "jobs:write"  # start and cancel jobs
    JOBS_READ = "jobs:read"  # watch jobs, list checkpoints
    INFERENCE = "inference"  # call a checkpoint
    TINKER = "tinker"  # train and sample through the Tinker API (`rlnode tinker key`)
    TASKAPPS_WRITE = "taskapps:write"  # register and unregister Task Apps
    TASKAPPS_READ = "taskapps:read"  # list and verify Task Apps
    ROLLOUTS_RUN = "rollouts:run"  # services only: run rollouts through the gateway
    NODE_OPS = "node:ops"  # operators' service tokens: every org's jobs and each service's state
    RECORDS_SIGN = "records:sign"  # services only: certify a key that signs what they publish
    WEIGHTS_READ = "weights:read"  # services only: download weight versions from the learner


ORG_SCOPES = frozenset(
    {
        Scope.ORG_ADMIN,
        Scope.SECRETS_WRITE,
        Scope.SECRETS_READ,
        Scope.JOBS_WRITE,
        Scope.JOBS_READ,
        Scope.INFERENCE,
        Scope.TINKER,
        Scope.TASKAPPS_WRITE,
        Scope.TASKAPPS_READ,
    }
)
SERVICE_SCOPES = frozenset(Scope) - {Scope.ORG_ADMIN}
JOB_SCOPES = frozenset({Scope.JOBS_WRITE})
TOKEN_KINDS = ("org", "service", "job")
# A Tinker API key is an org token with this prefix: the tinker SDK refuses keys without it.
TINKER_KEY_PREFIX = "tml-"
# Anything that looks like an rlnode token, wherever it sits in a text (see `redact_tokens`).
TOKEN_PATTERN = re.compile(r"rln1\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+")
TOKEN_PATTERN_BYTES = re.compile(TOKEN_PATTERN.pattern.encode())
REDACTED_TOKEN = "rln1.[REDACTED]"


class AuthError(Exception):
    """`status` is 401 (no valid token) or 403 (valid, but not allowed this)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class TokenClaims:
    token_id: str
    kind: str  # "org" | "service" | "job"
    subject: str  # token name (org tokens), service name, or job id (job tokens)
    org_id: str | None  # None: a node-wide service token
    scopes: frozenset[str]
    issued_at: int
    expires_at: int
    key_id: str
    job_id: str | None = None  # job tokens: the one job they may start or cancel

    @property
    def node_wide_service(self) -> bool:
        """A service token of no one org."""
        return self.kind == "service" and self.org_id is None

    def allows_org(self, org_id: str) -> bool:
        return self.node_wide_service or self.org_id == org_id

    @property
    def actor(self) -> str:
        """Who acted, for audit records."""
        return f"{self.kind}:{self.subject}"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def sign_envelope(signing_key: SigningKey, prefix: str, fields: dict) -> str:
    """``<prefix>.<payload>.<signature>``: `fields` as base64url JSON, signed with Ed25519
    over ``<prefix>.<payload>``. The shape of tokens and of record-key certificates."""
    signed_part = f"{prefix}.{_b64(orjson.dumps(fields))}"
    return f"{signed_part}.{_b64(signing_key.sign(signed_part.encode()).signature)}"


def envelope_parts(text: str, prefix: str) -> list[str] | None:
    """The three parts of an envelope with this prefix, or None if `text` is not one."""
    parts = text.split(".")
    return parts if len(parts) == 3 and parts[0] == prefix else None


def open_envelope(parts: list[str], verify_key: VerifyKey) -> Any:
    """The signed payload; BadSignatureError, ValueError or JSONDecodeError if it is not."""
    verify_key.verify(f"{parts[0]}.{parts[1]}".encode(), _unb64(parts[2]))
    return orjson.loads(_unb64(parts[1]))


def sign_token(signing_key: SigningKey, claims: TokenClaims) -> str:
    fields = {
        "jti": claims.token_id,
        "kind": claims.kind,
        "sub": claims.subject,
        "org": claims.org_id,
        "scopes": sorted(claims.scopes),
        "iat": claims.issued_at,
        "exp": claims.expires_at,
        "kid": claims.key_id,
    }
    if claims.job_id is not None:
        fields["job"] = claims.job_id
    return sign_envelope(signing_key, TOKEN_PREFIX, fields)


def read_unverified(token: str) -> dict:
    """The payload without checking the signature: for clients that want to know which org
    their own token is for. Never use it to make an access decision."""
    try:
        prefix, payload, _ = token.split(".")
        if prefix != TOKEN_PREFIX:
            raise ValueError
        return orjson.loads(_unb64(payload))
    except (ValueError, orjson.JSONDecodeError):
        raise AuthError(401, "not an rlnode token (expected rln1.<payload>.<signature>)") from None


def verify_key_id(verify_key: VerifyKey) -> str:
    """A short stable id of a verify key."""
    return hashlib.sha256(bytes(verify_key)).hexdigest()[:16]


# Tokens whose signature checked out, kept (their expiry and revocation are checked on every
# use); past this many the memory starts over.
OPENED_TOKENS_KEPT = 4096


class TokenVerifier:
    """Checks a token's signature, expiry and revocation locally."""

    def __init__(
        self,
        verify_key: VerifyKey,
        is_revoked: Callable[[str], bool] = lambda _jti: False,
        leeway_s: int = LEEWAY_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.verify_key = verify_key
        self.key_id = verify_key_id(verify_key)
        self.is_revoked = is_revoked
        self.leeway_s = leeway_s
        self.clock = clock
        self._opened: dict[str, TokenClaims] = {}

    def verify(self, token: str | None) -> TokenClaims:
        if not token:
            raise AuthError(401, "no token: send 'Authorization: Bearer <rlnode token>'")
        claims = self._opened.get(token)
        if claims is None:
            claims = self._open(token)
            if len(self._opened) >= OPENED_TOKENS_KEPT:
                self._opened.clear()
            self._opened[token] = claims
        if claims.kind not in TOKEN_KINDS:
            raise AuthError(401, "invalid token: unknown kind")
        now = self.clock()
        if claims.expires_at + self.leeway_s < now:
            raise AuthError(
                401, "token expired: ask your org admin for a new one (rlnode token create)"
            )
        if claims.issued_at - self.leeway_s > now:
            raise AuthError(401, "token not valid yet: is this machine's clock right?")
        if self.is_revoked(claims.token_id):
            raise AuthError(401, "token revoked")
        return claims

    def needs_refresh(self) -> bool:
        """Whether `refresh` has blocking work to do first (here: never)."""
        return False

    def refresh(self) -> None:
        """Fetch what verifying needs (here: nothing; the vault's verifier fetches)."""

    def _open(self, token: str) -> TokenClaims:
        """The claims a token's signature vouches for (its signature checked once per
        token: a service's own token comes with every call it makes)."""
        parts = envelope_parts(token, TOKEN_PREFIX)
        if parts is None:
            raise AuthError(401, "not an rlnode token (expected rln1.<payload>.<signature>)")
        try:
            data = open_envelope(parts, self.verify_key)
            claims = TokenClaims(
                token_id=str(data["jti"]),
                kind=str(data["kind"]),
                subject=str(data["sub"]),
                org_id=data["org"],
                scopes=frozenset(data["scopes"]),
                issued_at=int(data["iat"]),
                expires_at=int(data["exp"]),
                key_id=str(data["kid"]),
                job_id=str(data["job"]) if data.get("job") is not None else None,
            )
        except (BadSignatureError, ValueError, KeyError, TypeError, orjson.JSONDecodeError):
            raise AuthError(401, "invalid token: its signature does not check out") from None
        return claims

    def authorize(
        self, token: str | None, *, scopes: Iterable[str] = (), org_id: str | None = None
    ) -> TokenClaims:
        """Verify, then require every scope and (when given) access to `org_id`."""
        return self.authorize_claims(self.verify(token), scopes=scopes, org_id=org_id)

    @staticmethod
    def authorize_claims(
        claims: TokenClaims, *, scopes: Iterable[str] = (), org_id: str | None = None
    ) -> TokenClaims:
        # The org first: a stranger learns nothing about which scopes the route needs.
        if org_id is not None and not claims.allows_org(org_id):
            raise AuthError(
                403,
                f"this token belongs to org {claims.org_id!r} and cannot act on org {org_id!r}",
            )
        missing = sorted(set(scopes) - claims.scopes)
        if missing:
            raise AuthError(403, f"this token lacks the scope(s) {', '.join(missing)}")
        return claims


def require_operator(claims: TokenClaims) -> TokenClaims:
    """A node-wide service token with node:ops: what the ops routes, which show every org's
    work, admit."""
    if not claims.node_wide_service or Scope.NODE_OPS not in claims.scopes:
        raise AuthError(
            403, "this route is for the node's operators: use a service token with node:ops"
        )
    return claims


def redact_tokens(text: str) -> str:
    """`text` with every rlnode token in it blanked out."""
    return TOKEN_PATTERN.sub(REDACTED_TOKEN, text)


def redact_token_bytes(data: bytes) -> bytes:
    return TOKEN_PATTERN_BYTES.sub(REDACTED_TOKEN.encode(), data)


def bearer_token(authorization: str | None) -> str | None:
    """The token from an `Authorization: Bearer …` header value."""
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


class VaultTokenVerifier(TokenVerifier):
    """A verifier for services other than the vault: the verify key (fetched on first use,
    so a service may start before the vault) and the revocation list (refreshed every
    `refresh_s` seconds) come from the vault over HTTP. While the vault cannot be reached
    for them, verification fails with 503, never open."""

    def __init__(self, vault_url: str, refresh_s: float = 30.0, timeout_s: float = 5.0) -> None:
        import httpx

        from rlnode.service.pooled_http import IDLE_CONNECTION_S

        self.vault_url = vault_url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.vault_url,
            timeout=timeout_s,
            limits=httpx.Limits(keepalive_expiry=IDLE_CONNECTION_S),
        )
        self._revoked: frozenset[str] = frozenset()
        self._fetched_at = float("-inf")
        self._refresh_s = refresh_s
        self._lock = threading.Lock()
        self.verify_key: VerifyKey | None = None  # type: ignore[assignment]
        self.key_id = ""
        self.is_revoked = self._check_revoked
        self.leeway_s = LEEWAY_S
        self.clock = time.time
        self._opened = {}

    def _get(self, path: str) -> dict:
        import httpx

        try:
            response = self._http.get(path)
            response.raise_for_status()
            return response.json()
        except (httpx.HTTPError, ValueError) as e:
            raise AuthError(
                503, f"cannot check tokens: the vault at {self.vault_url} did not answer ({e})"
            ) from None

    def verify(self, token: str | None) -> TokenClaims:
        self._ensure_key()
        return super().verify(token)

    def _ensure_key(self) -> None:
        if self.verify_key is None:
            with self._lock:
                if self.verify_key is None:
                    key = VerifyKey(base64.b64decode(self._get("/v1/verify-key")["public_key"]))
                    self.key_id = verify_key_id(key)
                    self.verify_key = key

    def needs_refresh(self) -> bool:
        """Whether `refresh` has HTTP to do (callers on an event loop run it in a thread)."""
        stale = time.monotonic() - self._fetched_at > self._refresh_s
        return self.verify_key is None or stale

    def refresh(self) -> None:
        """The verify key (once) and the revocation list (when stale), from the vault."""
        self._ensure_key()
        self._check_revoked("")

    def _check_revoked(self, token_id: str) -> bool:
        with self._lock:
            if time.monotonic() - self._fetched_at > self._refresh_s:
                self._revoked = frozenset(self._get("/v1/revocations")["token_ids"])
                self._fetched_at = time.monotonic()
            return token_id in self._revoked
