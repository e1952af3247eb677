"""A managed Task App that, while it runs a rollout of its own org's job, tries everything
on the machine it runs on: every listening TCP port (read from /proc/net/tcp and tcp6)
with a raw connect, then HTTP and a Kafka client on whatever answered; the node's broker
as a Kafka client (reading `rlnode.job-events` and `rlnode.trajectories`, joining the
`learner` group); the learner's weight route and the vault over HTTP. It reports one JSON line (`SCAN {...}`) on stdout and then plays the copy task
honestly, so its own job trains.

Run by tests/security/test_taskapp_network.py; reads TARGET_* from its registration env."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

from rlnode.examples.taskapps import copy_task
from rlnode.taskapp import TaskAppDefinition, serve, single_turn
from rlnode.taskapp.server import Episode

LISTEN = "0A"


def listening() -> list[tuple[str, int]]:
    """(address to try, port) of every listening TCP socket on the machine."""
    found = set()
    for path, family in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 6)):
        try:
            lines = open(path).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state = fields[1], fields[3]
            if state != LISTEN:
                continue
            hex_address, hex_port = local.split(":")
            port = int(hex_port, 16)
            if family == 4:
                raw = bytes.fromhex(hex_address)[::-1]
                address = socket.inet_ntop(socket.AF_INET, raw)
                address = "127.0.0.1" if address == "0.0.0.0" else address
            else:
                raw = b"".join(bytes.fromhex(hex_address[i : i + 8])[::-1] for i in range(0, 32, 8))
                address = socket.inet_ntop(socket.AF_INET6, raw)
                address = "::1" if address == "::" else address
            found.add((address, port))
    return sorted(found)


def connects(address: str, port: int) -> str | None:
    """None if a TCP connection is made, else why not."""
    try:
        socket.create_connection((address, port), timeout=2).close()
        return None
    except OSError as e:
        return type(e).__name__


def http_status(url: str) -> int | str:
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except Exception as e:  # whatever a port that is not HTTP answers
        return type(e).__name__


async def kafka_reads(bootstrap: str, topic: str, group: str | None) -> str:
    """'read N records' or why not."""
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=group,
        auto_offset_reset="earliest",
        request_timeout_ms=5000,
        session_timeout_ms=6000,
        heartbeat_interval_ms=2000,
    )
    try:
        await asyncio.wait_for(consumer.start(), 10)
        batches = await consumer.getmany(timeout_ms=3000)
        return f"read {sum(len(b) for b in batches.values())} records"
    except Exception as e:
        return f"failed: {type(e).__name__}"
    finally:
        try:
            await asyncio.wait_for(consumer.stop(), 5)
        except Exception:
            pass


async def probe(inference_url: str) -> dict[str, Any]:
    env = os.environ
    ports = listening()
    reached = []
    refused = {}
    for address, port in ports:
        why = await asyncio.to_thread(connects, address, port)
        if why is None:
            reached.append([address, port])
        else:
            refused[f"{address}:{port}"] = why
    answered = {}
    for address, port in reached:
        host = f"[{address}]" if ":" in address else address
        answered[f"{address}:{port}"] = {
            "http": await asyncio.to_thread(http_status, f"http://{host}:{port}/"),
            "kafka": await kafka_reads(f"{host}:{port}", "rlnode.job-events", None),
        }
    bootstrap = env["TARGET_BOOTSTRAP"]
    return {
        "uid": os.getuid(),
        "inference_url": inference_url,
        "inference_port": urlsplit(inference_url).port,
        "own_port": int(env["PORT"]),
        "listening": [[a, p] for a, p in ports],
        "reached": reached,
        "refused": refused,
        "answered": answered,
        "job_events": await kafka_reads(bootstrap, "rlnode.job-events", None),
        "trajectories": await kafka_reads(bootstrap, "rlnode.trajectories", None),
        "learner_group": await kafka_reads(bootstrap, "rlnode.trajectories", "learner"),
        "weights": http_status(env["TARGET_WEIGHTS_URL"]),
        "vault": http_status(env["TARGET_VAULT_URL"] + "/health"),
    }


_scanned = asyncio.Lock()
_done = False
_play = single_turn(copy_task.prompt, copy_task.reward)


async def run_episode(task: dict[str, Any], episode: Episode) -> None:
    global _done
    async with _scanned:
        if not _done:
            report = await probe(episode.request.policy.config.inference_url)
            print("SCAN " + json.dumps(report), flush=True)
            _done = True
    await _play(task, episode)


DEFINITION = TaskAppDefinition(
    name="scanner",
    description="The copy task, played after a scan of the machine.",
    make_task=copy_task.make_task,
    run_episode=run_episode,
)

if __name__ == "__main__":
    sys.exit(serve(DEFINITION))
