"""One byte range of a file (rlnode.service.ranges): what a Range header asks for, and what a
client that resumes a download gets back."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi import FastAPI, Header
from fastapi.testclient import TestClient

from rlnode.service.ranges import RangeNotSatisfiable, byte_range, quoted_etag, ranged_file


@pytest.mark.parametrize(
    ("header", "span"),
    [
        (None, None),
        ("bytes=0-", (0, 100)),
        ("bytes=10-", (10, 100)),
        ("bytes=10-19", (10, 20)),
        ("bytes=99-99", (99, 100)),
        ("bytes=90-500", (90, 100)),  # past the end: to the end
        ("bytes=-10", (90, 100)),  # the last ten
        ("bytes=-500", (0, 100)),
        (" bytes = 5 - 6 ", (5, 7)),
    ],
)
def test_a_range_header_names_a_half_open_span(header, span) -> None:
    assert byte_range(header, 100) == span


@pytest.mark.parametrize(
    "header",
    [
        "bytes=100-",  # starts at the end
        "bytes=200-300",
        "bytes=20-10",  # ends before it starts
        "bytes=-0",
        "bytes=-",
        "bytes=0-1,5-6",  # several ranges: one is served
        "items=0-1",
        "bytes=a-b",
        "0-10",
        "",
    ],
)
def test_a_range_this_file_cannot_give_is_not_satisfiable(header) -> None:
    with pytest.raises(RangeNotSatisfiable) as refused:
        byte_range(header, 100)
    assert refused.value.size == 100 and refused.value.why


def test_an_empty_file_has_no_range() -> None:
    assert byte_range(None, 0) is None
    for header in ("bytes=0-", "bytes=-1"):
        with pytest.raises(RangeNotSatisfiable):
            byte_range(header, 0)


@pytest.fixture
def client(tmp_path: Path) -> TestClient:
    data = bytes(range(256)) * 4096  # 1 MiB, more than one read
    path = tmp_path / "blob"
    path.write_bytes(data)
    app = FastAPI()

    @app.get("/blob")
    async def blob(
        range_: str | None = Header(None, alias="Range"),
        if_range: str | None = Header(None, alias="If-Range"),
    ):
        return ranged_file(path.open("rb"), len(data), quoted_etag("d" * 64), range_, if_range)

    client = TestClient(app)
    client.data = data  # type: ignore[attr-defined]
    return client


def test_the_whole_file_then_its_rest_from_where_a_download_broke(client) -> None:
    data = client.data
    whole = client.get("/blob")
    assert whole.status_code == 200 and whole.content == data
    assert whole.headers["etag"] == quoted_etag("d" * 64)
    assert whole.headers["accept-ranges"] == "bytes"
    assert whole.headers["content-length"] == str(len(data))
    rest = client.get("/blob", headers={"Range": "bytes=1000-", "If-Range": quoted_etag("d" * 64)})
    assert rest.status_code == 206 and rest.content == data[1000:]
    assert rest.headers["content-range"] == f"bytes 1000-{len(data) - 1}/{len(data)}"
    middle = client.get("/blob", headers={"Range": "bytes=3-5"})
    assert middle.status_code == 206 and middle.content == data[3:6]


def test_other_bytes_held_by_the_client_get_the_whole_file(client) -> None:
    """If-Range naming another ETag: the client resumes a different file, so it gets this
    one whole rather than a mix of two."""
    answer = client.get("/blob", headers={"Range": "bytes=1000-", "If-Range": '"other"'})
    assert answer.status_code == 200 and answer.content == client.data


def test_an_unsatisfiable_range_is_416_with_the_size(client) -> None:
    size = len(client.data)
    for header in (f"bytes={size}-", "bytes=0-1,4-5", "bytes=x-"):
        answer = client.get("/blob", headers={"Range": header})
        assert answer.status_code == 416, header
        assert answer.headers["content-range"] == f"bytes */{size}"
        assert "range not satisfiable" in answer.json()["detail"]
