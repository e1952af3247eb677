"""rlnode.service.pooled_http against real sockets on loopback: what each failure is called decides
whether the gateway retries a rollout, so each one is produced for real here."""

from __future__ import annotations

import asyncio
import contextlib

import orjson
import pytest

from rlnode.bus.localbroker import free_port
from rlnode.service.pooled_http import ConnectFailed, ConnectionBroke, PooledHttp, TimedOut


@contextlib.asynccontextmanager
async def raw_server(handle):
    """A TCP server on loopback whose every connection is given to `handle(reader, writer)`."""

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handle(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


async def read_request(reader: asyncio.StreamReader) -> tuple[str, dict[str, str], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return lines[0], headers, body


def http_response(status: int, body: bytes, content_type: str = "application/json") -> bytes:
    return (
        f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def test_posts_json_and_reuses_one_connection_for_sequential_calls():
    connections = 0
    seen = []

    async def echo(reader, writer):
        nonlocal connections
        connections += 1
        while True:
            try:
                line, headers, body = await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            seen.append((line, headers, body))
            writer.write(http_response(200, orjson.dumps({"got": orjson.loads(body)})))
            await writer.drain()

    async with raw_server(echo) as url:
        http = PooledHttp(url, headers={"Authorization": "Bearer t"})
        try:
            for i in range(3):
                reply = await http.post("/v1/x", json={"i": i}, timeout_s=5)
                assert reply.status == 200
                assert reply.json() == {"got": {"i": i}}
        finally:
            await http.aclose()
    assert connections == 1
    line, headers, _ = seen[0]
    assert line == "POST /v1/x HTTP/1.1"
    assert headers["content-type"] == "application/json"
    assert headers["authorization"] == "Bearer t"


async def test_error_statuses_come_back_as_replies_not_exceptions():
    async def refuse(reader, writer):
        await read_request(reader)
        writer.write(http_response(401, b"invalid API key", "text/plain"))
        await writer.drain()

    async with raw_server(refuse) as url:
        http = PooledHttp()
        try:
            reply = await http.request("GET", url + "/health", timeout_s=5)
        finally:
            await http.aclose()
    assert (reply.status, reply.text, reply.content_type) == (401, "invalid API key", "text/plain")
    with pytest.raises(ValueError):
        reply.json()


async def test_a_closed_port_is_connect_failed():
    http = PooledHttp()
    try:
        with pytest.raises(ConnectFailed, match=r"cannot connect to http://127\.0\.0\.1:"):
            await http.post(f"http://127.0.0.1:{free_port()}/rollout", json={}, timeout_s=5)
    finally:
        await http.aclose()


async def test_no_answer_in_time_is_timed_out():
    async def silent(reader, _writer):
        await read_request(reader)
        await asyncio.sleep(10)

    async with raw_server(silent) as url:
        http = PooledHttp()
        try:
            with pytest.raises(TimedOut, match=r"POST .*/rollout got no answer within 0.3s"):
                await http.post(url + "/rollout", json={}, timeout_s=0.3)
        finally:
            await http.aclose()


async def test_a_connection_closed_after_the_request_is_connection_broke():
    async def hang_up(reader, _writer):
        await read_request(reader)  # the request arrived: the server may have acted on it

    async with raw_server(hang_up) as url:
        http = PooledHttp()
        try:
            with pytest.raises(ConnectionBroke, match="the connection broke"):
                await http.post(url + "/rollout", json={}, timeout_s=5)
        finally:
            await http.aclose()


async def test_a_truncated_body_is_connection_broke():
    async def truncate(reader, writer):
        await read_request(reader)
        writer.write(http_response(200, b'{"reward": 1.0}')[:-5])
        await writer.drain()

    async with raw_server(truncate) as url:
        http = PooledHttp()
        try:
            with pytest.raises(ConnectionBroke):
                await http.post(url + "/rollout", json={}, timeout_s=5)
        finally:
            await http.aclose()


async def test_many_concurrent_calls_share_a_bounded_pool():
    open_now = 0
    most = 0

    async def slow_echo(reader, writer):
        nonlocal open_now, most
        open_now += 1
        most = max(most, open_now)
        try:
            while True:
                try:
                    _, _, body = await read_request(reader)
                except asyncio.IncompleteReadError:
                    return
                await asyncio.sleep(0.01)
                writer.write(http_response(200, body))
                await writer.drain()
        finally:
            open_now -= 1

    async with raw_server(slow_echo) as url:
        http = PooledHttp(url, max_connections=8)
        try:
            replies = await asyncio.gather(
                *(http.post("/", json={"i": i}, timeout_s=10) for i in range(100))
            )
        finally:
            await http.aclose()
    assert [r.json()["i"] for r in replies] == list(range(100))
    assert most <= 8
