"""`rlnode vault|org|token|tinker|secrets`: the credential-vault from the command line.

The vault is RLNODE_VAULT_URL (default the local node's); the caller's token is
RLNODE_TOKEN, or for admin commands RLNODE_ADMIN_TOKEN. Tokens are printed once, to stdout.
"""

from __future__ import annotations

import argparse
import base64
import os
import sys

from nacl.secret import SecretBox
from nacl.utils import random as random_bytes

from rlnode.sdk import local_node
from rlnode.sdk.vault import VaultClient, VaultError
from rlnode.service.auth import ORG_SCOPES, SERVICE_SCOPES, TINKER_KEY_PREFIX, Scope
from rlnode.service.registry import TINKER_API, VAULT


def _vault(args: argparse.Namespace, *, admin: bool = False) -> VaultClient:
    name = "RLNODE_ADMIN_TOKEN" if admin else "RLNODE_TOKEN"
    token = os.environ.get(name)
    if not token and admin:  # the node up on this machine is this user's: its admin token
        token = local_node.admin_token()
    if not token:
        what = (
            "the vault's admin token (VAULT_ADMIN_TOKEN)"
            if admin
            else "an org token (rlnode org create prints one)"
        )
        raise VaultError(0, f"{name} is not set: export it with {what}")
    return VaultClient(args.vault_url, token)


def _master_key(_args: argparse.Namespace) -> int:
    print(base64.b64encode(random_bytes(SecretBox.KEY_SIZE)).decode())
    print("keep it safe: without it the vault's secrets cannot be opened", file=sys.stderr)
    return 0


def _org_create(args: argparse.Namespace) -> int:
    with _vault(args, admin=True) as vault:
        created = vault.create_org(args.org_id, args.name)
    key, token = created["public_key"], created["token"]
    print(f"created org {created['org_id']} with key {key['key_id']}", file=sys.stderr)
    print(f"its admin token (shown once; expires {token['expires_at']}):", file=sys.stderr)
    print(token["token"])
    return 0


def _token_create(args: argparse.Namespace) -> int:
    if args.service:
        with _vault(args, admin=True) as vault:
            issued = vault.create_service_token(
                args.name, args.scope or ["secrets:unseal"], args.org, args.ttl_s
            )
    else:
        with _vault(args) as vault:
            issued = vault.create_token(args.name, args.scope or None, args.ttl_s, args.org)
    print(
        f"issued {issued['kind']} token {issued['token_id']} ({' '.join(issued['scopes'])}); "
        f"expires {issued['expires_at']}; shown once:",
        file=sys.stderr,
    )
    print(issued["token"])
    return 0


def _tinker_key(args: argparse.Namespace) -> int:
    """An org token that may train and sample through the Tinker API, with the `tml-` prefix
    the tinker SDK requires of a key (the tinker-api takes it off and checks the token)."""
    with _vault(args) as vault:
        issued = vault.create_token(args.name, [Scope.TINKER.value], args.ttl_s, args.org)
    print(
        f"issued Tinker API key {issued['token_id']} for org {issued['org_id']}; expires "
        f"{issued['expires_at']}; shown once (export it as TINKER_API_KEY, with "
        f"TINKER_BASE_URL={local_node.discovered_url(TINKER_API) or TINKER_API.default_url}):",
        file=sys.stderr,
    )
    print(TINKER_KEY_PREFIX + issued["token"])
    return 0


def _secret_value(args: argparse.Namespace) -> bytes:
    if args.from_env:
        from_env = os.environ.get(args.from_env)
        if from_env is None:
            raise VaultError(0, f"environment variable {args.from_env} is not set")
        return from_env.encode()
    if sys.stdin.isatty():
        print("value (end with Ctrl-D):", file=sys.stderr)
    value = sys.stdin.buffer.read()
    # A trailing newline from `echo` or a heredoc is not part of a key.
    return value.removesuffix(b"\n").removesuffix(b"\r")


def _secrets_set(args: argparse.Namespace) -> int:
    value = _secret_value(args)
    if not value:
        raise VaultError(0, "empty value: pipe the secret on stdin or use --from-env VAR")
    with _vault(args) as vault:
        info = vault.set_secret(args.name, value, args.org)
    print(f"stored {info['name']} for org {info['org_id']}, sealed to key {info['key_id']}")
    return 0


def _secrets_list(args: argparse.Namespace) -> int:
    with _vault(args) as vault:
        secrets = vault.list_secrets(args.org)
    if not secrets:
        print("no secrets")
    for s in secrets:
        print(f"{s['name']:32} key {s['key_id']:20} updated {s['updated_at']}")
    return 0


def _secrets_rm(args: argparse.Namespace) -> int:
    with _vault(args) as vault:
        vault.delete_secret(args.name, args.org)
    print(f"deleted {args.name}")
    return 0


def _rotate(args: argparse.Namespace) -> int:
    with _vault(args) as vault:
        rotated = vault.rotate_key(args.org)
    print(
        f"org {rotated['org_id']} now seals to key {rotated['key_id']}; re-sealed {rotated['resealed']} secret(s)"
    )
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--vault-url", default=None, help=f"default: {VAULT.client_url_env} or {VAULT.default_url}"
    )
    common.add_argument("--org", default=None, help="default: the org of RLNODE_TOKEN")

    vault = commands.add_parser("vault", help="credential-vault administration")
    vault_sub = vault.add_subparsers(dest="vault_command", required=True, metavar="ACTION")
    vault_sub.add_parser(
        "master-key", help="print a new random master key (VAULT_MASTER_KEY)"
    ).set_defaults(run=_master_key)

    org = commands.add_parser("org", help="orgs (create needs RLNODE_ADMIN_TOKEN)")
    org_sub = org.add_subparsers(dest="org_command", required=True, metavar="ACTION")
    create = org_sub.add_parser(
        "create", parents=[common], help="create an org; prints its admin token"
    )
    create.add_argument("org_id")
    create.add_argument("--name", default=None)
    create.set_defaults(run=_org_create)
    rotate = org_sub.add_parser(
        "rotate-key", parents=[common], help="new key pair; re-seal every secret"
    )
    rotate.set_defaults(run=_rotate)

    token = commands.add_parser("token", help="issue tokens")
    token_sub = token.add_subparsers(dest="token_command", required=True, metavar="ACTION")
    tcreate = token_sub.add_parser("create", parents=[common], help="issue a token; prints it once")
    tcreate.add_argument("name", help="a label (org token) or the service's name (--service)")
    tcreate.add_argument(
        "--service", action="store_true", help="a service token (needs RLNODE_ADMIN_TOKEN)"
    )
    tcreate.add_argument(
        "--scope",
        action="append",
        default=[],
        help=f"repeatable; org scopes: {', '.join(sorted(ORG_SCOPES))}; service scopes: {', '.join(sorted(SERVICE_SCOPES))}",
    )
    tcreate.add_argument("--ttl-s", type=int, default=None, help="lifetime in seconds")
    tcreate.set_defaults(run=_token_create)

    tinker = commands.add_parser("tinker", help="the Tinker API (the tinker SDK's server)")
    tinker_sub = tinker.add_subparsers(dest="tinker_command", required=True, metavar="ACTION")
    tkey = tinker_sub.add_parser(
        "key", parents=[common], help="issue a Tinker API key (TINKER_API_KEY); prints it once"
    )
    tkey.add_argument("--name", default="tinker", help="a label for the key")
    tkey.add_argument("--ttl-s", type=int, default=None, help="lifetime in seconds")
    tkey.set_defaults(run=_tinker_key)

    secrets = commands.add_parser("secrets", help="sealed secrets of your org")
    secrets_sub = secrets.add_subparsers(dest="secrets_command", required=True, metavar="ACTION")
    sset = secrets_sub.add_parser(
        "set", parents=[common], help="seal a value locally and upload it"
    )
    sset.add_argument("name")
    sset.add_argument(
        "--from-env", metavar="VAR", help="take the value from this environment variable, not stdin"
    )
    sset.set_defaults(run=_secrets_set)
    secrets_sub.add_parser(
        "list", parents=[common], help="names and times, never values"
    ).set_defaults(run=_secrets_list)
    srm = secrets_sub.add_parser("rm", parents=[common], help="delete a secret")
    srm.add_argument("name")
    srm.set_defaults(run=_secrets_rm)
