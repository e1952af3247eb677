"""HTTP wiring of the credential-vault: routes, who may call them, and error mapping."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated

from fastapi import Depends, FastAPI, Header, Query, Request, Response
from fastapi.responses import JSONResponse
from nacl.public import PublicKey

from rlnode.bus.signing import issue_certificate
from rlnode.service.app import create_service_app
from rlnode.service.auth import (
    JOB_SCOPES,
    ORG_SCOPES,
    AuthError,
    Scope,
    TokenClaims,
    bearer_token,
)
from rlnode.service.db import engine_for
from rlnode.service.db_outage import watch_database
from rlnode.service.http import BodySizeLimit, install_error_handlers
from rlnode.service.sealing import SealingError, b64decode_strict, public_key_b64
from rlnode_services.credential_vault import schemas as api
from rlnode_services.credential_vault.crypto import KeyWrapper, load_master_key
from rlnode_services.credential_vault.settings import SERVICE, VaultSettings
from rlnode_services.credential_vault.store import AuditRecord, IssuedToken, OrgKey, Secret
from rlnode_services.credential_vault.vault import Actor, BadInput, Vault, VaultError

MAX_BODY_BYTES = 64 * 1024

ERRORS = {
    400: {"model": api.ErrorOut, "description": "Bad input; the message says what to change."},
    401: {"model": api.ErrorOut, "description": "No valid token."},
    403: {"model": api.ErrorOut, "description": "The token may not do this (scope or org)."},
    404: {"model": api.ErrorOut, "description": "No such resource in this org."},
    422: {"model": api.ErrorOut, "description": "The body does not have the documented shape."},
}


@dataclass(frozen=True)
class Caller:
    """The bootstrap admin (claims None) or a token holder."""

    claims: TokenClaims | None

    @property
    def is_admin(self) -> bool:
        return self.claims is None

    @property
    def actor(self) -> Actor:
        return Actor.of(self.claims)


def caller(request: Request, authorization: Annotated[str | None, Header()] = None) -> Caller:
    token = bearer_token(authorization)
    admin_token = request.app.state.admin_token
    if token and admin_token and hmac.compare_digest(token.encode(), admin_token):
        return Caller(None)
    return Caller(request.app.state.vault.verifier.verify(token))


Authenticated = Annotated[Caller, Depends(caller)]


def admin_only(who: Caller) -> None:
    if not who.is_admin:
        raise AuthError(403, "only the vault admin (VAULT_ADMIN_TOKEN) may do this")


def create_app(settings: VaultSettings) -> FastAPI:
    wrapper = KeyWrapper(
        load_master_key(
            settings.master_key.get_secret_value() if settings.master_key else None,
            settings.master_key_file,
        )
    )
    vault = Vault(engine_for(SERVICE.name, settings.database, settings.node), wrapper, settings)
    vault.initialise()

    app = create_service_app(SERVICE, settings, responses=ERRORS)
    app.state.vault = vault
    install_error_handlers(app)
    watch_database(app, vault.engine)
    app.add_middleware(BodySizeLimit, max_bytes=MAX_BODY_BYTES)

    @app.exception_handler(VaultError)
    async def _vault_error(_request: Request, exc: VaultError) -> JSONResponse:
        return JSONResponse(status_code=exc.status, content={"detail": exc.message})

    @app.middleware("http")
    async def _no_store(request: Request, call_next):
        # Responses carry tokens and sealed secrets: no cache may keep them.
        response = await call_next(request)
        response.headers["Cache-Control"] = "no-store"
        return response

    app.state.admin_token = (
        settings.admin_token.get_secret_value().encode() if settings.admin_token else None
    )

    def for_org(who: Caller, org_id: str, *scopes: str) -> None:
        """Admin, or a token of this org (or a node-wide service token) with the scopes."""
        if who.claims is not None:  # not the admin
            vault.verifier.authorize_claims(who.claims, scopes=scopes, org_id=org_id)

    # -- identity ------------------------------------------------------------------------

    @app.get("/v1/verify-key", response_model=api.VerifyKeyOut, tags=["identity"])
    def verify_key() -> api.VerifyKeyOut:
        """The Ed25519 key every service checks rlnode tokens with. Public."""
        return api.VerifyKeyOut(
            key_id=vault.verify_key_id,
            public_key=public_key_b64(vault.signing_key.verify_key),
        )

    @app.get("/v1/revocations", response_model=api.RevocationsOut, tags=["identity"])
    def revocations() -> api.RevocationsOut:
        """Ids of revoked tokens that have not expired yet. Public: ids are not credentials."""
        return api.RevocationsOut(token_ids=vault.revoked_token_ids())

    @app.post("/v1/orgs", status_code=201, response_model=api.CreatedOrg, tags=["orgs"])
    def create_org(body: api.CreateOrg, who: Authenticated) -> api.CreatedOrg:
        """Create an org with its first key pair and an admin token (shown once)."""
        admin_only(who)
        org, key, token = vault.create_org(body.org_id, body.name)
        return api.CreatedOrg(
            org_id=org.org_id,
            name=org.name,
            created_at=org.created_at,
            public_key=_public_key(key),
            token=_token_out(token.token, token.record),
        )

    @app.get("/v1/orgs/{org_id}", response_model=api.OrgOut, tags=["orgs"])
    def get_org(org_id: str, who: Authenticated) -> api.OrgOut:
        for_org(who, org_id)
        org = vault.get_org(org_id)
        return api.OrgOut(org_id=org.org_id, name=org.name, created_at=org.created_at)

    @app.get("/v1/orgs/{org_id}/public-key", response_model=api.PublicKeyOut, tags=["keys"])
    def public_key(org_id: str, who: Authenticated) -> api.PublicKeyOut:
        """The key to seal this org's secrets to, on the client, before uploading them."""
        for_org(who, org_id)
        return _public_key(vault.current_key(org_id))

    @app.post("/v1/orgs/{org_id}/keys/rotate", response_model=api.RotatedKey, tags=["keys"])
    def rotate_key(org_id: str, who: Authenticated) -> api.RotatedKey:
        """New key pair; every stored secret re-sealed to it; the old private key destroyed."""
        for_org(who, org_id, Scope.ORG_ADMIN)
        key, resealed = vault.rotate_key(org_id, who.actor)
        return api.RotatedKey(**_public_key(key).model_dump(), resealed=resealed)

    # -- tokens --------------------------------------------------------------------------

    @app.post(
        "/v1/orgs/{org_id}/tokens", status_code=201, response_model=api.TokenOut, tags=["tokens"]
    )
    def create_org_token(org_id: str, body: api.CreateOrgToken, who: Authenticated) -> api.TokenOut:
        for_org(who, org_id, Scope.ORG_ADMIN)
        scopes = set(body.scopes) if body.scopes is not None else set(ORG_SCOPES)
        issued = vault.issue_token("org", body.name, org_id, scopes, body.ttl_s, who.actor)
        return _token_out(issued.token, issued.record)

    @app.post(
        "/v1/orgs/{org_id}/job-tokens",
        status_code=201,
        response_model=api.TokenOut,
        tags=["tokens"],
    )
    def create_job_token(org_id: str, body: api.CreateJobToken, who: Authenticated) -> api.TokenOut:
        """What a job request carries on Kafka in place of the org token: good for one request
        about `job_id`, for minutes (VAULT_JOB_TOKEN_TTL_S). The learner refuses it a second
        time, so a copy read off the topic is worthless."""
        for_org(who, org_id, Scope.JOBS_WRITE)
        issued = vault.issue_token(
            "job", body.job_id, org_id, set(JOB_SCOPES), None, who.actor, job_id=body.job_id
        )
        return _token_out(issued.token, issued.record)

    @app.get("/v1/orgs/{org_id}/tokens", response_model=list[api.TokenInfo], tags=["tokens"])
    def list_org_tokens(org_id: str, who: Authenticated) -> list[api.TokenInfo]:
        for_org(who, org_id, Scope.ORG_ADMIN)
        vault.get_org(org_id)
        return [_token_info(t) for t in vault.list_tokens(org_id)]

    @app.delete("/v1/orgs/{org_id}/tokens/{token_id}", status_code=204, tags=["tokens"])
    def revoke_org_token(org_id: str, token_id: str, who: Authenticated) -> Response:
        for_org(who, org_id, Scope.ORG_ADMIN)
        vault.revoke_token(token_id, org_id, who.actor)
        return Response(status_code=204)

    @app.post("/v1/service-tokens", status_code=201, response_model=api.TokenOut, tags=["tokens"])
    def create_service_token(body: api.CreateServiceToken, who: Authenticated) -> api.TokenOut:
        """A token for an rlnode service (e.g. the gateway, with secrets:unseal)."""
        admin_only(who)
        issued = vault.issue_token(
            "service", body.service, body.org_id, set(body.scopes), body.ttl_s, who.actor
        )
        return _token_out(issued.token, issued.record)

    @app.post(
        "/v1/record-keys",
        status_code=201,
        response_model=api.RecordKeyCertificate,
        tags=["identity"],
    )
    def certify_record_key(
        body: api.CertifyRecordKey, who: Authenticated
    ) -> api.RecordKeyCertificate:
        """A service's certificate for the key it signs its Kafka records with (node-wide
        service tokens with records:sign). It names the service as the token does, and
        lapses with the token: revoking the token revokes the certificate."""
        claims = who.claims
        if claims is None or not claims.node_wide_service:
            raise AuthError(403, "only a node-wide service token may certify a record key")
        vault.verifier.authorize_claims(claims, scopes=[Scope.RECORDS_SIGN])
        try:
            public_key = b64decode_strict(body.public_key, "public_key")
        except SealingError as e:
            raise BadInput(str(e)) from None
        if len(public_key) != 32:
            raise BadInput("public_key must be a 32-byte Ed25519 key, base64")
        certificate = issue_certificate(
            vault.signing_key,
            vault.verify_key_id,
            claims.subject,
            public_key,
            claims.token_id,
            claims.expires_at,
        )
        return api.RecordKeyCertificate(
            certificate=certificate,
            service=claims.subject,
            expires_at=datetime.fromtimestamp(claims.expires_at, UTC),
        )

    @app.delete("/v1/service-tokens/{token_id}", status_code=204, tags=["tokens"])
    def revoke_service_token(token_id: str, who: Authenticated) -> Response:
        admin_only(who)
        vault.revoke_token(token_id, None, who.actor)
        return Response(status_code=204)

    # -- secrets -------------------------------------------------------------------------

    @app.post(
        "/v1/orgs/{org_id}/secrets",
        response_model=api.SecretInfo,
        status_code=201,
        tags=["secrets"],
        responses={
            200: {"model": api.SecretInfo, "description": "Replaced an existing secret."},
            409: {"model": api.ErrorOut, "description": "Sealed to a key that was rotated out."},
            413: {"model": api.ErrorOut, "description": "Larger than the limit."},
        },
    )
    def upload_secret(
        org_id: str, body: api.UploadSecret, who: Authenticated, response: Response
    ) -> api.SecretInfo:
        """Store a secret sealed on the client to the org's current public key."""
        for_org(who, org_id, Scope.SECRETS_WRITE)
        secret, created = vault.put_secret(
            org_id, body.name, body.key_id, body.ciphertext_b64, who.actor
        )
        response.status_code = 201 if created else 200
        return _secret_info(secret)

    @app.get("/v1/orgs/{org_id}/secrets", response_model=list[api.SecretInfo], tags=["secrets"])
    def list_secrets(org_id: str, who: Authenticated) -> list[api.SecretInfo]:
        """Names, key ids and times; never values."""
        for_org(who, org_id, Scope.SECRETS_READ)
        return [_secret_info(s) for s in vault.list_secrets(org_id)]

    @app.get("/v1/orgs/{org_id}/secrets/{name}", response_model=api.SecretInfo, tags=["secrets"])
    def get_secret(org_id: str, name: str, who: Authenticated) -> api.SecretInfo:
        for_org(who, org_id, Scope.SECRETS_READ)
        return _secret_info(vault.get_secret(org_id, name))

    @app.delete("/v1/orgs/{org_id}/secrets/{name}", status_code=204, tags=["secrets"])
    def delete_secret(org_id: str, name: str, who: Authenticated) -> Response:
        for_org(who, org_id, Scope.SECRETS_WRITE)
        vault.delete_secret(org_id, name, who.actor)
        return Response(status_code=204)

    @app.post(
        "/v1/orgs/{org_id}/secrets/{name}/unseal-for", response_model=api.Unsealed, tags=["secrets"]
    )
    def unseal_for(org_id: str, name: str, body: api.UnsealFor, who: Authenticated) -> api.Unsealed:
        """For services: the secret re-sealed to the caller's public key (audited)."""
        for_org(who, org_id)
        if who.claims is None or who.claims.kind != "service":  # the admin, or not a service
            raise AuthError(403, "only service tokens with secrets:unseal may unseal secrets")
        for_org(who, org_id, Scope.SECRETS_UNSEAL)
        sealed, key_id, print_ = vault.unseal_for(
            org_id, name, body.recipient_public_key, body.job_id, who.actor
        )
        return api.Unsealed(
            name=name, key_id=key_id, sealed_b64=sealed, recipient_fingerprint=print_
        )

    # -- audit ---------------------------------------------------------------------------

    @app.get("/v1/orgs/{org_id}/audit", response_model=list[api.AuditOut], tags=["audit"])
    def audit(
        org_id: str,
        who: Authenticated,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        action: Annotated[str | None, Query(max_length=64)] = None,
    ) -> list[api.AuditOut]:
        """Newest first: who did what to which secret or key, for which job. Never values."""
        for_org(who, org_id, Scope.ORG_ADMIN)
        return [_audit_out(r) for r in vault.audit_trail(org_id, limit, action)]

    return app


def _public_key(key: OrgKey) -> api.PublicKeyOut:
    return api.PublicKeyOut(
        org_id=key.org_id,
        key_id=key.key_id,
        public_key=public_key_b64(PublicKey(key.public_key)),
        created_at=key.created_at,
    )


def _token_out(token: str, record: IssuedToken) -> api.TokenOut:
    return api.TokenOut(
        token=token,
        token_id=record.token_id,
        kind=record.kind,
        subject=record.subject,
        org_id=record.org_id,
        scopes=record.scopes.split(),
        expires_at=record.expires_at,
    )


def _token_info(record: IssuedToken) -> api.TokenInfo:
    return api.TokenInfo(**record.model_dump(exclude={"scopes"}), scopes=record.scopes.split())


def _secret_info(secret: Secret) -> api.SecretInfo:
    return api.SecretInfo(
        org_id=secret.org_id,
        name=secret.name,
        key_id=secret.key_id,
        created_at=secret.created_at,
        updated_at=secret.updated_at,
    )


def _audit_out(record: AuditRecord) -> api.AuditOut:
    return api.AuditOut(**record.model_dump())
