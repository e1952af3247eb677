"""A file served over HTTP in one byte range or whole, streamed from a handle opened before
the answer starts (a file unlinked meanwhile is still read to its end), with a strong ETag
so a client resuming a download knows it resumes the same bytes.

One range per request: `bytes=N-M`, `bytes=N-` or `bytes=-N` (RFC 9110 §14.1.2). A range
that is malformed, names several ranges or starts past the end gets 416 with
`Content-Range: bytes */<size>`; an `If-Range` that is not this ETag gets the whole file
(200), as the RFC has it."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import BinaryIO

import anyio.to_thread
from fastapi.responses import JSONResponse, Response, StreamingResponse

CHUNK = 1 << 20
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


class RangeNotSatisfiable(Exception):
    """The Range header asks for nothing this server can send of a file of `size` bytes."""

    def __init__(self, size: int, why: str) -> None:
        super().__init__(why)
        self.size = size
        self.why = why


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The half-open span [start, end) a Range header asks for in a file of `size` bytes,
    or None for the whole file (no header). Raises RangeNotSatisfiable."""
    if header is None:
        return None
    found = _RANGE.match(header.strip().replace(" ", ""))
    if found is None:
        raise RangeNotSatisfiable(
            size, "send one range of bytes: bytes=START-END, bytes=START- or bytes=-LENGTH"
        )
    first, last = found.groups()
    if not first and not last:
        raise RangeNotSatisfiable(size, "bytes=- names no byte")
    if not first:  # the last `last` bytes
        length = int(last)
        if length == 0 or size == 0:
            raise RangeNotSatisfiable(size, "a range of no bytes")
        return max(0, size - length), size
    start = int(first)
    end = size if not last else min(int(last) + 1, size)
    if last and int(last) < start:
        raise RangeNotSatisfiable(size, f"the range ends ({last}) before it starts ({start})")
    if start >= size:
        raise RangeNotSatisfiable(size, f"the range starts at {start}; the file has {size} bytes")
    return start, end


def quoted_etag(digest: str) -> str:
    return f'"{digest}"'


def ranged_file(
    file: BinaryIO,
    size: int,
    etag: str,
    range_header: str | None,
    if_range: str | None = None,
    media_type: str = "application/octet-stream",
) -> Response:
    """The answer to a GET of `file` (open, `size` bytes, closed once sent or refused):
    200 with all of it, 206 with the range asked for, or 416. `etag` is quoted already."""
    if if_range is not None and if_range.strip() != etag:
        range_header = None  # the client holds other bytes: it gets these whole
    try:
        span = byte_range(range_header, size)
    except RangeNotSatisfiable as e:
        file.close()
        return JSONResponse(
            {"detail": f"range not satisfiable: {e.why}"},
            status_code=416,
            headers={"Content-Range": f"bytes */{e.size}"},
        )
    headers = {"Accept-Ranges": "bytes", "ETag": etag, "Cache-Control": "no-store"}
    start, end = span if span is not None else (0, size)
    headers["Content-Length"] = str(end - start)
    if span is not None:
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
    return StreamingResponse(
        _read(file, start, end),
        status_code=206 if span is not None else 200,
        headers=headers,
        media_type=media_type,
    )


async def _read(file: BinaryIO, start: int, end: int) -> AsyncIterator[bytes]:
    """The bytes [start, end) of `file`, a chunk at a time, read off the event loop."""
    try:
        await anyio.to_thread.run_sync(file.seek, start)
        left = end - start
        while left > 0:
            chunk = await anyio.to_thread.run_sync(file.read, min(CHUNK, left))
            if not chunk:  # the file shrank under us: the client sees a short body
                return
            left -= len(chunk)
            yield chunk
    finally:
        file.close()
