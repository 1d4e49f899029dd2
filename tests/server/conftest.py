"""One real server per test module (see serverkit.Server), stopped by pid at module teardown."""

from __future__ import annotations

import pytest
from serverkit import Server


@pytest.fixture(scope="module")
def server_factory(tmp_path_factory):
    servers: list[Server] = []

    def start(args: list[str], scheme: str = "http", wait: bool = True, **client_kwargs) -> Server:
        srv = Server(args, str(tmp_path_factory.mktemp("srv")), scheme)
        servers.append(srv)
        if wait:
            srv.wait_ready(**client_kwargs)
        return srv

    yield start
    for srv in servers:
        srv.stop()
