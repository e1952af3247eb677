"""The object store as the broker uses it, over HTTP: conditional PUTs answer 412 when
they do not hold, requests not signed with the node's key get 403, and what a PUT answered
is there (same bytes, same ETag) after the process is SIGKILLed and started again."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from urllib.parse import quote

import httpx
import pytest

from rlnode.bus.objectstore import BUCKET, Credentials, LocalObjectStore
from rlnode.bus.objectstore.sigv4 import sign


class S3:
    """Signed requests to the store (path-style, as object_store sends them)."""

    def __init__(self, store: LocalObjectStore, credentials: Credentials | None = None) -> None:
        self.store = store
        self.credentials = credentials or store.credentials
        self.http = httpx.Client()

    def __call__(
        self, method: str, key: str = "", query: str = "", body: bytes = b"", **headers: str
    ) -> httpx.Response:
        path = f"/{BUCKET}/{quote(key, safe='/~')}" + (f"?{query}" if query else "")
        named = {k.replace("_", "-"): v for k, v in headers.items()}
        signed = sign(
            self.credentials, method, f"{self.store.host}:{self.store.port}", path, body, named
        )
        return self.http.request(method, self.store.url + path, content=body, headers=signed)


@pytest.fixture
def store(tmp_path) -> Iterator[LocalObjectStore]:
    with LocalObjectStore(tmp_path / "objects", log_path=tmp_path / "objectstore.log") as running:
        yield running


def test_conditional_puts_are_a_compare_and_swap(store) -> None:
    s3 = S3(store)
    created = s3("PUT", "clusters/c/meta.json", body=b"v1", If_None_Match="*")
    assert created.status_code == 200
    etag = created.headers["etag"]
    again = s3("PUT", "clusters/c/meta.json", body=b"v2", If_None_Match="*")
    assert again.status_code == 412 and "<Code>PreconditionFailed</Code>" in again.text
    stale = s3("PUT", "clusters/c/meta.json", body=b"v2", If_Match='"0123"')
    assert stale.status_code == 412
    updated = s3("PUT", "clusters/c/meta.json", body=b"v2", If_Match=etag)
    assert updated.status_code == 200 and updated.headers["etag"] != etag
    assert s3("PUT", "clusters/c/meta.json", body=b"v3", If_Match=etag).status_code == 412
    assert s3("GET", "clusters/c/meta.json").content == b"v2"
    # A conditional GET answers 304 while the ETag is current (the broker's metadata cache).
    assert (
        s3("GET", "clusters/c/meta.json", If_None_Match=updated.headers["etag"]).status_code == 304
    )
    missing = s3("PUT", "clusters/c/other.json", body=b"x", If_Match=etag)
    assert missing.status_code == 412


def test_get_head_range_list_and_delete(store) -> None:
    s3 = S3(store)
    for i in range(5):
        key = f"t/partitions/0/records/{i:020}.batch"
        assert s3("PUT", key, body=b"0123456789", content_type="application/x").status_code == 200
    assert s3("PUT", "t/partitions/0/watermark.json", body=b"{}").status_code == 200
    head = s3("HEAD", "t/partitions/0/watermark.json")
    assert head.status_code == 200 and head.headers["content-length"] == "2"
    assert "last-modified" in head.headers
    part = s3("GET", "t/partitions/0/records/00000000000000000001.batch", Range="bytes=2-4")
    assert part.status_code == 206 and part.content == b"234"
    assert part.headers["content-range"] == "bytes 2-4/10"
    assert part.headers["content-type"] == "application/x"
    page = s3("GET", query="list-type=2&max-keys=2&prefix=t%2Fpartitions%2F0%2Frecords%2F")
    assert "<IsTruncated>true</IsTruncated>" in page.text and page.text.count("<Key>") == 2
    token = page.text.split("<NextContinuationToken>")[1].split("<")[0]
    rest = s3("GET", query=f"list-type=2&prefix=t%2F&continuation-token={quote(token, safe='')}")
    assert rest.text.count("<Key>") == 4  # three records and the watermark
    grouped = s3("GET", query="list-type=2&delimiter=%2F&prefix=t%2Fpartitions%2F0%2F")
    assert "<Prefix>t/partitions/0/records/</Prefix>" in grouped.text
    assert "<Key>t/partitions/0/watermark.json</Key>" in grouped.text
    document = b"<Delete><Object><Key>t/partitions/0/watermark.json</Key></Object></Delete>"
    assert s3("POST", query="delete", body=document).status_code == 200
    assert s3("GET", "t/partitions/0/watermark.json").status_code == 404
    assert s3("DELETE", "t/partitions/0/records/00000000000000000000.batch").status_code == 204
    multipart = s3("POST", "big", query="uploads")
    assert multipart.status_code == 501 and "uploads" in multipart.text


def test_unsigned_or_wrongly_signed_requests_are_refused(store) -> None:
    S3(store)("PUT", "secret", body=b"records")
    unsigned = httpx.get(f"{store.url}/{BUCKET}/secret")
    assert unsigned.status_code == 403 and "AccessDenied" in unsigned.text
    forged = Credentials(store.credentials.access_key_id, "guessed")
    assert S3(store, forged)("GET", "secret").status_code == 403
    assert S3(store, forged)("PUT", "secret", body=b"overwritten").status_code == 403
    assert S3(store)("GET", "secret").content == b"records"
    # The key is the node's secret: a file only its owner reads.
    assert os.stat(store.credentials_path).st_mode & 0o077 == 0


def test_what_a_put_answered_survives_a_sigkill(store) -> None:
    s3 = S3(store)
    etags = {
        f"k/{i}": s3("PUT", f"k/{i}", body=f"value {i}".encode()).headers["etag"] for i in range(20)
    }
    assert store.pid is not None
    os.kill(store.pid, signal.SIGKILL)
    store.stop()
    store.start()
    for key, etag in etags.items():
        got = s3("GET", key)
        assert got.status_code == 200 and got.headers["etag"] == etag
        assert got.content == f"value {key[2:]}".encode()
