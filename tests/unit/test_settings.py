from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from rlnode.bus.settings import KafkaSettings
from rlnode.service.db import normalise_url, redacted_url
from rlnode.service.settings import DatabaseSettings, NodeSettings


def test_kafka_settings_come_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", " kafka-1:9092,kafka-2:9092 ")
    monkeypatch.setenv("KAFKA_PARTITIONS", "6")
    monkeypatch.setenv("KAFKA_COMPRESSION", "gzip")
    settings = KafkaSettings()
    assert settings.bootstrap_servers == "kafka-1:9092,kafka-2:9092"
    assert settings.partitions == 6 and settings.compression == "gzip"


def test_kafka_settings_refuse_nonsense(monkeypatch) -> None:
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "   ")
    with pytest.raises(ValidationError, match="KAFKA_BOOTSTRAP_SERVERS is empty"):
        KafkaSettings()
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS")
    with pytest.raises(ValidationError, match="at most a third of KAFKA_SESSION_TIMEOUT_MS"):
        KafkaSettings(session_timeout_ms=6000, heartbeat_interval_ms=3000)
    with pytest.raises(ValidationError):
        KafkaSettings(compression="brotli")


def test_database_defaults_to_sqlite_under_the_data_dir(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RLNODE_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    assert (
        DatabaseSettings().url_for("credential-vault")
        == f"sqlite:///{tmp_path}/db/credential-vault.sqlite3"
    )
    assert NodeSettings().checkpoint_dir == tmp_path / "checkpoints"
    monkeypatch.setenv("DATABASE_URL", "postgresql://u:p@db:5432/rlnode")
    assert DatabaseSettings().url_for("credential-vault") == "postgresql://u:p@db:5432/rlnode"


def test_database_urls_are_normalised_and_redacted() -> None:
    assert normalise_url("postgres://u:p@h/d") == "postgresql+psycopg://u:p@h/d"
    assert normalise_url("postgresql://u@h/d") == "postgresql+psycopg://u@h/d"
    assert normalise_url("sqlite:///x.db") == "sqlite:///x.db"
    assert "hunter2" not in redacted_url("postgresql://u:hunter2@h/d")


def test_a_generator_spreads_over_the_gateways_it_is_given(monkeypatch) -> None:
    from rlnode_services.rollout_generator.settings import GeneratorSettings

    monkeypatch.setenv("GENERATOR_GATEWAY_URL", " http://127.0.0.1:8110/, http://127.0.0.1:8111")
    assert GeneratorSettings().gateway_urls == ["http://127.0.0.1:8110", "http://127.0.0.1:8111"]
    for bad, says in ((" , ", "name the taskapp-gateway"), ("127.0.0.1:8110", "not an http")):
        monkeypatch.setenv("GENERATOR_GATEWAY_URL", bad)
        with pytest.raises(ValidationError, match=says):
            GeneratorSettings()


def test_the_parity_probe_allows_half_precision_its_rounding(monkeypatch) -> None:
    from rlnode_services.rollout_generator.settings import GeneratorSettings

    for dtype, device, tolerance in (
        ("auto", "cpu", 1e-3),
        ("float32", "cuda", 1e-3),
        ("auto", "cuda:0", 0.5),
        ("bfloat16", "cpu", 0.5),
        ("float16", "cuda", 0.5),
    ):
        monkeypatch.setenv("GENERATOR_DTYPE", dtype)
        monkeypatch.setenv("GENERATOR_DEVICE", device)
        assert GeneratorSettings().parity_tolerance == tolerance, (dtype, device)
    monkeypatch.setenv("GENERATOR_PROBE_TOLERANCE", "0.01")
    assert GeneratorSettings().parity_tolerance == 0.01
    monkeypatch.setenv("GENERATOR_PROBE_TOLERANCE", "0")
    with pytest.raises(ValidationError, match="greater than 0"):
        GeneratorSettings()


def test_a_cpu_generates_in_bf16_only_where_it_computes_it_natively(tmp_path: Path) -> None:
    from rlnode.engine.precision import cpu_generation_dtype, cpu_has_native_bf16

    cpuinfo = tmp_path / "cpuinfo"
    flags = "fpu sse2 avx2 avx512f avx512bw"
    for extra, native in (("", False), (" avx512_bf16", True), (" amx_tile amx_bf16", True)):
        cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}{extra}\nbugs\t\t: spectre\n")
        assert cpu_has_native_bf16(cpuinfo) is native, extra
        assert cpu_generation_dtype(cpuinfo) == ("bfloat16" if native else "float32")
    cpuinfo.write_text("processor\t: 0\n")  # no flags line (another architecture)
    assert cpu_generation_dtype(cpuinfo) == "float32"
    assert cpu_generation_dtype(tmp_path / "missing") == "float32"
