"""Editing the API key file (`deepserve keys add|revoke|rotate`; its format: server/auth.py).

One command at a time under `<file>.lock`; the file is replaced through a rename (a reload sees the old file or
the new one), keeps its owner and mode, and is refused rather than rewritten when it does not load as keys.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import grp
import os
import pwd
import stat
import tempfile
from collections.abc import Callable, Iterator

import yaml

from deepserve.server.auth import ApiKey, generate_key, hash_key, keys_from_doc, parse_key_entry
from deepserve.server.yaml_file import load_yaml


def add_key_to_file(path: str, name: str, role: str, models: list[str], limits: dict[str, int | None]) -> str:
    """Append a new key to `path` (created if absent) and return the secret; only its hash is stored."""
    with _editing_key_doc(path, create=True) as keys_doc:
        if any(e.get("name") == name for e in keys_doc["keys"]):
            raise ValueError(f"a key named {name!r} already exists in {path}; pick another NAME")
        secret = generate_key()
        entry = {"name": name, "key_hash": hash_key(secret), "role": role, "models": models}
        entry.update({k: v for k, v in limits.items() if v is not None})
        parse_key_entry(len(keys_doc["keys"]), entry)
        keys_doc["keys"].append(entry)
    return secret


def revoke_key_in_file(path: str, name: str) -> ApiKey:
    """Remove the key named `name` from `path` and return what it was (no secret: none is stored).
    Names are unique in any file this accepts (load_key_file refuses duplicates), so it is one entry."""
    with _editing_key_doc(path) as keys_doc:
        i = _entry_index(keys_doc, path, name)
        removed = parse_key_entry(i, keys_doc["keys"].pop(i))
    return removed


def rotate_key_in_file(path: str, name: str) -> tuple[str, ApiKey]:
    """Give the key named `name` a new secret, keeping its place, role, models and limits; return the
    secret (shown once, like add's) and the entry. Only the hash changes, so nothing else can drift."""
    with _editing_key_doc(path) as keys_doc:
        i = _entry_index(keys_doc, path, name)
        secret = generate_key()
        keys_doc["keys"][i]["key_hash"] = hash_key(secret)
        rotated = parse_key_entry(i, keys_doc["keys"][i])
    return secret, rotated


@contextlib.contextmanager
def _editing_key_doc(path: str, create: bool = False) -> Iterator[dict]:
    """The document of the key file `path`, to edit in the block; written back when the block ends without
    an error. The whole read-edit-write holds the file's lock: two commands overlapping would each write
    back what they read, and the second would undo the first (a revoke overlapping an add could bring the
    revoked key back). Without `create` an absent file is refused before a lock file is made beside it."""
    if not create and not os.path.isfile(path):
        load_yaml(path)  # raises the ValueError every command gives for a missing or unreadable file
    with _locked(os.path.realpath(path), path):
        keys_doc = _read_key_doc(path) if not create or os.path.exists(path) else {"keys": []}
        yield keys_doc
        _write_key_doc(path, keys_doc)


@contextlib.contextmanager
def _locked(real_path: str, path: str) -> Iterator[None]:
    """An exclusive flock on `<file>.lock` beside the real file (so a symlink and its target share it),
    released when the block ends. A separate file, because every edit replaces the key file: a lock on it
    would be a lock on the old inode, which the next command no longer opens. The lock file stays: deleting
    it while a command waits on it would let a third command lock a new one at the same time."""
    fd = _open_lock_file(real_path + ".lock", path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # and with it the lock


def _open_lock_file(lock_path: str, path: str) -> int:
    """The lock file, opened read-only (all flock needs) and never through a symlink. Made 0644 whatever the
    umask, as it is empty: a user who may edit the key file can take the lock after root made it."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        try:
            fd = os.open(lock_path, flags | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return os.open(lock_path, flags)
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o644)
        return fd
    except OSError as e:
        raise _not_writable(path, e) from None


def _read_key_doc(path: str) -> dict:
    """The file's document as written, to edit and write back, parsed once; a file that does not load as
    keys is refused rather than rewritten, so a typo is never made worse or half-fixed by a command."""
    doc = load_yaml(path)
    keys_from_doc(doc, path)
    doc = doc or {}  # a mapping now, or empty: keys_from_doc refused anything else
    doc.setdefault("keys", [])
    return doc


def _entry_index(keys_doc: dict, path: str, name: str) -> int:
    names = [e["name"] for e in keys_doc["keys"]]
    if name not in names:
        present = f"the keys there are: {', '.join(names)}" if names else "it has no keys"
        raise ValueError(f"no key named {name!r} in {path}; {present}")
    return names.index(name)


def _write_key_doc(path: str, keys_doc: dict) -> None:
    """Write `keys_doc` over the file `path` names through a rename, so readers (a SIGHUP reload) see the old
    file or the new one, never half. A symlink's target is rewritten and the link stays. An existing file
    keeps its owner, group and mode: a `root:deepserve 0640` file the server reads through its group,
    written back as root's 0600, would fail the server's next reload, which then keeps the old keys (the
    revoked one too). A new file is 0600. The temporary file has a random name, made with O_EXCL and
    O_NOFOLLOW (mkstemp), so nobody can plant a file or link at it beforehand."""
    real = os.path.realpath(path)
    old = _stat_or_none(real)
    try:
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(real) + ".", suffix=".tmp", dir=os.path.dirname(real))
    except OSError as e:
        raise _not_writable(path, e) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            if old is not None:
                _keep_owner_and_mode(f.fileno(), old, path)
            yaml.safe_dump(keys_doc, f, sort_keys=False)
            f.flush()
            os.fsync(f.fileno())  # the new content on disk before the name points at it
        os.replace(tmp, real)
    except BaseException as e:
        with contextlib.suppress(OSError):  # no stray temporary file beside the key file
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise _not_writable(path, e) from None
        raise
    _fsync_dir(os.path.dirname(real))


def _stat_or_none(path: str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None


def _keep_owner_and_mode(fd: int, old: os.stat_result, path: str) -> None:
    """The old file's owner and group, then its mode (after, since a chown may clear set-id bits). An owner
    that cannot be kept (not root, and the file is another user's) is refused, nothing changed: the
    command would otherwise report a revoke that a server reading the file as that user never applies."""
    new = os.fstat(fd)
    if (new.st_uid, new.st_gid) != (old.st_uid, old.st_gid):
        try:
            os.fchown(fd, old.st_uid, old.st_gid)
        except OSError as e:
            raise _owner_refused(path, old, e) from None
    os.fchmod(fd, stat.S_IMODE(old.st_mode))


def _owner_refused(path: str, old: os.stat_result, e: OSError) -> ValueError:
    """Why the old owner could not be kept, and who can keep it. A caller who owns the file may give it only
    a group they are in: running as "that user" (themselves) would not help, so they are told so."""
    why = e.strerror or e
    if old.st_uid == os.geteuid() and old.st_gid not in (os.getegid(), *os.getgroups()):
        group = _name(grp.getgrgid, old.st_gid)
        return ValueError(
            f"{path}: cannot keep the file's group {group} ({why}): {_name(pwd.getpwuid, old.st_uid)} owns the "
            f"file but is not a member of group {group}; nothing was changed. Run the command as root or as a "
            "member of that group, so that a server reading the file through its group can still reload it")
    return ValueError(
        f"{path}: cannot keep the file's owner {_owner(old.st_uid, old.st_gid)} ({why}) "
        f"when run as {_owner(os.geteuid(), os.getegid())}; nothing was changed. Run the command as "
        "that user or as root, so that a server reading the file as its owner or group can still "
        "reload it")


def _owner(uid: int, gid: int) -> str:
    """'user:group', by name where the system knows it."""
    return f"{_name(pwd.getpwuid, uid)}:{_name(grp.getgrgid, gid)}"


def _name(lookup: Callable[[int], tuple], i: int) -> str:
    """A user's or group's name (lookup: pwd.getpwuid or grp.getgrgid), or its number if it has none."""
    try:
        return lookup(i)[0]
    except KeyError:
        return str(i)


def _not_writable(path: str, e: OSError) -> ValueError:
    """A failed write as one line naming the key file; the file is as it was."""
    why = f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")
    if e.errno == errno.EROFS:
        return ValueError(f"{path}: the key file is on a read-only filesystem ({why}); nothing was changed. "
                          "A Kubernetes Secret mount is read-only: edit a copy and apply the Secret again "
                          "(docs/deploy.md)")
    if e.errno in (errno.EACCES, errno.EPERM):
        return ValueError(f"{path}: the key file is not writable here ({why}); nothing was changed")
    return ValueError(f"{path}: cannot write the key file ({why}); nothing was changed")


def _fsync_dir(directory: str) -> None:
    """The rename on disk too. Best effort: the change is made either way, and some filesystems refuse."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
