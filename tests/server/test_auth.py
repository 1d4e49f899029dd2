"""Keys: file parsing with clear errors, hashing, roles per route, reload, the route table, and
`deepserve keys revoke|rotate` (on the file, and on a running server after a reload), and how every
`deepserve keys` edit writes the file: owner and mode kept, one edit at a time, through symlinks."""

from __future__ import annotations

import dataclasses
import fcntl
import grp
import os
import signal
import subprocess
import sys
import threading

import httpx
import pytest
import yaml
from serverkit import ADMIN, OTHER_MODEL, ROOT, USER, auth, wait_until, write_keys

import deepserve.server.key_file as key_file_module
from deepserve.entrypoints.cli import main
from deepserve.server.auth import (
    PUBLIC_ROUTES,
    ROUTE_ROLES,
    KeyStore,
    authorize,
    bearer_token,
    hash_key,
    load_key_file,
)
from deepserve.server.errors import APIError
from deepserve.server.key_file import add_key_to_file, revoke_key_in_file, rotate_key_in_file


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
    os.chmod(path, 0o644)  # as an operator may have made it: kept
    before = file_entries(path)
    code, out, err = keys_cli(capsys, "revoke", "bob", "--file", path)
    assert code == 0 and out == ""  # nothing secret to print
    assert "revoked key 'bob' (admin, models=*)" in err
    assert "kill -HUP <pid>" in err and "POST /admin/keys/reload" in err
    # Exactly that entry is gone; the others are as they were, in their order; the mode is the file's.
    assert file_entries(path) == [before[0], before[2]]
    assert [k.name for k in load_key_file(path)] == ["alice", "carol"]
    assert oct(os.stat(path).st_mode & 0o777) == "0o644"
    assert sorted(os.listdir(tmp_path)) == ["keys.yaml", "keys.yaml.lock"]  # no temporary file left
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
        assert err.startswith("deepserve: error: ") and err.count("\n") == 1, err  # one line, no traceback
        assert "'mallory'" in err and path in err, err
        assert all(name in err.split("'mallory'", 1)[1] for name in ("alice", "bob", "carol")), err
    empty = write(tmp_path / "empty.yaml", [])
    code, _, err = keys_cli(capsys, "revoke", "bob", "--file", empty)
    assert code == 2 and "'bob'" in err and "no keys" in err, err
    assert open(path).read() == text  # untouched
    # A file the server would refuse is not rewritten either (duplicate names cannot get in: add and
    # load_key_file refuse them), nor is a missing one created.
    dupes = write(tmp_path / "dupes.yaml", [entry("x"), entry("x", key="other-key-1")])
    code, _, err = keys_cli(capsys, "revoke", "x", "--file", dupes)
    assert code == 2 and "duplicate key name(s) ['x']" in err and len(file_entries(dupes)) == 2
    code, _, err = keys_cli(capsys, "rotate", "x", "--file", str(tmp_path / "none.yaml"))
    assert code == 2 and "none.yaml" in err and not os.path.exists(tmp_path / "none.yaml")
    assert sorted(os.listdir(tmp_path)) == ["dupes.yaml", "dupes.yaml.lock", "empty.yaml", "empty.yaml.lock",
                                            "keys.yaml", "keys.yaml.lock"]


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
    assert new not in open(path).read()
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


# ------------------------------------------------------------------ how `deepserve keys` writes the file

EDITS = {"add": ("add", "dave", "--role", "user"), "revoke": ("revoke", "bob"), "rotate": ("rotate", "bob")}
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file another owner (CI runs as root)")


@pytest.mark.parametrize("edit", EDITS)
@pytest.mark.parametrize("mode", [0o640, 0o644, 0o600], ids=oct)
def test_an_edit_keeps_the_files_mode(tmp_path, capsys, edit, mode):
    # A `root:deepserve 0640` file the server reads through its group came back 0600: the server's next
    # reload failed and kept the old keys, the revoked one too.
    path = str(tmp_path / "keys.yaml")
    three_keys(path)
    os.chmod(path, mode)
    assert keys_cli(capsys, *EDITS[edit], "--file", path)[0] == 0
    assert oct(os.stat(path).st_mode & 0o7777) == oct(mode)


def test_a_new_key_file_is_0600_whatever_the_umask(tmp_path, capsys):
    path = str(tmp_path / "keys.yaml")
    old_umask = os.umask(0)
    try:
        assert keys_cli(capsys, "add", "alice", "--role", "user", "--file", path)[0] == 0
    finally:
        os.umask(old_umask)
    assert oct(os.stat(path).st_mode & 0o7777) == "0o600"


@as_root
@pytest.mark.parametrize("edit", EDITS)
def test_an_edit_keeps_the_files_owner_and_group(tmp_path, capsys, edit):
    # As `sudo deepserve keys revoke` on a file the service user owns: the new file was root's.
    path = str(tmp_path / "keys.yaml")
    three_keys(path)
    os.chown(path, 4242, 4343)
    os.chmod(path, 0o640)
    assert keys_cli(capsys, *EDITS[edit], "--file", path)[0] == 0
    st = os.stat(path)
    assert (st.st_uid, st.st_gid, oct(st.st_mode & 0o7777)) == (4242, 4343, "0o640")


def revoke_with_chown_refused(capsys, monkeypatch, path):
    """`keys revoke bob` where giving the new file its owner or group is not permitted: the one-line
    refusal it must print (exit 2, nothing on stdout)."""
    def fchown(fd, uid, gid):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "fchown", fchown)
    code, out, err = keys_cli(capsys, "revoke", "bob", "--file", path)
    assert (code, out) == (2, "") and err.startswith(f"deepserve: error: {path}: ") and err.count("\n") == 1, err
    return err


@as_root
def test_an_owner_that_cannot_be_kept_is_refused_and_the_file_is_unchanged(tmp_path, capsys, monkeypatch):
    # Not root, and the file is another user's: written anyway, it would be the caller's, which the server
    # may not read; so the command refuses, saying whose file it is, and changes nothing.
    path = str(tmp_path / "keys.yaml")
    three_keys(path)
    os.chown(path, 4242, 4343)
    text = open(path).read()
    err = revoke_with_chown_refused(capsys, monkeypatch, path)
    assert "cannot keep the file's owner 4242:4343" in err and "nothing was changed" in err, err
    assert open(path).read() == text and (os.stat(path).st_uid, os.stat(path).st_gid) == (4242, 4343)
    assert sorted(os.listdir(tmp_path)) == ["keys.yaml", "keys.yaml.lock"]


@as_root
def test_an_owner_outside_the_files_group_is_told_so_not_to_run_as_themselves(tmp_path, capsys, monkeypatch):
    # The caller owns the file, whose group they are not in (alice:deepserve, alice outside deepserve): only
    # root or a member may give the new file that group. "Run as that user" would send them back to themselves.
    path = str(tmp_path / "keys.yaml")
    three_keys(path)
    named = {g.gr_gid for g in grp.getgrall()}  # a gid without a name is shown as its number
    group = next(g for g in range(4343, 5000) if g not in (os.getegid(), *os.getgroups(), *named))
    os.chown(path, os.geteuid(), group)
    text = open(path).read()
    err = revoke_with_chown_refused(capsys, monkeypatch, path)
    assert f"not a member of group {group}" in err and "that user" not in err, err
    assert open(path).read() == text and os.stat(path).st_gid == group
    assert sorted(os.listdir(tmp_path)) == ["keys.yaml", "keys.yaml.lock"]


def test_an_edit_waits_for_one_in_progress_so_neither_change_is_lost(tmp_path, monkeypatch):
    # A revoke and an add overlapping: each wrote back what it had read, so the add brought the revoked
    # key back (or the revoke dropped the added one). The add is started while the revoke sits between
    # its read and its write, and must wait for the lock; the hooks make the overlap certain, not timed.
    path = str(tmp_path / "keys.yaml")
    three_keys(path)
    real_read, real_write, real_flock = key_file_module._read_key_doc, key_file_module._write_key_doc, fcntl.flock
    add_moved, seen, added = threading.Event(), [], []

    def in_add() -> bool:
        return threading.current_thread().name == "add"

    def flock(fd, op):
        if in_add():
            try:
                return real_flock(fd, op | fcntl.LOCK_NB)
            except BlockingIOError:
                seen.append("add waited for the lock")
                add_moved.set()
        return real_flock(fd, op)

    def read(*args):
        doc = real_read(*args)
        if in_add():
            seen.append("add read the file")
            add_moved.set()
        return doc

    def add() -> None:
        added.append(add_key_to_file(path, "dave", "user", ["*"], {}))

    adder = threading.Thread(target=add, name="add", daemon=True)

    def write(*args):
        if not in_add():  # the revoke has read the file and is about to write it back
            adder.start()
            assert add_moved.wait(60)  # the add has read the file too (no lock) or waits for the lock
        real_write(*args)

    monkeypatch.setattr(fcntl, "flock", flock)
    monkeypatch.setattr(key_file_module, "_read_key_doc", read)
    monkeypatch.setattr(key_file_module, "_write_key_doc", write)
    revoke_key_in_file(path, "bob")
    adder.join(60)
    assert not adder.is_alive() and len(added) == 1
    assert [k.name for k in load_key_file(path)] == ["alice", "carol", "dave"]  # bob stays out, dave stays in
    assert seen == ["add waited for the lock", "add read the file"]


def test_twenty_concurrent_adds_in_processes_all_land(tmp_path):
    # The lock between processes, as twenty `deepserve keys add` started at once; they start together.
    path, go = str(tmp_path / "keys.yaml"), str(tmp_path / "go")
    code = ("import os, sys, time\n"
            "from deepserve.server.key_file import add_key_to_file\n"
            "while not os.path.exists(sys.argv[2]):\n"
            "    time.sleep(0.001)\n"
            "add_key_to_file(sys.argv[1], sys.argv[3], 'user', ['*'], {})\n")
    env = {**os.environ, "PYTHONPATH": ROOT}
    procs = [subprocess.Popen([sys.executable, "-c", code, path, go, f"k{i:02d}"], env=env,
                              stderr=subprocess.PIPE, text=True) for i in range(20)]
    open(go, "w").close()
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 20, errors
    assert sorted(k.name for k in load_key_file(path)) == [f"k{i:02d}" for i in range(20)]


def test_an_edit_parses_the_file_once(tmp_path, monkeypatch):
    path = str(tmp_path / "keys.yaml")
    three_keys(path)
    parsed = []
    real = key_file_module.load_yaml
    monkeypatch.setattr(key_file_module, "load_yaml", lambda p: parsed.append(p) or real(p))
    revoke_key_in_file(path, "bob")
    rotate_key_in_file(path, "alice")
    add_key_to_file(path, "dave", "user", ["*"], {})
    assert parsed == [path] * 3


@pytest.mark.parametrize("edit", EDITS)
def test_a_symlinked_key_file_is_edited_at_its_target_and_stays_a_link(tmp_path, capsys, edit):
    # The link was replaced by a regular file holding the edit, and the target kept the old keys: a
    # server reading the target never saw the revoke.
    (tmp_path / "secrets").mkdir()
    target = str(tmp_path / "secrets" / "keys.yaml")
    three_keys(target)
    before = file_entries(target)
    link = str(tmp_path / "keys.yaml")
    os.symlink("secrets/keys.yaml", link)
    assert keys_cli(capsys, *EDITS[edit], "--file", link)[0] == 0
    assert os.path.islink(link) and os.readlink(link) == "secrets/keys.yaml"
    after = file_entries(target)
    names = {"add": ["alice", "bob", "carol", "dave"], "revoke": ["alice", "carol"],
             "rotate": ["alice", "bob", "carol"]}
    assert after != before and [e["name"] for e in after] == names[edit]
    assert sorted(os.listdir(tmp_path / "secrets")) == ["keys.yaml", "keys.yaml.lock"]  # the lock beside the target
    assert sorted(os.listdir(tmp_path)) == ["keys.yaml", "secrets"]


def test_a_file_planted_at_the_old_temporary_name_is_not_followed(tmp_path):
    # The temporary file was `keys.yaml.tmp<pid>`, opened without O_EXCL or O_NOFOLLOW: a link planted
    # there made the command write through it, then rename the link over the key file.
    path = str(tmp_path / "keys.yaml")
    three_keys(path)
    victim = tmp_path / "victim"
    victim.write_text("not yours\n")
    planted = f"{path}.tmp{os.getpid()}"
    os.symlink(victim, planted)
    add_key_to_file(path, "dave", "user", ["*"], {})
    assert victim.read_text() == "not yours\n" and os.path.islink(planted)
    assert not os.path.islink(path) and [k.name for k in load_key_file(path)][-1] == "dave"
    assert sorted(os.listdir(tmp_path)) == sorted(["keys.yaml", "keys.yaml.lock", "victim", os.path.basename(planted)])


def test_the_temporary_file_is_on_disk_before_the_rename(tmp_path, monkeypatch):
    # Without the fsync a crash just after the rename could leave an empty key file (or the old one back).
    path = str(tmp_path / "keys.yaml")
    three_keys(path)
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append("fsync") or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append("replace") or real_replace(a, b))
    revoke_key_in_file(path, "bob")
    assert events == ["fsync", "replace", "fsync"]  # the file's data, the rename, the directory
