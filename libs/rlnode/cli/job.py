"""`rlnode job start|watch|eval|list|status|cancel|plot|export`, `rlnode events`,
`rlnode infer`.

Jobs go through the broker (KAFKA_BOOTSTRAP_SERVERS): requests to the learner, events back.
Listings, metrics and inference come from the checkpoint-server (RLNODE_CHECKPOINT_URL). The
org token is RLNODE_TOKEN; its org is the job's."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from datetime import datetime
from pathlib import Path
from urllib.parse import unquote, urlparse

from pydantic import ValidationError

from rlnode.messages import JobConfig, JobEvent, JobEventType, ends_the_job
from rlnode.messages.config import EvalSeeds, EvalSpec
from rlnode.messages.jobs import EvalCompletedData
from rlnode.sdk import local_node
from rlnode.sdk.checkpoints import CheckpointClient, CheckpointError
from rlnode.sdk.jobs import JobsClient, evaluation_job, load_config, new_job_id
from rlnode.sdk.progress import QUIET, Progress, write_plot
from rlnode.service.auth import AuthError, read_unverified
from rlnode.service.registry import CHECKPOINT_SERVER, VAULT
from rlnode.trackers import TRACKERS, TrackerUnavailable, open_tracker


class CliError(RuntimeError):
    """A failure explained in one line; the CLI prints it and exits 1."""


def _credentials() -> tuple[str, str]:
    token = os.environ.get("RLNODE_TOKEN")
    if not token:
        raise CliError(
            "RLNODE_TOKEN is not set: export it with an org token (rlnode org create prints one)"
        )
    try:
        org = read_unverified(token).get("org")
    except AuthError as e:
        raise CliError(f"RLNODE_TOKEN is not an rlnode token: {e.message}") from None
    if not org:
        raise CliError("RLNODE_TOKEN names no org; use an org token, not a service token")
    return org, token


def _jobs(args: argparse.Namespace | None = None) -> JobsClient:
    org, token = _credentials()
    vault_url = getattr(args, "vault_url", None)
    # KAFKA_*, else the broker of the node up on this machine.
    return JobsClient(org, token, local_node.kafka_settings(), service="cli", vault_url=vault_url)


def _checkpoints(args: argparse.Namespace) -> CheckpointClient:
    return CheckpointClient(getattr(args, "checkpoint_url", None), _credentials()[1])


def _config(path: str):
    file = Path(path)
    if not file.exists():
        raise CliError(f"no config file {path}")
    try:
        return load_config(file)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(top level)'}: {err['msg']}"
            for err in e.errors()
        )
        raise CliError(f"{path} is not a valid job config: {problems}") from None
    except ValueError as e:  # TOML or JSON syntax
        raise CliError(f"{path} cannot be read: {e}") from None


# -- start / cancel -------------------------------------------------------------------------


def _start(args: argparse.Namespace) -> int:
    config = _config(args.config)
    job_id = args.job_id or new_job_id()

    async def run() -> int:
        async with _jobs(args) as jobs:
            await jobs.start(config, job_id)
            print(
                f"job {job_id} requested ({config.training.steps} steps of {config.model.source})"
            )
            if not args.watch:
                print(f"follow it with: rlnode job watch {job_id}")
                return 0
            return await _follow(jobs, job_id, wait_first_s=120.0)

    return asyncio.run(run())


def _cancel(args: argparse.Namespace) -> int:
    async def run() -> int:
        async with _jobs(args) as jobs:
            await jobs.cancel(args.job_id, args.reason)
        print(
            f"cancel of {args.job_id} requested; `rlnode job watch {args.job_id}` shows the outcome"
        )
        return 0

    return asyncio.run(run())


# -- watch ------------------------------------------------------------------------------------


async def _follow(
    jobs: JobsClient, job_id: str, wait_first_s: float, seen: list[JobEvent] | None = None
) -> int:
    """Print the job's progress until it ends (`seen`: where its events go too)."""
    progress = Progress()
    accepted = False
    last: JobEvent | None = None
    try:
        async for event in jobs.events(job_id, wait_first_s=wait_first_s):
            last = event
            if seen is not None:
                seen.append(event)
            accepted = accepted or event.type is JobEventType.ACCEPTED
            if event.type is JobEventType.TRAIN_STEP:
                progress.step(event)
            elif event.type not in QUIET:
                stamp = datetime.fromtimestamp(event.ts.timestamp()).strftime("%H:%M:%S")
                progress.say(f"{stamp} {event.type.value:<18} {event.message}")
            if ends_the_job(event, accepted):
                break
    except TimeoutError:
        raise CliError(
            f"no events of job {job_id} within {wait_first_s:g}s: check the id "
            "(rlnode job list) and that the node's learner is running"
        ) from None
    if last is None or last.type is not JobEventType.COMPLETED:
        reason = (last.data.get("reason") or last.message) if last else "no events"
        kind = last.type.value.removeprefix("job.") if last else "unknown"
        print(f"rlnode: job {job_id} {kind}: {reason}", file=sys.stderr)
        return 1
    return 0


def _watch(args: argparse.Namespace) -> int:
    async def run() -> int:
        async with _jobs() as jobs:
            return await _follow(jobs, args.job_id, wait_first_s=args.wait)

    return asyncio.run(run())


def _seed_range(text: str) -> EvalSeeds:
    start, colon, stop = text.partition(":")
    try:
        first, end = int(start), int(stop)
    except ValueError:
        first, end = 0, 0
    if not colon or end <= first:
        raise CliError(f"--seeds {text!r}: give START:STOP with STOP > START (STOP excluded)")
    return EvalSeeds(start=first, count=end - first)


def _eval(args: argparse.Namespace) -> int:
    """Evaluate a checkpoint after the fact: a job of no training steps, on the checkpoint,
    with the Task App and sampling of the job that made it (or of --config)."""
    try:
        spec = EvalSpec(
            seeds=_seed_range(args.seeds),
            samples=args.samples,
            temperature=args.temperature,
            max_tokens=args.max_tokens,
            pass_threshold=args.pass_threshold,
        )
        with _checkpoints(args) as server:
            entry, state = server.checkpoint(args.model)
    except ValidationError as e:
        raise CliError(f"invalid evaluation: {e.errors()[0]['msg']}") from None
    except CheckpointError as e:
        raise CliError(str(e)) from None
    if args.config:
        source = _config(args.config)
    elif "job_config" in state:
        source = JobConfig.model_validate(state["job_config"])
    else:
        raise CliError(
            f"checkpoint {entry['model']} does not record its job's config (it predates "
            "rlnode job eval): pass the job's config file with --config"
        )
    # The learner loads it on this node (and refuses it unless it is the org's own).
    config = evaluation_job(source, Path(unquote(urlparse(entry["uri"]).path)), spec)
    job_id = args.job_id or new_job_id()

    async def run() -> int:
        seen: list[JobEvent] = []
        async with _jobs(args) as jobs:
            await jobs.start(config, job_id)
            print(f"job {job_id} evaluates {entry['model']} on seeds {args.seeds}")
            code = await _follow(jobs, job_id, wait_first_s=120.0, seen=seen)
        rounds = [e for e in seen if e.type is JobEventType.EVAL_COMPLETED]
        if code == 0 and rounds:
            _show_round(rounds[-1].typed_data())
        return code

    return asyncio.run(run())


def _show_round(data) -> None:
    assert isinstance(data, EvalCompletedData)
    print(f"{'SEED':>10} {'SAMPLES':>7} {'FAILED':>6} {'PASSED':>6}  REWARD")
    for seed in data.per_seed:
        reward = f"{seed.reward_mean:.4f}" if seed.reward_mean is not None else "-"
        print(f"{seed.seed:>10} {seed.samples:>7} {seed.failed:>6} {seed.passed:>6}  {reward}")


def _events(args: argparse.Namespace) -> int:
    """Job events for shell users: one line each, or one JSON object per line (--json)."""

    def show(event: JobEvent) -> None:
        if args.json:
            print(event.model_dump_json(), flush=True)
        else:
            stamp = datetime.fromtimestamp(event.ts.timestamp()).strftime("%H:%M:%S")
            print(f"{stamp} {event.job_id} {event.type.value:<18} {event.message}", flush=True)

    async def run() -> int:
        async with _jobs(args) as jobs:
            if args.job:
                events = jobs.events(args.job, follow=args.follow)
            else:
                events = jobs.org_events(follow=args.follow)
            async for event in events:
                show(event)
        return 0

    return asyncio.run(run())


def _export(args: argparse.Namespace) -> int:
    """Replay a job's events (what the topic holds now) into an experiment tracker."""
    try:
        tracker = open_tracker(args.to, args.job_id, args.out)
    except (ValueError, TrackerUnavailable) as e:
        raise CliError(str(e)) from None

    async def run() -> int:
        count = 0
        async with _jobs(args) as jobs:
            async for event in jobs.events(args.job_id, follow=False):
                tracker.log(event)
                count += 1
        tracker.close()
        if count == 0:
            raise CliError(f"no events of job {args.job_id} on the topic: check the id")
        print(f"{count} events of {args.job_id} written for {args.to} under {args.out}")
        return 0

    return asyncio.run(run())


# -- list / status / plot / infer -----------------------------------------------------------


def _list(args: argparse.Namespace) -> int:
    with _checkpoints(args) as server:
        rows = server.jobs()
    if not rows:
        print("no jobs yet: start one with rlnode job start CONFIG.toml")
        return 0
    print(f"{'JOB':<28} {'STATUS':<10} {'STEP':>11} {'REWARD':>8}  CREATED")
    for r in rows:
        step = f"{r['step']}/{r['total_steps'] or '?'}"
        reward = f"{r['reward_mean']:.3f}" if r["reward_mean"] is not None else "-"
        print(f"{r['job_id']:<28} {r['status']:<10} {step:>11} {reward:>8}  {r['created_at'][:19]}")
    return 0


def _status(args: argparse.Namespace) -> int:
    with _checkpoints(args) as server:
        r = server.job(args.job_id)
    print(f"job        {r['job_id']}")
    print(f"status     {r['status']}" + (f" ({r['reason']})" if r["reason"] else ""))
    print(f"step       {r['step']}/{r['total_steps'] or '?'}")
    if r["reward_mean"] is not None:
        print(f"reward     {r['reward_mean']:.4f}   loss {r['loss']:+.4f}")
    steps = r["checkpoints"]
    print(f"checkpoints {', '.join(map(str, steps)) if steps else 'none yet'}")
    if r.get("best_checkpoint") is not None:
        print(f"best eval  step {r['best_checkpoint']} ({r['job_id']}@best)")
    if steps:
        print(f'infer with: rlnode infer {r["job_id"]}@latest "your prompt"')
    return 0


def _plot(args: argparse.Namespace) -> int:
    with _checkpoints(args) as server:
        rows = server.metrics(args.job_id)
        evals = server.evals(args.job_id)
    out = Path(args.out or f"{args.job_id}.png")
    write_plot(rows, out, title=f"{args.job_id}", evals=evals)
    print(f"wrote {out.resolve()}")
    return 0


def _infer(args: argparse.Namespace) -> int:
    with _checkpoints(args) as server:
        started = time.perf_counter()
        answer = server.chat(
            args.model,
            args.prompt,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
        )
    print(answer["choices"][0]["message"]["content"])
    if args.verbose:
        use = answer["usage"]
        print(
            f"({use['completion_tokens']} tokens in {time.perf_counter() - started:.2f}s, "
            f"finish: {answer['choices'][0]['finish_reason']})",
            file=sys.stderr,
        )
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    server = argparse.ArgumentParser(add_help=False)
    server.add_argument(
        "--checkpoint-url",
        default=None,
        help=f"default: {CHECKPOINT_SERVER.client_url_env} or {CHECKPOINT_SERVER.default_url}",
    )
    # Each request carries a job token the vault mints from RLNODE_TOKEN.
    vault = argparse.ArgumentParser(add_help=False)
    vault.add_argument(
        "--vault-url", default=None, help=f"default: {VAULT.client_url_env} or {VAULT.default_url}"
    )
    job = commands.add_parser("job", help="start, watch, list and cancel training jobs")
    sub = job.add_subparsers(dest="job_command", required=True, metavar="ACTION")
    start = sub.add_parser(
        "start", parents=[vault], help="validate CONFIG (TOML or JSON) and start a job"
    )
    start.add_argument("config")
    start.add_argument("--job-id", default=None, help="default: a new job-<hex> id")
    start.add_argument("--watch", action="store_true", help="follow the job until it ends")
    start.set_defaults(run=_start)
    watch = sub.add_parser("watch", help="follow a job's progress; exit 0 when it completes")
    watch.add_argument("job_id")
    watch.add_argument(
        "--wait", type=float, default=30.0, help="seconds to wait for the first event"
    )
    watch.set_defaults(run=_watch)
    evaluate = sub.add_parser(
        "eval",
        parents=[server, vault],
        help="evaluate a checkpoint (JOB@STEP, @latest or @best) on held-out seeds",
    )
    evaluate.add_argument("model", metavar="JOB@STEP")
    evaluate.add_argument(
        "--seeds", required=True, help="START:STOP, the Task App seeds (STOP excluded)"
    )
    evaluate.add_argument("--samples", type=int, default=1, help="per seed (above 1: pass@k)")
    evaluate.add_argument("--temperature", type=float, default=0.0)
    evaluate.add_argument(
        "--max-tokens", type=int, default=None, help="default: the job's sampling.max_tokens"
    )
    evaluate.add_argument(
        "--pass-threshold", type=float, default=1.0, help="a sample passes at this reward"
    )
    evaluate.add_argument(
        "--config", default=None, help="the job's config (for checkpoints that lack it)"
    )
    evaluate.add_argument("--job-id", default=None, help="default: a new job-<hex> id")
    evaluate.set_defaults(run=_eval)
    export = sub.add_parser(
        "export", parents=[vault], help="replay a job's events into an experiment tracker"
    )
    export.add_argument("job_id")
    export.add_argument("--to", required=True, choices=sorted(TRACKERS))
    export.add_argument(
        "--out",
        required=True,
        help="tensorboard: the directory runs go under; mlflow: a tracking URI or a directory",
    )
    export.set_defaults(run=_export)
    lst = sub.add_parser("list", parents=[server], help="your org's jobs")
    lst.set_defaults(run=_list)
    status = sub.add_parser("status", parents=[server], help="one job's state and checkpoints")
    status.add_argument("job_id")
    status.set_defaults(run=_status)
    cancel = sub.add_parser(
        "cancel", parents=[vault], help="stop a job (a checkpoint of its progress is kept)"
    )
    cancel.add_argument("job_id")
    cancel.add_argument("--reason", default=None)
    cancel.set_defaults(run=_cancel)
    plot = sub.add_parser("plot", parents=[server], help="PNG of reward and loss against step")
    plot.add_argument("job_id")
    plot.add_argument("--out", default=None, help="default: ./<job_id>.png")
    plot.set_defaults(run=_plot)

    events = commands.add_parser(
        "events",
        parents=[vault],
        help="your org's job events (of one job with --job); --json: one object per line",
    )
    events.add_argument("--job", default=None, help="only this job's events")
    events.add_argument(
        "--follow", action="store_true", help="wait for more (with --job: until the job ends)"
    )
    events.add_argument("--json", action="store_true", help="JSON lines, as the topic holds them")
    events.set_defaults(run=_events)

    infer = commands.add_parser(
        "infer", parents=[server], help="ask a checkpoint (MODEL = <job_id>@<step>|latest)"
    )
    infer.add_argument("model")
    infer.add_argument("prompt")
    infer.add_argument("--max-tokens", type=int, default=64)
    infer.add_argument("--temperature", type=float, default=0.0)
    infer.add_argument("-v", "--verbose", action="store_true")
    infer.set_defaults(run=_infer)
