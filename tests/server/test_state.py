"""Readiness and admission states, with a stub engine: loading, ready, stalled, draining, dead."""

from __future__ import annotations

import pytest

from deepserve.server.auth import ApiKey
from deepserve.server.errors import APIError
from deepserve.server.settings import ServerSettings
from deepserve.server.state import ServerState


class StubEngine:
    def __init__(self) -> None:
        self.dead_reason = None
        self.on_stats = None
        self.is_stalled = False

    def stalled(self, timeout: float) -> bool:
        return self.is_stalled


def status(st: ServerState) -> int:
    try:
        st.check_accepting()
    except APIError as e:
        return e.status
    return 200


def test_lifecycle_states():
    engine = StubEngine()
    st = ServerState(ServerSettings(api_keys=["sk-admin-key"]), engine, ["m"])
    assert st.readiness() == (False, "loading") and status(st) == 503
    st.loaded = True
    assert st.readiness() == (True, "ready") and status(st) == 200
    engine.is_stalled = True
    assert st.readiness()[0] is False and "no progress" in st.readiness()[1]
    engine.is_stalled = False
    st.draining = True
    assert st.readiness() == (False, "draining") and status(st) == 503
    engine.dead_reason = "killed"
    assert st.readiness() == (False, "engine dead: killed") and status(st) == 503


def test_model_scope():
    st = ServerState(ServerSettings(api_keys=["sk-admin-key"]), StubEngine(), ["a", "b"])
    key = ApiKey("k", "user", b"\0" * 32, models=("b",))
    assert st.resolve_model("b", key) == "b" and st.allowed_models(key) == ["b"]
    for name, code in (("a", 403), ("zzz", 404), (None, 403)):  # None means the first served model
        with pytest.raises(APIError) as e:
            st.resolve_model(name, key)
        assert e.value.status == code and e.value.param == "model"
