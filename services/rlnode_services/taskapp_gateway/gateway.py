"""The gateway's logic, apart from HTTP: the registry, the managed processes, verifying a
Task App like a job would, and running rollouts with the org's key."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Sequence
from pathlib import Path

from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlmodel import Session, col, delete, select

from rlnode.messages import utc_now
from rlnode.service.db import create_tables, session_scope
from rlnode.taskapp import containers
from rlnode.taskapp.containers import ContainerApp
from rlnode.taskapp.contract import RolloutRequest
from rlnode_services.taskapp_gateway.cgroups import OwnCgroups
from rlnode_services.taskapp_gateway.client import TaskAppClient, TaskAppFailure
from rlnode_services.taskapp_gateway.firewall import (
    IsolationUnavailable,
    NetworkMode,
    TaskAppFirewall,
    TaskAppNetwork,
    table_name,
    uids_confined_elsewhere,
)
from rlnode_services.taskapp_gateway.keys import KeyProvider, KeyUnavailable
from rlnode_services.taskapp_gateway.managed import ManagedSpec, ManagedTaskApp
from rlnode_services.taskapp_gateway.outbound import UrlRefused, check_url
from rlnode_services.taskapp_gateway.sandbox import (
    UID_SPAN,
    Limits,
    Sandbox,
    preferred_uid,
    remove_home,
    runs_as_root,
    uids_running,
)
from rlnode_services.taskapp_gateway.schemas import (
    Check,
    RegisterTaskApp,
    RolloutError,
    RolloutOutcome,
    VerifyReport,
)
from rlnode_services.taskapp_gateway.settings import GatewaySettings
from rlnode_services.taskapp_gateway.store import (
    TABLES,
    ManagedEndpointRecord,
    SandboxRecord,
    TaskAppRecord,
)

log = logging.getLogger("taskapp_gateway.gateway")


class GatewayError(Exception):
    status = 400

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status


class Gateway:
    def __init__(
        self, engine: Engine, settings: GatewaySettings, keys: KeyProvider, log_dir: Path
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.keys = keys
        self.log_dir = log_dir
        self.client = TaskAppClient(settings.connect_timeout_s, settings.connect_retries)
        self.managed: dict[tuple[str, str], ManagedTaskApp] = {}
        # Every rollout names its Task App; reading the registration from the database each
        # time was a third of the event loop during a job (py-spy). (read at, record)
        self._records: dict[tuple[str, str], tuple[float, TaskAppRecord]] = {}
        # A gateway that does not run managed Task Apps reads where they answer, as cached.
        self.name = f"{socket.gethostname()}-{os.getpid()}"
        self._endpoints: dict[tuple[str, str], tuple[float, str]] = {}
        # Which contract the Task App at an address speaks (None: Synth's 2025 one), asked
        # once per address: a restarted managed one answers at a new one.
        self._contracts: dict[str, asyncio.Future[ContainerApp | None]] = {}
        # The node's gateways share the database: its URL names the node's firewall table.
        table = settings.taskapp_firewall_table or table_name(str(engine.url))
        self.firewall_table = table
        self.network = TaskAppNetwork(
            NetworkMode(settings.taskapp_network),
            TaskAppFirewall(table, settings.taskapp_allow_to, cgroups=OwnCgroups.here(table)),
            own_users=self._own_users,
        )
        create_tables(engine, *TABLES)

    async def start(self) -> None:
        """The gateway that runs managed Task Apps starts every registered one (the node's
        other gateways cannot start them when a rollout asks) and forgets where an earlier
        run of it had them. It writes the network rules they run under first."""
        await self.network.start(writes_rules=self.settings.runs_managed)
        if not self.settings.runs_managed:
            return
        try:
            records = await asyncio.to_thread(self._take_over_managed)
        except SQLAlchemyError as e:  # the database is away: they start on first use then
            log.warning("could not read the managed Task Apps at start (%s)", e)
            return
        for record in records:
            self._managed(record).start()

    def _take_over_managed(self) -> list[TaskAppRecord]:
        """The managed registrations, with the endpoints an earlier run recorded forgotten."""
        with session_scope(self.engine) as s:
            s.exec(delete(ManagedEndpointRecord))
            return list(s.exec(select(TaskAppRecord).where(TaskAppRecord.kind == "managed")))

    def failures(self) -> dict[str, str]:
        return {
            f"supervising Task App {org}/{name}": m.failure
            for (org, name), m in self.managed.items()
            if m.failure is not None
        }

    async def aclose(self) -> None:
        await asyncio.gather(*(m.stop() for m in self.managed.values()), return_exceptions=True)
        self.managed.clear()
        await self.network.stop(writes_rules=self.settings.runs_managed)
        await self.client.aclose()
        self.keys.close()

    # -- registry ----------------------------------------------------------------------

    def check_runs_managed(self, name: str) -> None:
        if not self.settings.runs_managed:
            raise GatewayError(
                f"{name!r} is managed, and this gateway does not run managed Task Apps "
                "(GATEWAY_RUNS_MANAGED=false): register and remove it on the node's gateway "
                "that does (rlnode status names it)",
                409,
            )

    async def register(self, org_id: str, body: RegisterTaskApp) -> TaskAppRecord:
        if body.url is None:
            self.check_runs_managed(body.name)
            try:
                self.network.require()
            except IsolationUnavailable as e:
                raise GatewayError(str(e), 409) from None
        if body.url is not None:
            try:
                await check_url(body.url, self._allowed_addresses)
            except UrlRefused as e:
                raise GatewayError(str(e)) from None
        record = await asyncio.to_thread(self._register, org_id, body)
        if record.kind == "managed":
            self._managed(record).start()
        return record

    @property
    def _allowed_addresses(self) -> frozenset[str]:
        return frozenset(self.settings.allow_urls_to)

    def _register(self, org_id: str, body: RegisterTaskApp) -> TaskAppRecord:
        limits = self._check_limits(body.limits or Limits())
        record = TaskAppRecord(
            org_id=org_id,
            name=body.name,
            kind="external" if body.url else "managed",
            url=body.url,
            command=json.dumps(body.command) if body.command else None,
            cwd=body.cwd,
            env=json.dumps(body.env),
            secret=body.secret,
        )
        self._records.pop((org_id, body.name), None)
        try:
            with session_scope(self.engine) as s:
                s.add(record)
                s.flush()
                s.refresh(record)
                if record.kind == "managed":
                    self._new_sandbox(s, org_id, body.name, limits)
        except IntegrityError:
            raise GatewayError(
                f"org {org_id!r} already has a Task App named {body.name!r}; remove it first (rlnode taskapp rm)",
                409,
            ) from None
        return record

    def list(self, org_id: str) -> list[TaskAppRecord]:
        with Session(self.engine) as s:
            return list(
                s.exec(
                    select(TaskAppRecord)
                    .where(TaskAppRecord.org_id == org_id)
                    .order_by(TaskAppRecord.name)
                )
            )

    def get(self, org_id: str, name: str) -> TaskAppRecord:
        cached = self._records.get((org_id, name))
        if cached is not None and time.monotonic() - cached[0] < self.settings.registry_cache_s:
            return cached[1]
        with Session(self.engine) as s:
            record = s.exec(
                select(TaskAppRecord).where(
                    TaskAppRecord.org_id == org_id, TaskAppRecord.name == name
                )
            ).first()
        if record is None:
            self._records.pop((org_id, name), None)
            raise GatewayError(f"org {org_id!r} has no Task App named {name!r}", 404)
        self._records[(org_id, name)] = (time.monotonic(), record)
        return record

    async def unregister(self, org_id: str, name: str) -> None:
        record = self.get(org_id, name)
        if record.kind == "managed":
            self.check_runs_managed(name)
        managed = self.managed.pop((org_id, name), None)
        if managed is not None:
            await managed.stop()
        with session_scope(self.engine) as s:
            s.delete(s.get(TaskAppRecord, record.id))
            sandbox = self._sandbox_record(s, org_id, name)
            if sandbox is not None:
                s.delete(sandbox)
            s.exec(
                delete(ManagedEndpointRecord).where(
                    col(ManagedEndpointRecord.org_id) == org_id,
                    col(ManagedEndpointRecord.name) == name,
                )
            )
        self._records.pop((org_id, name), None)  # after the delete, so no rollout re-caches it
        if sandbox is not None:
            await asyncio.to_thread(remove_home, self.settings.sandbox_dir / str(sandbox.uid))
            if self._own_users:  # its processes are gone (stop killed every one of its user)
                await self.network.release(sandbox.uid)

    def managed_status(self, record: TaskAppRecord) -> ManagedTaskApp | None:
        return self.managed.get((record.org_id, record.name)) if record.kind == "managed" else None

    # -- sandboxes ---------------------------------------------------------------------

    @property
    def _own_users(self) -> bool:
        """Whether each managed Task App gets a user of its own."""
        return self.settings.sandbox_user == "auto" and runs_as_root()

    def _check_limits(self, limits: Limits) -> Limits:
        caps = {
            "memory_mb": (self.settings.taskapp_max_memory_mb, "GATEWAY_TASKAPP_MAX_MEMORY_MB"),
            "processes": (self.settings.taskapp_max_processes, "GATEWAY_TASKAPP_MAX_PROCESSES"),
            "open_files": (
                self.settings.taskapp_max_open_files,
                "GATEWAY_TASKAPP_MAX_OPEN_FILES",
            ),
        }
        for field, (cap, setting) in caps.items():
            asked = getattr(limits, field)
            if asked is not None and asked > cap:
                raise GatewayError(
                    f"limits.{field} {asked} is over this node's cap of {cap} ({setting})"
                )
        return limits

    def _sandbox_record(self, s: Session, org_id: str, name: str) -> SandboxRecord | None:
        return s.exec(
            select(SandboxRecord).where(SandboxRecord.org_id == org_id, SandboxRecord.name == name)
        ).first()

    def _new_sandbox(self, s: Session, org_id: str, name: str, limits: Limits) -> SandboxRecord:
        """A uid no other Task App has, of this node or another on this machine (searched
        from a spot spread by name): one that owns a process, or that another node's table
        confines, would be that app's too (its rules, its processes killed with ours)."""
        taken = set(s.exec(select(SandboxRecord.uid)))
        if self._own_users:
            base = self.settings.sandbox_uid_base
            taken |= uids_running(base, base + UID_SPAN)
            taken |= uids_confined_elsewhere(self.firewall_table)
        attempt = 0
        while (
            uid := preferred_uid(self.settings.sandbox_uid_base, org_id, name, attempt)
        ) in taken:
            attempt += 1
        record = SandboxRecord(
            org_id=org_id, name=name, uid=uid, limits=limits.model_dump_json(exclude_none=True)
        )
        s.add(record)
        return record

    def _sandbox(self, record: TaskAppRecord) -> Sandbox:
        with session_scope(self.engine) as s:
            stored = self._sandbox_record(s, record.org_id, record.name)
            if stored is None:  # registered before Task Apps had sandboxes
                stored = self._new_sandbox(s, record.org_id, record.name, Limits())
            limits = Limits.model_validate_json(stored.limits)
            uid = stored.uid
        settings = self.settings
        return Sandbox(
            uid=uid if self._own_users else None,
            home=settings.sandbox_dir / str(uid),
            memory_mb=limits.memory_mb or settings.taskapp_memory_mb,
            processes=limits.processes or settings.taskapp_processes,
            open_files=limits.open_files or settings.taskapp_open_files,
            path=settings.taskapp_path,
        )

    def _managed(self, record: TaskAppRecord) -> ManagedTaskApp:
        key = (record.org_id, record.name)
        if key not in self.managed:
            spec = ManagedSpec(
                org_id=record.org_id,
                name=record.name,
                argv=json.loads(record.command or "[]"),
                cwd=record.cwd,
                env=json.loads(record.env or "{}"),
                secret=record.secret,
                sandbox=self._sandbox(record),
            )
            log_path = self.log_dir / record.org_id / f"{record.name}.log"
            self.managed[key] = ManagedTaskApp(
                spec,
                self.keys,
                self.client,
                self.settings,
                log_path,
                self.network,
                announce=lambda url: asyncio.to_thread(
                    self._record_endpoint, record.org_id, record.name, url
                ),
            )
        return self.managed[key]

    @staticmethod
    def _endpoint_record(s: Session, org_id: str, name: str) -> ManagedEndpointRecord | None:
        return s.exec(
            select(ManagedEndpointRecord).where(
                ManagedEndpointRecord.org_id == org_id, ManagedEndpointRecord.name == name
            )
        ).first()

    def _record_endpoint(self, org_id: str, name: str, url: str | None) -> None:
        with session_scope(self.engine) as s:
            stored = self._endpoint_record(s, org_id, name)
            if url is None:
                if stored is not None:
                    s.delete(stored)
                return
            stored = stored or ManagedEndpointRecord(org_id=org_id, name=name, url=url, owner="")
            stored.url, stored.owner, stored.updated_at = url, self.name, utc_now()
            s.add(stored)

    def _endpoint(self, record: TaskAppRecord) -> str:
        """Where the gateway that runs it says a managed Task App answers (cached briefly)."""
        key = (record.org_id, record.name)
        cached = self._endpoints.get(key)
        if cached is not None and time.monotonic() - cached[0] < self.settings.registry_cache_s:
            return cached[1]
        with Session(self.engine) as s:
            stored = self._endpoint_record(s, record.org_id, record.name)
        if stored is None:
            self._endpoints.pop(key, None)
            raise TaskAppFailure(
                "task_app_unreachable",
                f"managed Task App {record.name!r} is not healthy on the gateway that runs it "
                "(it is starting or restarting; its status and logs are there)",
            )
        self._endpoints[key] = (time.monotonic(), stored.url)
        return stored.url

    async def _target(self, record: TaskAppRecord, job_id: str | None = None) -> tuple[str, str]:
        """Where to call the Task App, and with which key."""
        if record.kind == "managed":
            if self.settings.runs_managed:
                return await self._managed(record).ready(self.settings.start_timeout_s)
            url = self._endpoint(record)
            return url, await self.keys.get(record.org_id, record.secret, job_id=job_id)
        assert record.url is not None
        try:
            await check_url(record.url, self._allowed_addresses)
        except UrlRefused as e:
            raise TaskAppFailure("task_app_unreachable", str(e)) from None
        return record.url, await self.keys.get(record.org_id, record.secret, job_id=job_id)

    # -- verify ------------------------------------------------------------------------

    async def verify(self, org_id: str, name: str) -> VerifyReport:
        """What a job needs: it answers /health with the key, accepts the key on /info, and
        refuses a wrong key (400/401/403). One of Synth's containers answers /metadata
        instead of /info, and takes no key (the contract has none): managed, it passes."""
        record = self.get(org_id, name)
        try:
            url, key = await self._target(record)
        except (TaskAppFailure, KeyUnavailable) as e:
            message = e.verdict if isinstance(e, TaskAppFailure) else e.message
            failed = Check(ok=False, detail=message)
            return VerifyReport(
                ok=False, healthy=failed, accepts_key=failed, refuses_wrong_key=failed
            )
        healthy = await self._check(self.client.get_json(url, "/health", key), "answers /health")
        container, contract = None, None
        try:
            container = await self._contract(url, key, fresh=True)
            if container is None:
                info = await self.client.get_json(url, "/info", key)
                accepts = Check(ok=isinstance(info, dict), detail="accepts the key on /info")
                contract = containers.LEGACY_CONTRACT
            else:
                accepts = Check(ok=True, detail=f"answers /metadata: it {container.verdict()}")
                contract = containers.CONTAINER_CONTRACT
        except TaskAppFailure as e:
            accepts = Check(ok=False, detail=e.verdict)
        if container is not None and record.kind == "managed":
            refuses = self._keyless()
        else:
            refuses = await self._refuses_wrong_key(url, key)
            if container is not None and not refuses.ok:
                refuses.detail += (
                    " (Synth's container contract has no key: register it managed, or put a "
                    "proxy that checks X-API-Key in front of it)"
                )
        # A verdict only: what the address answered stays here (the gateway must not be a
        # way to read what an address on its network says).
        return VerifyReport(
            ok=healthy.ok and accepts.ok and refuses.ok,
            healthy=healthy,
            accepts_key=accepts,
            refuses_wrong_key=refuses,
            contract=contract,
        )

    def _keyless(self) -> Check:
        """A managed container takes no key (the contract has none): it answers on this
        machine's loopback, out of other Task Apps' reach when they are isolated."""
        others = (
            "other Task Apps cannot (isolated)"
            if self.network.mode is NetworkMode.ISOLATED
            else "so can other Task Apps (GATEWAY_TASKAPP_NETWORK=open)"
        )
        return Check(
            ok=True,
            detail="takes no key (Synth's container contract has none): managed, it answers on "
            f"this machine's loopback only, where its processes can reach it; {others}",
        )

    async def _contract(
        self, url: str, key: str | None, fresh: bool = False
    ) -> ContainerApp | None:
        """The container at `url`, or None for a Task App of Synth's 2025 contract."""
        known = self._contracts.get(url)
        if known is None or fresh:
            known = self._contracts[url] = asyncio.ensure_future(self.client.detect(url, key))
        try:
            return await asyncio.shield(known)
        except TaskAppFailure:
            if self._contracts.get(url) is known:
                del self._contracts[url]
            raise

    @staticmethod
    async def _check(call, what: str) -> Check:
        try:
            document = await call
        except TaskAppFailure as e:
            return Check(ok=False, detail=e.verdict)
        if isinstance(document, dict) and document.get("healthy") is False:
            return Check(ok=False, detail="answers /health with healthy: false")
        return Check(ok=True, detail=what)

    async def _refuses_wrong_key(self, url: str, key: str) -> Check:
        wrong = secrets.token_urlsafe(24)
        while wrong == key:
            wrong = secrets.token_urlsafe(24)
        for sent, label in ((wrong, "a wrong key"), (None, "no key")):
            try:
                response, _ = await self.client.request("GET", url + "/health", sent, 10.0)
            except TaskAppFailure as e:
                return Check(ok=False, detail=e.verdict)
            if response.status not in (400, 401, 403):
                return Check(
                    ok=False,
                    detail=f"answered {response.status} to {label}: it must refuse calls without the right key",
                )
        return Check(ok=True, detail="refuses a wrong key and a missing one")

    # -- rollouts ----------------------------------------------------------------------

    async def rollout(
        self,
        org_id: str,
        name: str,
        request: RolloutRequest,
        job_id: str | None,
        timeout_s: float | None,
        with_response: bool = True,
    ) -> RolloutOutcome:
        return await self._rollout(
            self.get(org_id, name), request, job_id, timeout_s, with_response
        )

    async def rollouts(
        self,
        org_id: str,
        name: str,
        requests: Sequence[RolloutRequest],
        job_id: str | None,
        timeout_s: float | None,
        with_response: bool,
    ) -> Sequence[RolloutOutcome]:
        """All at once, each failing alone; in the order asked."""
        record = self.get(org_id, name)
        return await asyncio.gather(
            *(self._rollout(record, r, job_id, timeout_s, with_response) for r in requests)
        )

    async def _rollout(
        self,
        record: TaskAppRecord,
        request: RolloutRequest,
        job_id: str | None,
        timeout_s: float | None,
        with_response: bool,
    ) -> RolloutOutcome:
        timeout = timeout_s or self.settings.rollout_timeout_s
        request.safety.max_time_s = min(request.safety.max_time_s, timeout)
        started = time.monotonic()
        url = None
        try:
            url, key = await self._target(record, job_id)
            if record.kind == "managed":  # it may call back the generator that sent this
                await self.network.allow_endpoint(request.policy.config.inference_url)
            container = await self._contract(url, key)
            if container is None:
                call = await self.client.rollout(url, key, request, timeout)
            else:
                call = await self.client.container_rollout(url, key, request, timeout, container)
        except IsolationUnavailable as e:
            return self._failed(request, "task_app_unreachable", str(e), None, started)
        except KeyUnavailable as e:
            return self._failed(request, "task_app_auth_refused", e.message, None, started)
        except TaskAppFailure as e:
            if e.kind == "task_app_auth_refused" and record.kind == "external":
                # The key may have changed in the vault.
                self.keys.forget(record.org_id, record.secret)
            if e.kind == "task_app_unreachable":  # it may have moved: read where, next time
                self._endpoints.pop((record.org_id, record.name), None)
            if url and e.kind in ("task_app_unreachable", "task_app_invalid_response"):
                self._contracts.pop(url, None)  # or changed: which contract, ask again
            return self._failed(request, e.kind, e.message, e.status_code, started)
        return RolloutOutcome(
            status="ok",
            run_id=request.run_id,
            result=call.result,
            response=call.response.model_dump(mode="json") if with_response else None,
            attempts=call.attempts,
            duration_s=time.monotonic() - started,
        )

    @staticmethod
    def _failed(
        request: RolloutRequest, kind: str, message: str, status: int | None, started: float
    ) -> RolloutOutcome:
        return RolloutOutcome(
            status="failed",
            run_id=request.run_id,
            error=RolloutError(kind=kind, message=message, status_code=status),
            duration_s=time.monotonic() - started,
        )
