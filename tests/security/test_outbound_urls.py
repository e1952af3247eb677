"""An org registers an external Task App whose URL points inside the node or its network
(loopback, the cloud metadata address, private ranges) to make the gateway call it, and
reads what answered through `verify`."""

from __future__ import annotations

import pytest

from rlnode.bus.localbroker import free_port
from rlnode.node.processes import ServiceProcess
from rlnode.sdk.gateway import GatewayClient, GatewayError
from rlnode.service.registry import GATEWAY
from tests.security.conftest import AttackedNode

SECRET_PAGE = "ami-id: i-0123 secret-access-key: AKIA-do-not-leak"


@pytest.fixture(scope="module")
def strict_gateway(attacked: AttackedNode):
    """A gateway as production runs it: public addresses only."""
    process = ServiceProcess(
        GATEWAY,
        free_port(),
        attacked.directory / "strict-gateway.log",
        env={
            "GATEWAY_VAULT_URL": attacked.url("credential-vault"),
            "DATABASE_URL": f"sqlite:///{attacked.directory / 'strict-gateway.sqlite3'}",
            "RLNODE_DATA_DIR": str(attacked.directory / "strict-gateway"),
        },
    ).start()
    process.wait_healthy()
    yield process
    process.stop()


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("http://127.0.0.1:{port}", "loopback"),
        ("http://localhost:{port}", "loopback"),
        ("http://[::1]:{port}", "loopback"),
        ("http://169.254.169.254/latest/meta-data", "link-local"),
        ("http://10.1.2.3:8080", "private"),
        ("http://0.0.0.0:{port}", "private"),
    ],
)
def test_internal_addresses_are_refused_where_not_allowed(
    attacked: AttackedNode, strict_gateway, url: str, kind: str
) -> None:
    target = url.format(port=attacked.node.processes["credential-vault"].port)
    with GatewayClient(strict_gateway.url, attacked.attacker.token) as gateway:
        with pytest.raises(GatewayError) as refused:
            gateway.register("inside", url=target)
    assert refused.value.status == 400
    assert f"a {kind} address" in refused.value.message


def test_the_embedded_node_allows_loopback_only_and_verify_returns_no_body(
    attacked: AttackedNode,
) -> None:
    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse

    from rlnode.testing import ThreadedServer

    page = FastAPI()

    @page.get("/{path:path}")
    def anything(path: str) -> PlainTextResponse:
        return PlainTextResponse(SECRET_PAGE, status_code=500)

    with (
        ThreadedServer(page) as internal,
        GatewayClient(attacked.url("taskapp-gateway"), attacked.attacker.token) as gateway,
    ):
        with pytest.raises(GatewayError, match="a link-local address"):
            gateway.register("metadata", url="http://169.254.169.254")
        gateway.register("internal", url=internal.url)
        report = gateway.verify("internal")
        gateway.remove("internal")
    assert not report["ok"]
    assert SECRET_PAGE not in str(report) and "info" not in report
