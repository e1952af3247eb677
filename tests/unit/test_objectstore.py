"""The object store's parts without a process: Signature V4 against AWS's own example, and
the files layer's keys, listing order and compare-and-swap."""

from __future__ import annotations

import threading
from datetime import UTC, datetime

import pytest

from rlnode.bus.objectstore.files import (
    ObjectFiles,
    Precondition,
    StoreBusy,
    decode_segment,
    encode_segment,
)
from rlnode.bus.objectstore.sigv4 import (
    Credentials,
    SignatureError,
    sign,
    verify,
    verify_payload,
)

# "Example: GET Object" of the S3 API reference (sig-v4-header-based-auth.html).
AWS = Credentials("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
AWS_WHEN = datetime(2013, 5, 24, tzinfo=UTC)
AWS_HEADERS = {
    "authorization": "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/"
    "aws4_request,SignedHeaders=host;range;x-amz-content-sha256;x-amz-date,"
    "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41",
    "host": "examplebucket.s3.amazonaws.com",
    "range": "bytes=0-9",
    "x-amz-content-sha256": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "x-amz-date": "20130524T000000Z",
}


def test_aws_example_signature_verifies() -> None:
    verify(AWS, "GET", "/test.txt", AWS_HEADERS, now=AWS_WHEN)


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"range": "bytes=0-10"}, "SignatureDoesNotMatch"),  # a signed header altered
        ({"authorization": ""}, "AccessDenied"),  # unsigned
        ({"x-amz-content-sha256": "0" * 64}, "SignatureDoesNotMatch"),  # the hash is signed
    ],
)
def test_an_altered_request_is_refused(change: dict[str, str], code: str) -> None:
    with pytest.raises(SignatureError) as refused:
        verify(AWS, "GET", "/test.txt", AWS_HEADERS | change, now=AWS_WHEN)
        verify_payload(AWS_HEADERS | change, b"")
    assert refused.value.code == code


def test_wrong_secret_late_request_and_other_key_are_refused() -> None:
    wrong = Credentials(AWS.access_key_id, "not-the-secret")
    with pytest.raises(SignatureError, match="does not match"):
        verify(wrong, "GET", "/test.txt", AWS_HEADERS, now=AWS_WHEN)
    with pytest.raises(SignatureError, match="15 minutes"):
        verify(AWS, "GET", "/test.txt", AWS_HEADERS, now=datetime(2013, 5, 25, tzinfo=UTC))
    other = Credentials("SOMEONEELSE", AWS.secret_access_key)
    with pytest.raises(SignatureError, match="access key id"):
        verify(other, "GET", "/test.txt", AWS_HEADERS, now=AWS_WHEN)


def test_sign_and_verify_agree_on_encoded_paths_and_queries() -> None:
    path = "/b/a%20key/with%2Bplus?list-type=2&prefix=a%2Fb&start-after="
    headers = sign(AWS, "PUT", "127.0.0.1:9", path, b"body", {"If-None-Match": "*"})
    verify(AWS, "PUT", path, headers)
    verify_payload(headers, b"body")
    with pytest.raises(SignatureError):
        verify(AWS, "PUT", path.replace("a%2Fb", "a%2Fc"), headers)
    with pytest.raises(SignatureError, match="not the one that was signed"):
        verify_payload(headers, b"other body")


def test_segments_round_trip_and_no_key_escapes_its_bucket(tmp_path) -> None:
    for segment in ("plain", "", ".", "..", "a%b", "ünï cødé", "x.batch"):
        assert decode_segment(encode_segment(segment)) == segment
    files = ObjectFiles(tmp_path)
    files.create_bucket("b")
    for key in ("../../escape", "/abs", "a/../../b", "./."):
        files.put("b", key, b"x", {})
    bucket = (tmp_path / "buckets" / "b").resolve()
    written = [p.resolve() for p in tmp_path.rglob("*") if p.is_file() and p.name != "lock"]
    assert all(bucket in p.parents for p in written)
    assert list(files.walk("b", "", "", group_dirs=False)) == sorted(
        ["../../escape", "/abs", "a/../../b", "./."]
    )


def test_listing_is_in_key_order_with_prefixes(tmp_path) -> None:
    files = ObjectFiles(tmp_path)
    files.create_bucket("b")
    keys = ["a/b", "a-c", "a", "a/c/d", "a/c/e", "b", "a/"]
    for key in keys:
        files.put("b", key, key.encode(), {})
    assert list(files.walk("b", "", "", group_dirs=False)) == sorted(keys)
    assert list(files.walk("b", "", "", group_dirs=True)) == ["a", "a-c", "a/", "b"]
    assert list(files.walk("b", "a/", "", group_dirs=True)) == ["a/", "a/b", "a/c/"]
    assert list(files.walk("b", "a/c", "a/c/d", group_dirs=False)) == ["a/c/e"]
    got = files.get("b", "a/c/d")
    assert got is not None
    with got[1] as body:
        assert (got[0].size, body.read()) == (5, b"a/c/d")


def test_a_listing_read_once_follows_later_writes_and_deletes(tmp_path) -> None:
    files = ObjectFiles(tmp_path)
    files.create_bucket("b")
    for key in ("r/1", "r/3"):
        files.put("b", key, b"x", {})
    assert list(files.walk("b", "r/", "", group_dirs=True)) == ["r/1", "r/3"]
    files.put("b", "r/2", b"x", {})
    files.put("b", "r/sub/4", b"x", {})
    files.delete("b", "r/1")
    files.put("b", "r/3", b"again", {})  # replaced: listed once
    assert list(files.walk("b", "r/", "", group_dirs=True)) == ["r/2", "r/3", "r/sub/"]
    assert list(files.walk("b", "r/", "r/2", group_dirs=False)) == ["r/3", "r/sub/4"]
    assert list(files.walk("b", "r/", "r/sub/", group_dirs=False)) == ["r/sub/4"]


def test_one_compare_and_swap_wins(tmp_path) -> None:
    files = ObjectFiles(tmp_path)
    files.create_bucket("b")
    first = files.put("b", "meta.json", b"v0", {}, if_none_match="*")
    with pytest.raises(Precondition):
        files.put("b", "meta.json", b"v1", {}, if_none_match="*")
    won: list[int] = []

    def writer(i: int) -> None:
        try:
            files.put("b", "meta.json", f"v{i}".encode(), {}, if_match=first.etag)
            won.append(i)
        except Precondition:
            pass

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(1, 17)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1
    got = files.get("b", "meta.json")
    assert got is not None
    with got[1] as body:
        assert body.read() == f"v{won[0]}".encode()
    assert list((tmp_path / "tmp").iterdir()) == []  # no temporary file left behind


def test_one_store_per_directory(tmp_path) -> None:
    serving = ObjectFiles(tmp_path)
    with pytest.raises(StoreBusy, match="another object store"):
        ObjectFiles(tmp_path)
    assert serving.bucket_exists("none") is False
