"""Jobs from Python: start one, cancel it, follow its events. Talks to the broker (the
learner owns jobs and answers on the job-events topic), so anything that reaches Kafka can
run jobs; and to the vault, once per request, for the job token the request carries (the org
token never goes on Kafka).

    async with JobsClient(org_id, token) as jobs:
        job_id = await jobs.start(config)
        async for event in jobs.events(job_id):
            print(event.type, event.message)
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlnode.bus import Bus
from rlnode.bus.acls import org_user
from rlnode.bus.reader import RecentIds, TopicReader
from rlnode.bus.settings import KafkaSettings
from rlnode.bus.signing import RecordRefused, RecordVerifier
from rlnode.messages import JobConfig, JobEvent, JobEventType, JobRequest, ends_the_job, topics
from rlnode.messages.codec import DecodeError, decode
from rlnode.messages.config import EvalSpec
from rlnode.sdk import local_node
from rlnode.sdk.http import service_url
from rlnode.sdk.vault import VaultClient
from rlnode.service.auth import VaultTokenVerifier
from rlnode.service.registry import VAULT

if TYPE_CHECKING:
    from aiokafka.structs import ConsumerRecord

log = logging.getLogger("rlnode.sdk.jobs")


class JobError(RuntimeError):
    """The job ended without completing, or never started; `event` says how."""

    def __init__(self, message: str, event: JobEvent | None = None) -> None:
        super().__init__(message)
        self.event = event


# A job id rlnode makes says when it was made (UTC), so that its events are read from then
# on rather than from the start of the topic's history.
_JOB_ID_TIME = "%Y%m%d-%H%M%S"
_MADE_JOB_ID = re.compile(r"^job-(\d{8}-\d{6})-[0-9a-f]{8}$")
# How far the clock of the host that made the id may be ahead of the broker's.
JOB_CLOCK_SKEW_S = 300.0


def new_job_id() -> str:
    made = datetime.now(UTC).strftime(_JOB_ID_TIME)
    return f"job-{made}-{uuid.uuid4().hex[:8]}"


def job_made_at(job_id: str) -> float | None:
    """When rlnode made `job_id` (epoch seconds); None for an id of the user's own."""
    match = _MADE_JOB_ID.match(job_id)
    if match is None:
        return None
    try:
        made = datetime.strptime(match.group(1), _JOB_ID_TIME).replace(tzinfo=UTC)
    except ValueError:
        return None
    return made.timestamp()


def evaluation_job(config: JobConfig, checkpoint: Path, spec: EvalSpec) -> JobConfig:
    """A job that trains nothing and evaluates `checkpoint` (a directory in HF format, such
    as one of the org's checkpoints) as `spec` says, with the Task App and sampling of
    `config` (the config of the job that made it)."""
    data = config.model_dump(mode="json")
    data["name"] = f"eval of {checkpoint.name}" + (f" ({config.name})" if config.name else "")
    data["model"] = {**data["model"], "source": str(checkpoint), "tokenizer": None}
    data["training"] = {**data["training"], "steps": 0}
    data["eval"] = spec.model_dump(mode="json")
    return JobConfig.model_validate(data)


def load_config(path: Path) -> JobConfig:
    """A job config from a TOML or JSON file, validated (errors name the field)."""
    return parse_config(path.read_text(), toml=path.suffix.lower() == ".toml")


def parse_config(text: str, *, toml: bool) -> JobConfig:
    """A job config from TOML or JSON text: ValueError on a syntax error (tomllib's names
    the line), pydantic's ValidationError naming each field that is wrong."""
    if toml:
        import tomllib

        return JobConfig.model_validate(tomllib.loads(text))
    return JobConfig.model_validate_json(text)


class JobsClient:
    def __init__(
        self,
        org_id: str,
        token: str,
        kafka: KafkaSettings | None = None,
        service: str = "sdk",
        vault_url: str | None = None,
    ) -> None:
        """`token`: the org token, which stays here (each request carries a job token minted
        from it); `vault_url`: default RLNODE_VAULT_URL or the local vault."""
        self.org_id = org_id
        self.token = token
        self.vault_url = service_url(VAULT, vault_url)
        self.kafka = kafka or local_node.kafka_settings()
        # Logged in as the org's own Kafka user (rlnode kafka-credentials), its events are on
        # the org's topic: the shared one is not the org's to read.
        own = self.kafka.sasl_username == org_user(org_id)
        self.events_topic = topics.org_events(org_id) if own else topics.JOB_EVENTS
        # Events are taken only from the services that may produce them (anyone who can
        # write to the topic could forge one).
        self._verifier = RecordVerifier(VaultTokenVerifier(self.vault_url))
        self._bus = Bus(self.kafka, service=service)
        self._started = False

    async def __aenter__(self) -> JobsClient:
        return self

    async def __aexit__(self, *_exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        if self._started:
            await self._bus.stop()
            self._started = False

    async def _publish(self, request: JobRequest) -> None:
        if not self._started:
            await self._bus.start()
            self._started = True
        await self._bus.publish(request)

    async def job_token(self, job_id: str) -> str:
        """A single-use token for one request about `job_id`, from the vault."""

        def mint() -> str:
            with VaultClient(self.vault_url, self.token) as vault:
                return vault.create_job_token(job_id, self.org_id)

        return await asyncio.to_thread(mint)

    async def start(self, config: JobConfig, job_id: str | None = None) -> str:
        """Publish a start request; returns the job id (the learner answers on job-events)."""
        job_id = job_id or new_job_id()
        token = await self.job_token(job_id)
        await self._publish(
            JobRequest(job_id=job_id, org_id=self.org_id, token=token, config=config)
        )
        return job_id

    async def cancel(self, job_id: str, reason: str | None = None) -> None:
        token = await self.job_token(job_id)
        await self._publish(
            JobRequest(
                job_id=job_id, org_id=self.org_id, token=token, action="cancel", reason=reason
            )
        )

    async def events(
        self,
        job_id: str,
        *,
        follow: bool = True,
        idle_timeout_s: float | None = None,
        wait_first_s: float | None = None,
    ) -> AsyncIterator[JobEvent]:
        """The job's events (see `job_events`)."""
        async for event in job_events(
            self.kafka,
            self._verifier,
            job_id,
            topic=self.events_topic,
            service=self._bus.service,
            follow=follow,
            idle_timeout_s=idle_timeout_s,
            wait_first_s=wait_first_s,
        ):
            yield event

    async def run(
        self, config: JobConfig, job_id: str | None = None, idle_timeout_s: float | None = None
    ) -> tuple[str, list[JobEvent]]:
        """Start a job and wait until it ends: its id and events, or JobError saying why it
        did not complete."""
        job_id = await self.start(config, job_id)
        await self.wait(job_id, idle_timeout_s)
        return job_id, await self.history(job_id)

    async def history(self, job_id: str) -> list[JobEvent]:
        """The job's events so far (those the topic holds now), in order."""
        return [event async for event in self.events(job_id, follow=False)]

    async def org_events(self, *, follow: bool = True) -> AsyncIterator[JobEvent]:
        """Every event of this org's jobs (see `org_events`)."""
        async for event in org_events(
            self.kafka,
            self._verifier,
            self.org_id,
            topic=self.events_topic,
            service=self._bus.service,
            follow=follow,
        ):
            yield event

    async def wait(self, job_id: str, idle_timeout_s: float | None = None) -> JobEvent:
        """Until the job ends; its last event if it completed, else JobError saying why."""
        last = None
        async for event in self.events(job_id, idle_timeout_s=idle_timeout_s):
            last = event
        if last is None or last.type is not JobEventType.COMPLETED:
            reason = last.data.get("reason", last.message) if last else "no events"
            kind = last.type.value if last else "unknown"
            raise JobError(f"job {job_id} {kind.removeprefix('job.')}: {reason}", last)
        return last


async def job_events(
    kafka: KafkaSettings,
    verifier: RecordVerifier,
    job_id: str,
    *,
    service: str,
    topic: str = topics.JOB_EVENTS,
    follow: bool = True,
    idle_timeout_s: float | None = None,
    wait_first_s: float | None = None,
) -> AsyncIterator[JobEvent]:
    """The job's events from its first, in order, each from a service that may produce it
    (forged ones are skipped). With `follow`, waits for more until the job ends; without,
    stops at the end of what the topic holds now. TimeoutError when no event of the job
    comes within `wait_first_s` of the start (a wrong id, or no learner), or none for
    `idle_timeout_s` at any point. An event stored twice (published again through a broker
    outage) comes once. `topic`: the shared job-events, or the org's own (topics.org_events)."""
    # A job's events all sit in the partition its id is keyed to: read only that one, from
    # when the job was made when its id says.
    made = job_made_at(job_id)
    since = None if made is None else made - JOB_CLOCK_SKEW_S
    async with TopicReader(kafka, topic, service=service, key=job_id, since=since) as reader:
        accepted = False
        started = last_news = time.monotonic()
        seen = False
        once = RecentIds()
        while True:
            for event in await _verified(reader, verifier, lambda e: e.job_id == job_id, once):
                last_news, seen = time.monotonic(), True
                yield event
                accepted = accepted or event.type is JobEventType.ACCEPTED
                if ends_the_job(event, accepted):
                    return
            if not follow and reader.caught_up.is_set():
                return
            if not seen and wait_first_s is not None and time.monotonic() - started > wait_first_s:
                raise TimeoutError(f"no event of job {job_id} within {wait_first_s:g}s")
            if idle_timeout_s is not None and time.monotonic() - last_news > idle_timeout_s:
                raise TimeoutError(
                    f"no event of job {job_id} for {idle_timeout_s:g}s; is a learner "
                    "running (rlnode status)?"
                )


async def org_events(
    kafka: KafkaSettings,
    verifier: RecordVerifier,
    org_id: str,
    *,
    service: str,
    topic: str = topics.JOB_EVENTS,
    follow: bool = True,
    from_beginning: bool = True,
) -> AsyncIterator[JobEvent]:
    """Every event of the org's jobs from the first (or from now on, without
    `from_beginning`), forged ones skipped; a job's events in order (they share a
    partition), jobs interleaved as they come, each once. With `follow`, waits for more
    until cancelled; without, stops at the end of what the topic holds now."""
    async with TopicReader(kafka, topic, service=service, from_beginning=from_beginning) as reader:
        once = RecentIds()
        while True:
            for event in await _verified(reader, verifier, lambda e: e.org_id == org_id, once):
                yield event
            if not follow and reader.caught_up.is_set():
                return


async def _verified(
    reader: TopicReader,
    verifier: RecordVerifier,
    wanted: Callable[[JobEvent], bool],
    once: RecentIds,
) -> list[JobEvent]:
    """The next fetch's job events that are `wanted`, come from a service that may produce
    them (anyone who can write to the topic could forge one) and were not read before (the
    check comes after the signature's, so a forgery cannot hide a real event by its id)."""
    events = []
    for record in await reader.fetch():
        event = _job_event(record.value)
        if (
            event is not None
            and wanted(event)
            and await _from_a_service(verifier, record, event)
            and once.first_time(event.id)
        ):
            events.append(event)
    return events


async def _from_a_service(
    verifier: RecordVerifier, record: ConsumerRecord, event: JobEvent
) -> bool:
    try:
        producer = await verifier.producer(record)
    except RecordRefused as e:
        log.warning("skipped an event of job %s: %s", event.job_id, e.reason)
        return False
    if not topics.may_produce(producer, record.topic, event):
        log.warning("skipped a %s of job %s from %s", event.type.value, event.job_id, producer)
        return False
    return True


def _job_event(raw: bytes) -> JobEvent | None:
    try:
        return decode(raw, JobEvent)
    except DecodeError:
        return None  # dead-lettered by its consumers; a watcher skips it
