"""Fuzz the credential-vault's HTTP API with schemathesis from its own OpenAPI spec.

Starts a real vault (fresh SQLite database, fresh master key) on a loopback port, gives it
an org with a secret, then lets schemathesis generate requests for every operation, once as
the vault admin and once as the org's admin token. Fails when any response is a 5xx.

    python tools/fuzz_vault.py [--max-examples N]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from rlnode.bus.localbroker import free_port
from rlnode.node.processes import ServiceProcess, ensure_local_credentials
from rlnode.sdk.vault import VaultClient
from rlnode.service.registry import SERVICES_BY_NAME


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-examples", type=int, default=25)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlnode-fuzz-") as tmp:
        data_dir = Path(tmp)
        credentials = ensure_local_credentials(data_dir)
        vault = ServiceProcess(
            SERVICES_BY_NAME["credential-vault"],
            free_port(),
            data_dir / "vault.log",
            env={
                **credentials.vault_env(),
                "RLNODE_DATA_DIR": str(data_dir),
                "VAULT_LOG_LEVEL": "warning",
            },
        ).start()
        try:
            vault.wait_healthy()
            with VaultClient(vault.url, credentials.admin_token) as admin:
                org_token = admin.create_org("fuzz-org")["token"]["token"]
            with VaultClient(vault.url, org_token) as org:
                org.set_secret("ENVIRONMENT_API_KEY", "fuzz-secret-value")
            failures = 0
            for who, token in (("admin", credentials.admin_token), ("org admin", org_token)):
                print(f"--- schemathesis as {who}", flush=True)
                result = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "schemathesis.cli",
                        "run",
                        f"{vault.url}/openapi.json",
                        "--checks",
                        "not_a_server_error",
                        "--header",
                        f"Authorization: Bearer {token}",
                        "--max-examples",
                        str(args.max_examples),
                        "--seed",
                        str(args.seed),
                        "--phases",
                        "examples,coverage,fuzzing",
                        # One worker: schemathesis's workers are threads, and CPython 3.11.7's
                        # ast module keeps its recursion depth in shared state, so two threads
                        # describing hypothesis lambdas at once can raise "AST constructor
                        # recursion depth mismatch" (CPython gh-106905; fixed in 3.11.8).
                        "--workers",
                        "1",
                        "--no-color",
                        "--warnings",
                        "off",
                    ],
                    check=False,
                )
                failures += result.returncode != 0
        finally:
            code = vault.stop()
        if code != 0:
            print(f"the vault exited with {code}:\n{vault.log_tail()}", file=sys.stderr)
            return 1
        if "Traceback" in vault.log_tail(1_000_000):
            print(f"the vault logged a traceback:\n{vault.log_tail()}", file=sys.stderr)
            return 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
