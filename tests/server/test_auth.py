"""Keys: file parsing with clear errors, hashing, roles per route, reload, and the route table."""

from __future__ import annotations

import os

import pytest
import yaml

from deepserve.server.auth import (
    PUBLIC_ROUTES,
    ROUTE_ROLES,
    KeyStore,
    add_key_to_file,
    authorize,
    bearer_token,
    hash_key,
    load_key_file,
)
from deepserve.server.errors import APIError


def write(path, keys) -> str:
    with open(path, "w") as f:
        yaml.safe_dump({"keys": keys}, f)
    return str(path)


def entry(name="a", key="sk-secret-1", role="user", **kw) -> dict:
    return {"name": name, "key_hash": hash_key(key), "role": role, **kw}


def test_add_key_prints_once_and_stores_only_hash(tmp_path):
    path = str(tmp_path / "keys.yaml")
    secret = add_key_to_file(path, "alice", "user", ["m1"], {"requests_per_minute": 10, "tokens_per_minute": None})
    text = open(path).read()
    assert secret.startswith("sk-ds-") and secret not in text and hash_key(secret) in text
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    (key,) = load_key_file(path)
    assert (key.name, key.role, key.models, key.requests_per_minute, key.tokens_per_minute) == \
        ("alice", "user", ("m1",), 10, None)
    with pytest.raises(ValueError, match="already exists"):
        add_key_to_file(path, "alice", "user", ["*"], {})
    add_key_to_file(path, "bob", "metrics", ["*"], {})
    assert [k.name for k in load_key_file(path)] == ["alice", "bob"]


@pytest.mark.parametrize(("bad", "message"), [
    ({"name": "", "role": "user"}, r"keys\[0\].name"),
    ({"role": "root"}, r"keys\[0\].role must be one of"),
    ({"key_hash": "md5:abc"}, r"keys\[0\].key_hash"),
    ({"models": "m1"}, r"keys\[0\].models"),
    ({"requests_per_minute": 0}, r"keys\[0\].requests_per_minute must be a positive integer"),
    ({"max_concurrent": True}, r"keys\[0\].max_concurrent"),
    ({"colour": "red"}, r"unknown field"),
])
def test_key_file_errors_name_the_entry(tmp_path, bad, message):
    path = write(tmp_path / "k.yaml", [{**entry(), **bad}])
    with pytest.raises(ValueError, match=message):
        load_key_file(path)


def test_duplicate_names_refused(tmp_path):
    with pytest.raises(ValueError, match="duplicate"):
        load_key_file(write(tmp_path / "k.yaml", [entry("x"), entry("x", key="other-key-1")]))


def test_one_secret_in_two_entries_is_refused_at_start_and_on_reload(tmp_path):
    # Its rights would be whichever entry matched last; revoking one entry would leave the other working.
    two = [entry("x", "sk-shared-1"), entry("y", "sk-shared-1", role="admin")]
    with pytest.raises(ValueError, match="keys 'x' and 'y' are the same secret"):
        KeyStore(write(tmp_path / "k.yaml", two))
    with pytest.raises(ValueError, match="'api-key' and 'u' are the same secret"):  # --api-key also in the file
        KeyStore(write(tmp_path / "k.yaml", [entry("u", "sk-inline-admin")]), ("sk-inline-admin",))
    # The same inline key twice (--api-key X and $DEEPSERVE_API_KEY=X) is one key, with a file or without.
    twice = KeyStore(write(tmp_path / "k.yaml", [entry("u", "sk-user-1")]), ("sk-inline-admin", "sk-inline-admin"))
    assert twice.names() == ["api-key", "u"]
    path = write(tmp_path / "k.yaml", [entry("x", "sk-shared-1")])
    store = KeyStore(path)
    write(path, two)
    assert "same secret" in store.reload() and store.lookup("sk-shared-1").role == "user"  # the old set stays


def test_lookup_and_inline_admin(tmp_path):
    store = KeyStore(write(tmp_path / "k.yaml", [entry("u", "sk-user-1")]), ("sk-inline-admin",))
    assert store.lookup("sk-user-1").name == "u"
    assert store.lookup("sk-inline-admin").role == "admin"
    assert store.lookup("sk-user-2") is None and store.lookup("") is None


def test_reload_swaps_keys_and_keeps_old_on_error(tmp_path):
    path = write(tmp_path / "k.yaml", [entry("u", "sk-user-1")])
    store = KeyStore(path)
    write(path, [entry("v", "sk-user-2")])
    assert store.reload() is None and store.lookup("sk-user-2") and store.lookup("sk-user-1") is None
    with open(path, "w") as f:
        f.write("keys: [ {name: broken")
    assert store.reload() is not None
    assert store.lookup("sk-user-2").name == "v"


def test_bearer_parsing():
    assert bearer_token(["Bearer abc"]) == "abc" and bearer_token(["bearer  abc "]) == "abc"
    for bad in ([], ["Basic abc"], ["abc"], ["Bearer "], ["Bearer a", "Bearer a"]):
        assert bearer_token(bad) is None


def test_authorize_matrix(tmp_path):
    store = KeyStore(write(tmp_path / "k.yaml", [entry("u", "sk-u-1"), entry("m", "sk-m-1", role="metrics")]),
                     ("sk-admin-1",))
    assert authorize(store, "/health", []) is None and authorize(store, "/ready", []) is None
    assert authorize(store, "/v1/completions", ["Bearer sk-u-1"]).name == "u"
    for path, header, status in [("/v1/completions", [], 401), ("/v1/completions", ["Bearer nope"], 401),
                                 ("/metrics", ["Bearer sk-u-1"], 403), ("/v1/models", ["Bearer sk-m-1"], 403),
                                 ("/admin/usage", ["Bearer sk-u-1"], 403),
                                 ("/some/new/route", ["Bearer sk-admin-1"], 403), (None, ["Bearer sk-u-1"], 403)]:
        with pytest.raises(APIError) as e:
            authorize(store, path, header)
        assert e.value.status == status, (path, header)


def test_no_keys_message_points_to_flag(tmp_path):
    with pytest.raises(APIError, match="--api-key"):
        authorize(KeyStore(), "/v1/models", [])
    with pytest.raises(APIError, match="no API keys configured; see --api-key"):  # a key sent, none to match
        authorize(KeyStore(), "/v1/models", ["Bearer sk-local-demo"])
    with pytest.raises(APIError) as e:  # a server with keys: a wrong key is just wrong
        authorize(KeyStore(write(tmp_path / "k.yaml", [entry("u", "sk-u-1")])), "/v1/models", ["Bearer nope"])
    assert e.value.message == "invalid API key"


def test_every_app_route_has_a_policy():
    from fastapi.routing import APIRoute

    from deepserve.server.routes import router

    paths = {r.path for r in router.routes if isinstance(r, APIRoute)}
    assert paths == set(ROUTE_ROLES) | PUBLIC_ROUTES
