"""`rlnode taskapp register|list|verify|logs|rm`: Task Apps of your org, through the gateway
(RLNODE_GATEWAY_URL, default the local node's; token RLNODE_TOKEN)."""

from __future__ import annotations

import argparse
import os

from rlnode.sdk.gateway import GatewayClient, GatewayError
from rlnode.service.registry import GATEWAY


def _gateway(args: argparse.Namespace) -> GatewayClient:
    token = os.environ.get("RLNODE_TOKEN")
    if not token:
        raise GatewayError(
            0, "RLNODE_TOKEN is not set: export it with an org token (rlnode org create prints one)"
        )
    return GatewayClient(args.gateway_url, token)


def _register(args: argparse.Namespace) -> int:
    env = {}
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep:
            raise GatewayError(0, f"--env takes NAME=VALUE, not {item!r}")
        env[name] = value
    with _gateway(args) as gateway:
        app = gateway.register(
            args.name,
            url=args.url,
            command=args.command,
            cwd=args.cwd,
            env=env,
            secret=args.secret,
            org_id=args.org,
        )
    where = app["url"] or " ".join(app["command"] or [])
    print(f"registered {app['kind']} Task App {app['name']} ({where})")
    if app["kind"] == "managed":
        print(f"starting it; check it with: rlnode taskapp verify {app['name']}")
    return 0


def _list(args: argparse.Namespace) -> int:
    with _gateway(args) as gateway:
        apps = gateway.list(args.org)
    if not apps:
        print("no Task Apps")
    for app in apps:
        state = app["managed"]["state"] if app["managed"] else "-"
        where = app["url"] or " ".join(app["command"] or [])
        print(f"{app['name']:24} {app['kind']:9} {state:11} {where}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    with _gateway(args) as gateway:
        report = gateway.verify(args.name, args.org)
    for check in ("healthy", "accepts_key", "refuses_wrong_key"):
        mark = "ok  " if report[check]["ok"] else "FAIL"
        print(f"  {mark} {check:18} {report[check]['detail']}")
    if report.get("contract"):
        print(f"  contract           {report['contract']}")
    print("verified: a job can use it" if report["ok"] else "not usable by a job yet")
    return 0 if report["ok"] else 1


def _logs(args: argparse.Namespace) -> int:
    with _gateway(args) as gateway:
        print(gateway.logs(args.name, args.org), end="")
    return 0


def _remove(args: argparse.Namespace) -> int:
    with _gateway(args) as gateway:
        gateway.remove(args.name, args.org)
    print(f"removed {args.name}")
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--gateway-url",
        default=None,
        help=f"default: {GATEWAY.client_url_env} or {GATEWAY.default_url}",
    )
    common.add_argument("--org", default=None, help="default: the org of RLNODE_TOKEN")

    taskapp = commands.add_parser("taskapp", help="Task Apps of your org")
    sub = taskapp.add_subparsers(dest="taskapp_command", required=True, metavar="ACTION")
    reg = sub.add_parser(
        "register",
        parents=[common],
        help="register an external (--url) or managed (--command) Task App",
    )
    reg.add_argument("name")
    kind = reg.add_mutually_exclusive_group(required=True)
    kind.add_argument("--url", help="base URL of a Task App that runs elsewhere")
    kind.add_argument(
        "--command",
        help='command the gateway runs, e.g. "python -m rlnode.examples.taskapps.copy_task"',
    )
    reg.add_argument(
        "--cwd", default=None, help="managed: working directory (default: the gateway's)"
    )
    reg.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="managed: extra environment (no secrets)",
    )
    reg.add_argument(
        "--secret", default="ENVIRONMENT_API_KEY", help="the vault secret the Task App checks"
    )
    reg.set_defaults(run=_register)
    sub.add_parser("list", parents=[common], help="your Task Apps and their state").set_defaults(
        run=_list
    )
    ver = sub.add_parser("verify", parents=[common], help="check it like a job would")
    ver.add_argument("name")
    ver.set_defaults(run=_verify)
    logs = sub.add_parser("logs", parents=[common], help="a managed Task App's output")
    logs.add_argument("name")
    logs.set_defaults(run=_logs)
    rm = sub.add_parser("rm", parents=[common], help="unregister (a managed one is stopped)")
    rm.add_argument("name")
    rm.set_defaults(run=_remove)
