"""How a node's services are, from their health routes now: `rlnode status` and the
dashboard's node view ask the same way, every service at once."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

TIMEOUT_S = 2.0


async def services_health(services: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each service of node.json (`services`), with `healthy` and, when not, `problem`: its
    health route's own reason, or why it did not answer."""
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
        return list(await asyncio.gather(*(_health(client, key, s) for key, s in services.items())))


async def _health(client: httpx.AsyncClient, key: str, service: dict[str, Any]) -> dict:
    healthy, problem = False, None
    try:
        response = await client.get(service["health"])
        healthy = response.status_code == 200
        if not healthy:
            body = response.json()
            detail = body.get("detail") if isinstance(body, dict) else None
            problem = str(detail) if detail else f"HTTP {response.status_code}"
    except (httpx.HTTPError, ValueError) as e:
        problem = f"no answer: {type(e).__name__}"
    return {"service": key, **service, "healthy": healthy, "problem": problem}
