"""The embedded Tansu broker as a process: starts, serves aiokafka groups, stops, and says
clearly what is wrong when it cannot."""

from __future__ import annotations

import asyncio
import os
import stat

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from rlnode.bus.localbroker import BrokerBinaryMissing, BrokerStartError, LocalBroker, find_tansu


def test_tansu_comes_from_the_pinned_wheel() -> None:
    path = find_tansu()
    assert os.access(path, os.X_OK)
    assert "tansu" in os.path.basename(path)


def test_a_missing_binary_is_a_clear_error(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("RLNODE_TANSU_BIN", str(tmp_path / "no-such-tansu"))
    with pytest.raises(BrokerBinaryMissing, match=r"RLNODE_TANSU_BIN=.*not an executable"):
        LocalBroker().start()


def test_a_binary_that_dies_at_start_is_reported_with_its_log(monkeypatch, tmp_path) -> None:
    fake = tmp_path / "tansu"
    fake.write_text("#!/bin/sh\necho 'cannot bind: permission denied' >&2\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("RLNODE_TANSU_BIN", str(fake))
    with pytest.raises(BrokerStartError, match=r"exited with code 3(.|\n)*cannot bind"):
        LocalBroker(start_timeout_s=5).start()


def test_start_serve_a_consumer_group_and_stop(tmp_path) -> None:
    broker = LocalBroker(log_path=tmp_path / "tansu.log")
    with broker:
        assert broker.running
        pid = broker.pid

        async def roundtrip() -> bytes:
            producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap_servers)
            consumer = AIOKafkaConsumer(
                "scratch",
                bootstrap_servers=broker.bootstrap_servers,
                group_id="g",
                auto_offset_reset="earliest",
                session_timeout_ms=6000,
                heartbeat_interval_ms=2000,
            )
            await producer.start()
            await producer.send_and_wait("scratch", b"hello", key=b"k")
            await producer.stop()
            await consumer.start()
            try:
                record = await asyncio.wait_for(consumer.getone(), 30)
                await consumer.commit()
                return record.value
            finally:
                await consumer.stop()

        assert asyncio.run(roundtrip()) == b"hello"
    assert not broker.running
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert "listening on" in (tmp_path / "tansu.log").read_text()
