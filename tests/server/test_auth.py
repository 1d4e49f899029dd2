"""Keys: file parsing with clear errors, hashing, roles per route, reload, the route table, and
`deepserve keys revoke|rotate` (on the file, and on a running server after a reload)."""

from __future__ import annotations

import dataclasses
import os
import signal

import httpx
import pytest
import yaml
from serverkit import ADMIN, OTHER_MODEL, USER, auth, wait_until, write_keys

from deepserve.entrypoints.cli import main
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


# ------------------------------------------------------------------ keys revoke / rotate


def three_keys(path: str) -> dict[str, str]:
    """alice, bob, carol written by add (so, as the CLI writes them); their secrets by name."""
    return {name: add_key_to_file(path, name, role, ["*"], {"requests_per_minute": 5})
            for name, role in (("alice", "user"), ("bob", "admin"), ("carol", "metrics"))}


def file_entries(path: str) -> list[dict]:
    with open(path) as f:
        return yaml.safe_load(f)["keys"]


def keys_cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["keys", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_keys_revoke_removes_that_entry_and_the_others_still_authenticate(tmp_path, capsys):
    path = str(tmp_path / "keys.yaml")
    sk = three_keys(path)
    os.chmod(path, 0o644)
    before = file_entries(path)
    code, out, err = keys_cli(capsys, "revoke", "bob", "--file", path)
    assert code == 0 and out == ""  # nothing secret to print
    assert "revoked key 'bob' (admin, models=*)" in err
    assert "kill -HUP <pid>" in err and "POST /admin/keys/reload" in err
    # Exactly that entry is gone; the others are as they were, in their order; the mode is add's.
    assert file_entries(path) == [before[0], before[2]]
    assert [k.name for k in load_key_file(path)] == ["alice", "carol"]
    assert oct(os.stat(path).st_mode & 0o777) == "0o600" and os.listdir(tmp_path) == ["keys.yaml"]
    store = KeyStore(path)  # what the server loads
    assert store.lookup(sk["alice"]).name == "alice" and store.lookup(sk["carol"]).name == "carol"
    assert store.lookup(sk["bob"]) is None
    assert authorize(store, "/v1/models", [f"Bearer {sk['alice']}"]).name == "alice"
    with pytest.raises(APIError) as e:
        authorize(store, "/admin/usage", [f"Bearer {sk['bob']}"])
    assert e.value.status == 401


def test_keys_revoke_or_rotate_an_unknown_name_is_exit_2_naming_it_and_the_keys(tmp_path, capsys):
    path = str(tmp_path / "keys.yaml")
    three_keys(path)
    text = open(path).read()
    for command in ("revoke", "rotate"):
        code, out, err = keys_cli(capsys, command, "mallory", "--file", path)
        assert (code, out) == (2, "")
        assert err == (f"deepserve: error: no key named 'mallory' in {path}; "
                       "the keys there are: alice, bob, carol\n"), err
    empty = write(tmp_path / "empty.yaml", [])
    assert keys_cli(capsys, "revoke", "bob", "--file", empty)[2].endswith("it has no keys\n")
    assert open(path).read() == text  # untouched
    # A file the server would refuse is not rewritten either (duplicate names cannot get in: add and
    # load_key_file refuse them), nor is a missing one created.
    dupes = write(tmp_path / "dupes.yaml", [entry("x"), entry("x", key="other-key-1")])
    code, _, err = keys_cli(capsys, "revoke", "x", "--file", dupes)
    assert code == 2 and "duplicate key name(s) ['x']" in err and len(file_entries(dupes)) == 2
    code, _, err = keys_cli(capsys, "rotate", "x", "--file", str(tmp_path / "none.yaml"))
    assert code == 2 and "none.yaml" in err and not os.path.exists(tmp_path / "none.yaml")
    assert sorted(os.listdir(tmp_path)) == ["dupes.yaml", "empty.yaml", "keys.yaml"]


def test_keys_rotate_gives_a_new_secret_and_keeps_role_models_and_limits(tmp_path, capsys):
    path = str(tmp_path / "keys.yaml")
    old = add_key_to_file(path, "alice", "user", ["m1", "m2"], {"tokens_per_minute": 1000, "max_concurrent": 2})
    add_key_to_file(path, "bob", "metrics", ["*"], {})
    store = KeyStore(path)
    was = store.lookup(old)
    code, out, err = keys_cli(capsys, "rotate", "alice", "--file", path)
    new = out.strip()
    assert code == 0 and out == new + "\n" and new.startswith("sk-ds-") and new != old  # the secret alone, as add
    assert "rotated key 'alice' (user)" in err and "only time" in err and "POST /admin/keys/reload" in err
    assert new not in open(path).read() and oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert store.lookup(old) == was  # the running set, until it reloads
    assert store.reload() is None
    assert store.lookup(old) is None
    now = store.lookup(new)
    assert now == dataclasses.replace(was, digest=now.digest) and now.digest != was.digest
    assert (now.role, now.models, now.tokens_per_minute, now.max_concurrent) == ("user", ("m1", "m2"), 1000, 2)
    assert [k.name for k in load_key_file(path)] == ["alice", "bob"]  # same place in the file


def test_revoked_and_rotated_keys_take_effect_on_a_running_server_when_it_reloads(server_factory, tmp_path, capsys):
    # As test_api_e2e's SIGHUP test: a real server; the CLI edits its file, SIGHUP / the admin route reload it.
    keys = write_keys(str(tmp_path / "keys.yaml"))
    srv = server_factory(["--api-keys", keys])

    def status(key: str) -> int:
        return httpx.get(f"{srv.url}/v1/models", headers=auth(key), timeout=30).status_code

    assert status(OTHER_MODEL) == 200 and status(USER) == 200
    assert keys_cli(capsys, "revoke", "other", "--file", keys)[0] == 0
    assert status(OTHER_MODEL) == 200  # the file alone changes nothing until the server reloads it
    os.kill(srv.proc.pid, signal.SIGHUP)
    assert wait_until(lambda: status(OTHER_MODEL) == 401, 10)
    assert status(USER) == 200

    code, new, _ = keys_cli(capsys, "rotate", "user", "--file", keys)
    assert code == 0 and status(USER) == 200
    r = httpx.post(f"{srv.url}/admin/keys/reload", headers=auth(ADMIN), timeout=30)
    assert r.status_code == 200 and r.json()["keys"] == 3  # --api-key admin, user, scraper
    assert status(USER) == 401 and status(new.strip()) == 200
    assert srv.proc.poll() is None
