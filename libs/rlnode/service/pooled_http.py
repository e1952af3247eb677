"""The HTTP client of the rollout path: one rollout is three requests (generator -> gateway
-> Task App -> the generator's inference URL), hundreds in flight at once.

httpx is not used here: its connection pool walks every pooled connection, polling each
socket, on every request start and end, which was 57-65% of the gateway's, generator's and
Task App's event loops during a job (py-spy; bench/README.md). aiohttp's pool takes and
returns a connection in constant time and parses responses in C.

Failures come out as three exceptions a caller can act on: the connection could not be made
(safe to retry: nothing was sent), no answer in time, or the connection broke after the
request went out (not safe to retry: the other side may have acted on it)."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

# uvicorn closes a connection idle for 5 s. A client that keeps one that long can send a
# request down it as the server closes it, and gets no answer (httpx: ReadError); the
# clients of this codebase's services let theirs go sooner (httpx: keepalive_expiry).
IDLE_CONNECTION_S = 4.0


class HttpCallError(Exception):
    """An HTTP call that got no response; the message says where and why."""


class ConnectFailed(HttpCallError):
    """No connection could be made; nothing was sent."""


class TimedOut(HttpCallError):
    """No complete answer within the call's timeout."""


class ConnectionBroke(HttpCallError):
    """The connection failed after the request may have been sent."""


class Reply:
    __slots__ = ("content", "content_type", "status")

    def __init__(self, status: int, content: bytes, content_type: str) -> None:
        self.status = status
        self.content = content
        self.content_type = content_type

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body as JSON; ValueError (orjson.JSONDecodeError) when it is not."""
        return orjson.loads(self.content)


class PooledHttp:
    """A pooled client for many concurrent JSON calls to a few hosts.

    The aiohttp session is made on first use, inside the running event loop, and belongs to
    that loop. Idle connections are dropped after `keepalive_s`: below uvicorn's 5 s, so a
    connection the server is about to close is not taken for a new request."""

    def __init__(
        self,
        base_url: str | None = None,
        *,
        max_connections: int = 1024,
        connect_timeout_s: float = 10.0,
        keepalive_s: float = IDLE_CONNECTION_S,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/") if base_url else None
        self.max_connections = max_connections
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self.headers = dict(headers or {})
        self._session: aiohttp.ClientSession | None = None

    def _session_now(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self.max_connections,
                    keepalive_timeout=self.keepalive_s,
                    # Loopback and cluster-internal names: no DNS cache surprises.
                    use_dns_cache=False,
                ),
                headers=self.headers,
            )
        return self._session

    def _url(self, url: str) -> str:
        if self.base_url and not url.startswith(("http://", "https://")):
            return self.base_url + url
        return url

    async def request(
        self,
        method: str,
        url: str,
        *,
        timeout_s: float,
        json: Any = None,
        params: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        connect_timeout_s: float | None = None,
    ) -> Reply:
        url = self._url(url)
        connect = min(connect_timeout_s or self.connect_timeout_s, timeout_s)
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect)
        data = None
        send_headers = dict(headers or {})
        if json is not None:
            data = orjson.dumps(json)
            send_headers.setdefault("Content-Type", "application/json")
        try:
            async with self._session_now().request(
                method,
                url,
                data=data,
                params=params,
                headers=send_headers,
                timeout=timeout,
                allow_redirects=False,
            ) as response:
                content = await response.read()
                return Reply(response.status, content, response.content_type)
        except aiohttp.ConnectionTimeoutError:
            raise ConnectFailed(f"cannot connect to {url} within {connect:g}s") from None
        except aiohttp.ClientConnectorError as e:
            raise ConnectFailed(f"cannot connect to {url}: {e.os_error or e}") from None
        except TimeoutError:
            raise TimedOut(f"{method} {url} got no answer within {timeout_s:g}s") from None
        except aiohttp.InvalidURL as e:
            raise ConnectFailed(f"{url} is not a valid URL: {e}") from None
        except (aiohttp.ClientError, OSError) as e:
            raise ConnectionBroke(
                f"{method} {url}: the connection broke: {type(e).__name__}: {e}"
            ) from None

    async def post(self, url: str, *, json: Any, timeout_s: float, **kwargs: Any) -> Reply:
        return await self.request("POST", url, json=json, timeout_s=timeout_s, **kwargs)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
