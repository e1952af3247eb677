"""Tokens: what verifies, what does not, and what each failure says."""

from __future__ import annotations

import pytest
from nacl.signing import SigningKey

from rlnode.service.auth import (
    ORG_SCOPES,
    AuthError,
    TokenClaims,
    TokenVerifier,
    bearer_token,
    read_unverified,
    redact_token_bytes,
    redact_tokens,
    require_operator,
    sign_token,
)

NOW = 1_800_000_000


def _claims(**changes) -> TokenClaims:
    base = dict(
        token_id="t_1",
        kind="org",
        subject="ci",
        org_id="acme",
        scopes=frozenset({"secrets:read"}),
        issued_at=NOW,
        expires_at=NOW + 3600,
        key_id="k",
    )
    return TokenClaims(**{**base, **changes})


@pytest.fixture
def key() -> SigningKey:
    return SigningKey.generate()


def _verifier(
    key: SigningKey, now: float = NOW, revoked: frozenset[str] = frozenset()
) -> TokenVerifier:
    return TokenVerifier(key.verify_key, is_revoked=lambda jti: jti in revoked, clock=lambda: now)


def test_a_signed_token_verifies_to_its_claims(key: SigningKey) -> None:
    claims = _claims()
    token = sign_token(key, claims)
    assert token.startswith("rln1.") and token.count(".") == 2
    assert _verifier(key).verify(token) == claims
    assert read_unverified(token)["org"] == "acme"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda t: "", "no token"),
        (lambda t: "Bearer " + t, "not an rlnode token"),
        (lambda t: t.replace("rln1.", "rln2.", 1), "not an rlnode token"),
        (lambda t: t[:-4] + ("AAAA" if not t.endswith("AAAA") else "BBBB"), "signature"),
        (lambda t: t.split(".")[0] + "." + t.split(".")[1] + "x." + t.split(".")[2], "signature"),
        (lambda t: t + ".extra", "not an rlnode token"),
    ],
)
def test_malformed_or_altered_tokens_are_401(key: SigningKey, mutate, message: str) -> None:
    token = sign_token(key, _claims())
    with pytest.raises(AuthError, match=message) as info:
        _verifier(key).verify(mutate(token))
    assert info.value.status == 401


def test_another_keys_signature_is_refused(key: SigningKey) -> None:
    token = sign_token(SigningKey.generate(), _claims())
    with pytest.raises(AuthError, match="signature"):
        _verifier(key).verify(token)


def test_expiry_not_before_and_revocation(key: SigningKey) -> None:
    token = sign_token(key, _claims())
    assert _verifier(key, now=NOW + 3600 + 29).verify(token)  # within leeway
    with pytest.raises(AuthError, match="expired"):
        _verifier(key, now=NOW + 3600 + 31).verify(token)
    with pytest.raises(AuthError, match="not valid yet"):
        _verifier(key, now=NOW - 120).verify(token)
    with pytest.raises(AuthError, match="revoked"):
        _verifier(key, revoked=frozenset({"t_1"})).verify(token)


def test_authorize_checks_org_then_scopes(key: SigningKey) -> None:
    verifier = _verifier(key)
    token = sign_token(key, _claims())
    assert verifier.authorize(token, scopes=["secrets:read"], org_id="acme").subject == "ci"
    with pytest.raises(
        AuthError, match="belongs to org 'acme' and cannot act on org 'other'"
    ) as info:
        verifier.authorize(token, scopes=["org:admin"], org_id="other")
    assert info.value.status == 403
    with pytest.raises(AuthError, match="lacks the scope") as info:
        verifier.authorize(token, scopes=["secrets:write"], org_id="acme")
    assert info.value.status == 403


def test_node_wide_service_tokens_reach_every_org_but_org_tokens_do_not(key: SigningKey) -> None:
    service = _claims(
        kind="service", subject="taskapp-gateway", org_id=None, scopes=frozenset({"secrets:unseal"})
    )
    assert service.allows_org("acme") and service.allows_org("globex")
    scoped_service = _claims(kind="service", org_id="acme")
    assert scoped_service.allows_org("acme") and not scoped_service.allows_org("globex")
    orgless_org_token = _claims(org_id=None)
    assert not orgless_org_token.allows_org("acme")
    assert "org:admin" in ORG_SCOPES


def test_bearer_header_parsing() -> None:
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer   abc ") == "abc"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer ") is None
    assert bearer_token(None) is None


def test_a_job_token_names_its_job_and_org_tokens_name_none(key) -> None:
    verifier = _verifier(key)
    job = sign_token(key, _claims(kind="job", job_id="job-1", scopes=frozenset({"jobs:write"})))
    assert verifier.verify(job).job_id == "job-1"
    assert verifier.verify(sign_token(key, _claims())).job_id is None
    with pytest.raises(AuthError, match="unknown kind"):
        verifier.verify(sign_token(key, _claims(kind="root")))


def test_tokens_are_blanked_out_wherever_they_sit(key) -> None:
    token = sign_token(key, _claims())
    text = f'{{"note": {{"deep": ["x{token}y"]}}, "b": "{token}"}}'
    assert token not in redact_tokens(text)
    assert redact_tokens(text).count("rln1.[REDACTED]") == 2
    assert token.encode() not in redact_token_bytes(text.encode())
    assert redact_tokens("rln1 is the prefix") == "rln1 is the prefix"


def test_only_node_wide_service_tokens_with_node_ops_are_operators() -> None:
    operator = _claims(kind="service", org_id=None, scopes=frozenset({"node:ops"}))
    assert require_operator(operator) is operator
    for not_one in (
        _claims(scopes=frozenset({"node:ops"})),  # an org token
        _claims(kind="service", org_id=None, scopes=frozenset({"rollouts:run"})),
        _claims(kind="service", org_id="acme", scopes=frozenset({"node:ops"})),
    ):
        with pytest.raises(AuthError) as refused:
            require_operator(not_one)
        assert refused.value.status == 403


def test_a_token_is_opened_once_and_still_checked_on_every_use(key, monkeypatch) -> None:
    """The signature of a token that checked out is not checked again (a service's token
    comes with every call it makes); its expiry and revocation are, every time."""
    from rlnode.service import auth

    opened = []
    real = auth.open_envelope
    monkeypatch.setattr(auth, "open_envelope", lambda *a: opened.append(1) or real(*a))
    revoked: set[str] = set()
    now = [NOW]
    verifier = TokenVerifier(key.verify_key, is_revoked=revoked.__contains__, clock=lambda: now[0])
    token = sign_token(key, _claims())
    assert verifier.verify(token).subject == verifier.verify(token).subject == "ci"
    assert len(opened) == 1
    forged = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
    with pytest.raises(AuthError, match="signature does not check out"):
        verifier.verify(forged)
    revoked.add("t_1")
    with pytest.raises(AuthError, match="revoked"):
        verifier.verify(token)
    revoked.clear()
    now[0] = NOW + 3600 + 31
    with pytest.raises(AuthError, match="expired"):
        verifier.verify(token)
