"""The S3 REST API over `ObjectFiles`, as much of it as the embedded broker's object_store
client uses: PUT (If-None-Match: * / If-Match: <etag>, else 412), GET (Range, If-Match,
If-None-Match -> 304, If-(Un)Modified-Since), HEAD, DELETE, ListObjectsV2 (prefix,
delimiter, max-keys, continuation-token, start-after) and DeleteObjects, path-style
(`/<bucket>/<key>`). Every request must carry a valid AWS Signature V4 of the configured
key (else 403); errors are S3's XML documents. Anything else is 501 NotImplemented, named.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import os
import uuid
import xml.etree.ElementTree as ET
from datetime import UTC, datetime
from email.utils import format_datetime, parsedate_to_datetime
from urllib.parse import parse_qsl, quote, unquote
from xml.sax.saxutils import escape

from aiohttp import web

from rlnode.bus.objectstore.files import (
    InvalidKey,
    NoSuchBucket,
    ObjectFiles,
    ObjectMeta,
    Precondition,
    same_etag,
)
from rlnode.bus.objectstore.sigv4 import Credentials, SignatureError, verify, verify_payload

log = logging.getLogger("rlnode.objectstore")

MAX_OBJECT_BYTES = 512 * 1024 * 1024
# Headers a PUT sets that a GET gives back (object_store's attributes).
KEPT = (
    "content-type",
    "content-encoding",
    "content-disposition",
    "content-language",
    "cache-control",
)
CONDITIONS = ("If-Match", "If-None-Match", "If-Modified-Since", "If-Unmodified-Since", "Range")
XML_HEAD = '<?xml version="1.0" encoding="UTF-8"?>\n'
S3_NS = "http://s3.amazonaws.com/doc/2006-03-01/"


class S3Error(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def make_app(files: ObjectFiles, credentials: Credentials) -> web.Application:
    app = web.Application(client_max_size=MAX_OBJECT_BYTES)

    async def handle(request: web.Request) -> web.StreamResponse:
        response = await _handle(request)
        if log.isEnabledFor(logging.DEBUG):
            conditions = {h: request.headers[h] for h in CONDITIONS if h in request.headers}
            log.debug(
                "%s %s %s -> %d", request.method, request.raw_path, conditions, response.status
            )
        return response

    async def _handle(request: web.Request) -> web.StreamResponse:
        path, _, query = request.raw_path.partition("?")
        try:
            headers = {k.lower(): ",".join(request.headers.getall(k)) for k in request.headers}
            verify(credentials, request.method, request.raw_path, headers)  # before the body
            body = await request.read()
            verify_payload(headers, body)
            bucket, _, key = unquote(path).removeprefix("/").partition("/")
            params = dict(parse_qsl(query, keep_blank_values=True))
            return await _route(files, request.method, bucket, key, params, headers, body)
        except SignatureError as e:
            log.warning("refused %s %s: %s", request.method, path, e.message)
            return _error(request, e.status, e.code, e.message)
        except S3Error as e:
            return _error(request, e.status, e.code, e.message)
        except NoSuchBucket as e:
            return _error(request, 404, "NoSuchBucket", f"no bucket {e}")
        except InvalidKey as e:
            return _error(request, 400, "KeyTooLongError", str(e))

    app.router.add_route("*", "/{tail:.*}", handle)
    return app


async def _route(
    files: ObjectFiles,
    method: str,
    bucket: str,
    key: str,
    params: dict[str, str],
    headers: dict[str, str],
    body: bytes,
) -> web.StreamResponse:
    if not bucket:
        raise S3Error(501, "NotImplemented", "ListBuckets is not supported")
    if not key:
        if method == "GET" and params.get("list-type") == "2":
            return await asyncio.to_thread(_list, files, bucket, params)
        if method == "POST" and "delete" in params:
            return await asyncio.to_thread(_delete_many, files, bucket, body)
        if method == "HEAD":
            return web.Response(status=200 if files.bucket_exists(bucket) else 404)
        raise S3Error(501, "NotImplemented", f"{method} on a bucket with {sorted(params)}")
    unsupported = {"uploads", "uploadId", "partNumber", "acl", "tagging", "versionId"} & set(params)
    if unsupported or "x-amz-copy-source" in headers:
        what = sorted(unsupported) or ["CopyObject"]
        raise S3Error(501, "NotImplemented", f"{method} with {what} is not supported")
    if method == "PUT":
        return await _put(files, bucket, key, headers, body)
    if method in ("GET", "HEAD"):
        return await _get(files, bucket, key, headers, head=method == "HEAD")
    if method == "DELETE":
        await asyncio.to_thread(files.delete, bucket, key)
        return web.Response(status=204)
    raise S3Error(405, "MethodNotAllowed", f"{method} is not allowed on an object")


async def _put(
    files: ObjectFiles, bucket: str, key: str, headers: dict[str, str], body: bytes
) -> web.Response:
    if "content-md5" in headers:
        if base64.b64encode(hashlib.md5(body).digest()).decode() != headers["content-md5"]:
            raise S3Error(400, "BadDigest", "Content-MD5 is not the body's")
    if_none_match, if_match = headers.get("if-none-match"), headers.get("if-match")
    if if_none_match is not None and if_none_match.strip() != "*":
        raise S3Error(501, "NotImplemented", "a PUT's If-None-Match may only be *")
    kept = {name: headers[name] for name in KEPT if name in headers}
    kept |= {k: v for k, v in headers.items() if k.startswith("x-amz-meta-")}
    try:
        meta = await asyncio.to_thread(
            files.put, bucket, key, body, kept, if_match=if_match, if_none_match=if_none_match
        )
    except Precondition as e:
        raise S3Error(412, "PreconditionFailed", str(e)) from None
    return web.Response(status=200, headers={"ETag": meta.etag})


async def _get(
    files: ObjectFiles, bucket: str, key: str, headers: dict[str, str], head: bool
) -> web.Response:
    return await asyncio.to_thread(_read, files, bucket, key, headers, head)


def _read(
    files: ObjectFiles, bucket: str, key: str, headers: dict[str, str], head: bool
) -> web.Response:
    """GET or HEAD, conditions and range included, from one snapshot of the object."""
    got = files.get(bucket, key)
    if got is None:
        raise S3Error(404, "NoSuchKey", f"no object {key}")
    meta, opened = got
    with opened:
        if _conditions(meta, headers) == 304:
            return web.Response(status=304, headers={"ETag": meta.etag, **_dates(meta)})
        if head:
            return web.Response(status=200, headers=_object_headers(meta, meta.size))
        first, last = _range(headers.get("range"), meta.size)
        opened.seek(first, os.SEEK_CUR)
        data = opened.read(last - first + 1)
    extra = _object_headers(meta, len(data))
    if "range" not in headers:
        return web.Response(status=200, body=data, headers=extra)
    extra["Content-Range"] = f"bytes {first}-{last}/{meta.size}"
    return web.Response(status=206, body=data, headers=extra)


def _conditions(meta: ObjectMeta, headers: dict[str, str]) -> int:
    """200, or 304 (not modified); a failed If-Match / If-Unmodified-Since raises 412."""
    modified = datetime.fromtimestamp(int(meta.mtime), UTC)
    if (match := headers.get("if-match")) and not _etag_in(meta.etag, match):
        raise S3Error(412, "PreconditionFailed", "If-Match does not hold")
    if (since := _http_date(headers.get("if-unmodified-since"))) and modified > since:
        raise S3Error(412, "PreconditionFailed", "modified since If-Unmodified-Since")
    if (none_match := headers.get("if-none-match")) is not None:
        return 304 if _etag_in(meta.etag, none_match) else 200
    if (since := _http_date(headers.get("if-modified-since"))) and modified <= since:
        return 304
    return 200


def _etag_in(etag: str, header: str) -> bool:
    return any(t.strip() == "*" or same_etag(etag, t) for t in header.split(","))


def _http_date(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        return parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None


def _range(header: str | None, size: int) -> tuple[int, int]:
    if not header:
        return 0, size - 1
    unit, _, spec = header.partition("=")
    first_s, dash, last_s = spec.strip().partition("-")
    try:
        if unit.strip() != "bytes" or not dash or "," in spec:
            raise ValueError
        if not first_s:  # the last n bytes
            first, last = max(0, size - int(last_s)), size - 1
        else:
            first, last = int(first_s), int(last_s) if last_s else size - 1
    except ValueError:
        raise S3Error(400, "InvalidArgument", f"Range {header!r} is not bytes=a-b") from None
    if first >= size or last < first:
        raise S3Error(416, "InvalidRange", f"Range {header!r} is outside 0..{size}")
    return first, min(last, size - 1)


def _dates(meta: ObjectMeta) -> dict[str, str]:
    stamp = datetime.fromtimestamp(meta.mtime, UTC)
    return {"Last-Modified": format_datetime(stamp, usegmt=True)}


def _object_headers(meta: ObjectMeta, length: int) -> dict[str, str]:
    out = {"ETag": meta.etag, "Accept-Ranges": "bytes", **_dates(meta)}
    out["Content-Type"] = "application/octet-stream"
    out |= {_title(k): v for k, v in meta.headers.items()}
    out["Content-Length"] = str(length)
    return out


def _title(name: str) -> str:
    return name if name.startswith("x-amz-") else "-".join(p.capitalize() for p in name.split("-"))


def _list(files: ObjectFiles, bucket: str, params: dict[str, str]) -> web.Response:
    prefix, delimiter = params.get("prefix", ""), params.get("delimiter", "")
    try:
        max_keys = min(1000, int(params.get("max-keys", "1000")))
    except ValueError:
        raise S3Error(400, "InvalidArgument", "max-keys is not an integer") from None
    token = params.get("continuation-token")
    after = params.get("start-after", "")
    if token:
        try:
            after = max(after, base64.urlsafe_b64decode(token.encode()).decode())
        except ValueError:
            raise S3Error(400, "InvalidArgument", "the continuation token is not ours") from None
    url = params.get("encoding-type") == "url"
    contents: list[ObjectMeta] = []
    prefixes: list[str] = []
    last, truncated = "", False
    for key in files.walk(bucket, prefix, after, group_dirs=delimiter == "/"):
        rest = key[len(prefix) :]
        group = None
        if delimiter and delimiter in rest:
            group = key[: len(prefix) + rest.index(delimiter) + len(delimiter)]
            if group == last or group <= after:
                continue
        if len(contents) + len(prefixes) == max_keys:
            truncated = True
            break
        if group is not None:
            prefixes.append(group)
            last = group
            continue
        meta = files.listed(bucket, key)
        if meta is not None:  # else deleted while listing
            contents.append(meta)
            last = key
    show = (lambda k: quote(k, safe="/")) if url else (lambda k: k)
    parts = [f'<ListBucketResult xmlns="{S3_NS}">', f"<Name>{escape(bucket)}</Name>"]
    parts += [f"<Prefix>{escape(show(prefix))}</Prefix>", f"<MaxKeys>{max_keys}</MaxKeys>"]
    parts += [f"<KeyCount>{len(contents) + len(prefixes)}</KeyCount>"]
    parts += [f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>"]
    if delimiter:
        parts.append(f"<Delimiter>{escape(show(delimiter))}</Delimiter>")
    if token:
        parts.append(f"<ContinuationToken>{escape(token)}</ContinuationToken>")
    if truncated:
        next_token = base64.urlsafe_b64encode(last.encode()).decode()
        parts.append(f"<NextContinuationToken>{next_token}</NextContinuationToken>")
    parts += [_contents(meta, url) for meta in contents]
    parts += [
        f"<CommonPrefixes><Prefix>{escape(show(p))}</Prefix></CommonPrefixes>" for p in prefixes
    ]
    parts.append("</ListBucketResult>")
    return _xml(200, "".join(parts))


_RENDERED: dict[tuple[str, str, float, bool], str] = {}


def _contents(meta: ObjectMeta, url: bool) -> str:
    """An object's <Contents> in a listing, rendered once (the broker lists the same
    record batches on every fetch)."""
    name = (meta.key, meta.etag, meta.mtime, url)
    if (rendered := _RENDERED.get(name)) is None:
        if len(_RENDERED) >= 500_000:
            _RENDERED.clear()
        key = quote(meta.key, safe="/") if url else meta.key
        modified = datetime.fromtimestamp(meta.mtime, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3]
        rendered = _RENDERED[name] = (
            f"<Contents><Key>{escape(key)}</Key><LastModified>{modified}Z"
            f"</LastModified><ETag>{escape(meta.etag)}</ETag><Size>{meta.size}</Size>"
            "<StorageClass>STANDARD</StorageClass></Contents>"
        )
    return rendered


def _delete_many(files: ObjectFiles, bucket: str, body: bytes) -> web.Response:
    try:
        root = ET.fromstring(body)
    except ET.ParseError:
        raise S3Error(400, "MalformedXML", "the Delete document is not XML") from None
    keys = [e.text or "" for e in root.iter() if e.tag.rsplit("}", 1)[-1] == "Key"]
    quiet = any(e.tag.endswith("Quiet") and (e.text or "").strip() == "true" for e in root.iter())
    if len(keys) > 1000:
        raise S3Error(400, "MalformedXML", "at most 1000 keys in one Delete")
    parts = [f'<DeleteResult xmlns="{S3_NS}">']
    for key in keys:
        try:
            files.delete(bucket, key)
            if not quiet:
                parts.append(f"<Deleted><Key>{escape(key)}</Key></Deleted>")
        except InvalidKey as e:
            parts.append(
                f"<Error><Key>{escape(key)}</Key><Code>InvalidArgument</Code>"
                f"<Message>{escape(str(e))}</Message></Error>"
            )
    parts.append("</DeleteResult>")
    return _xml(200, "".join(parts))


def _xml(status: int, document: str) -> web.Response:
    return web.Response(
        status=status, body=(XML_HEAD + document).encode(), content_type="application/xml"
    )


def _error(request: web.Request, status: int, code: str, message: str) -> web.Response:
    request_id = uuid.uuid4().hex[:16].upper()
    if request.method == "HEAD":  # no body; the status says it
        return web.Response(status=status, headers={"x-amz-request-id": request_id})
    document = (
        f"<Error><Code>{code}</Code><Message>{escape(message)}</Message>"
        f"<Resource>{escape(request.path)}</Resource><RequestId>{request_id}</RequestId></Error>"
    )
    response = _xml(status, document)
    response.headers["x-amz-request-id"] = request_id
    return response
