"""AWS Signature Version 4, the server's side: is this request signed with our secret?

The canonical request is rebuilt from what arrived (the path and query re-encoded the way
AWS encodes them, the headers the client says it signed, the payload's SHA-256 it sent and
which the server checks against the body), signed with the key derived from the secret for
the date and region of the credential scope, and compared in constant time. Presigned URLs
and aws-chunked streaming bodies are not accepted: the clients of this store sign headers.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from urllib.parse import quote, unquote

ALGORITHM = "AWS4-HMAC-SHA256"
UNSIGNED = "UNSIGNED-PAYLOAD"
MAX_SKEW_S = 15 * 60  # S3's own bound
_AUTH = re.compile(
    r"AWS4-HMAC-SHA256\s+Credential=(?P<credential>[^,\s]+),\s*"
    r"SignedHeaders=(?P<signed>[^,\s]+),\s*Signature=(?P<signature>[0-9a-f]{64})$"
)


class SignatureError(Exception):
    """Refused: `code` is S3's error code for it, `message` says why (never the secret)."""

    def __init__(self, code: str, message: str, status: int = 403) -> None:
        super().__init__(message)
        self.code, self.message, self.status = code, message, status


@dataclass(frozen=True)
class Credentials:
    access_key_id: str
    secret_access_key: str
    region: str = "us-east-1"


def aws_quote(text: str, keep_slash: bool = False) -> str:
    """AWS's URI encoding: everything but A-Z a-z 0-9 - _ . ~ as %XX."""
    return quote(text, safe="/~" if keep_slash else "~")


def canonical_query(raw_query: str) -> str:
    pairs = []
    for part in raw_query.split("&") if raw_query else []:
        name, _, value = part.partition("=")
        pairs.append((aws_quote(unquote(name)), aws_quote(unquote(value))))
    return "&".join(f"{n}={v}" for n, v in sorted(pairs))


def signing_key(secret: str, date: str, region: str, service: str = "s3") -> bytes:
    key = ("AWS4" + secret).encode()
    for part in (date, region, service, "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return key


def verify(
    credentials: Credentials,
    method: str,
    raw_path: str,
    headers: Mapping[str, str],
    now: datetime | None = None,
) -> None:
    """Raise `SignatureError` unless the request's headers are signed with `credentials`
    (before its body is read: `verify_payload` then checks the body against the hash they
    signed). `headers` maps lower-case names to values (repeated headers joined by ",");
    `raw_path` is the request target as sent (path and query, still percent-encoded)."""
    authorization = headers.get("authorization", "")
    if not authorization:
        raise SignatureError("AccessDenied", "the request is not signed (AWS Signature V4)")
    match = _AUTH.match(authorization.strip())
    if not match:
        raise SignatureError(
            "AuthorizationHeaderMalformed", f"the Authorization header is not {ALGORITHM}", 400
        )
    access_key, _, scope = match["credential"].partition("/")
    date, region, service, terminal = [*scope.split("/"), "", "", ""][:4]
    if not hmac.compare_digest(access_key, credentials.access_key_id):
        raise SignatureError("InvalidAccessKeyId", "the access key id is not known here")
    if service != "s3" or terminal != "aws4_request" or region != credentials.region:
        raise SignatureError(
            "AuthorizationHeaderMalformed",
            f"the credential scope {scope!r} is not <date>/{credentials.region}/s3/aws4_request",
            400,
        )
    signed = match["signed"].split(";")
    if "host" not in signed or "x-amz-date" not in signed:
        raise SignatureError("AccessDenied", "the signature must cover host and x-amz-date")
    amz_date = headers.get("x-amz-date", "")
    try:
        when = datetime.strptime(amz_date, "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)
    except ValueError:
        raise SignatureError("AccessDenied", "x-amz-date is not YYYYMMDDTHHMMSSZ") from None
    if amz_date[:8] != date:
        raise SignatureError("AccessDenied", "the credential scope's date is not x-amz-date's")
    if abs(((now or datetime.now(UTC)) - when).total_seconds()) > MAX_SKEW_S:
        raise SignatureError("RequestTimeTooSkewed", "x-amz-date is more than 15 minutes off")
    payload_hash = headers.get("x-amz-content-sha256", "")
    if payload_hash != UNSIGNED and not re.fullmatch(r"[0-9a-f]{64}", payload_hash):
        raise SignatureError(
            "InvalidRequest", "x-amz-content-sha256 must be the body's SHA-256 hex", 400
        )
    path, _, query = raw_path.partition("?")
    canonical_headers = "".join(
        f"{name}:{' '.join(headers.get(name, '').split())}\n" for name in signed
    )
    canonical = "\n".join(
        [
            method,
            aws_quote(unquote(path), keep_slash=True),
            canonical_query(query),
            canonical_headers,
            match["signed"],
            payload_hash,
        ]
    )
    to_sign = "\n".join(
        [ALGORITHM, amz_date, match["credential"].partition("/")[2], _sha256(canonical)]
    )
    key = signing_key(credentials.secret_access_key, date, region)
    expected = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, match["signature"]):
        raise SignatureError(
            "SignatureDoesNotMatch",
            "the signature does not match (wrong secret or altered request)",
        )


def verify_payload(headers: Mapping[str, str], body: bytes) -> None:
    """The body is the one whose SHA-256 the verified headers carry (or they said
    UNSIGNED-PAYLOAD)."""
    payload_hash = headers.get("x-amz-content-sha256", "")
    if payload_hash != UNSIGNED and not hmac.compare_digest(
        payload_hash, hashlib.sha256(body).hexdigest()
    ):
        raise SignatureError(
            "XAmzContentSHA256Mismatch", "the body is not the one that was signed", 400
        )


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def sign(
    credentials: Credentials,
    method: str,
    host: str,
    raw_path: str,
    body: bytes = b"",
    headers: Mapping[str, str] | None = None,
    now: datetime | None = None,
) -> dict[str, str]:
    """The headers that sign a request (the client's side; for tests and tools). `raw_path`
    is AWS-encoded already; `headers` are signed too."""
    when = now or datetime.now(UTC)
    amz_date = when.strftime("%Y%m%dT%H%M%SZ")
    out = {k.lower(): v for k, v in (headers or {}).items()}
    out |= {
        "host": host,
        "x-amz-date": amz_date,
        "x-amz-content-sha256": hashlib.sha256(body).hexdigest(),
    }
    names = sorted(out)
    path, _, query = raw_path.partition("?")
    canonical = "\n".join(
        [
            method,
            path,
            canonical_query(query),
            "".join(f"{n}:{' '.join(out[n].split())}\n" for n in names),
            ";".join(names),
            out["x-amz-content-sha256"],
        ]
    )
    scope = f"{amz_date[:8]}/{credentials.region}/s3/aws4_request"
    to_sign = "\n".join([ALGORITHM, amz_date, scope, _sha256(canonical)])
    key = signing_key(credentials.secret_access_key, amz_date[:8], credentials.region)
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    out["authorization"] = (
        f"{ALGORITHM} Credential={credentials.access_key_id}/{scope}, "
        f"SignedHeaders={';'.join(names)}, Signature={signature}"
    )
    return out
