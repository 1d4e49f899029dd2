"""Audit log: one JSON line per request, each chained to the previous one by SHA-256.

Record i carries `prev` = the hash of record i-1 and `hash` = SHA-256(prev + canonical JSON of the
record without `hash`). Editing, inserting or deleting a line breaks every later link, which
`verify_chain()` reports (`deepserve audit verify FILE...`, or `python -m deepserve.server.audit FILE...`).
The chain continues across restarts from the file's last line, and across rotation: after logrotate (or
anyone) renames the file, SIGHUP makes the server reopen the path, and the new file's first record links
to the old file's last. Verify rotated files oldest first to check the whole chain; a rotated file verified
alone needs --continues (it links to a hash of an earlier file, which is then printed), since without the
earlier file a deletion of its first records cannot be told from a rotation. Prompts are recorded only when enabled.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from typing import Any

GENESIS = "0" * 64


def _digest(prev: str, record: dict[str, Any]) -> str:
    body = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256((prev + body).encode("utf-8")).hexdigest()


def _last_hash(path: str) -> str:
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return GENESIS
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - 65536))
        lines = f.read().splitlines()
    for line in reversed(lines):
        if line.strip():
            return json.loads(line)["hash"]
    return GENESIS


class AuditLog:
    def __init__(self, path: str, log_prompts: bool = False) -> None:
        self.path = path
        self.log_prompts = log_prompts
        self._lock = threading.Lock()
        self._prev = _last_hash(path)
        self._file = self._open()

    def _open(self):
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        return os.fdopen(fd, "a", encoding="utf-8")

    def reopen(self) -> None:
        """Opens the path anew (SIGHUP after rotation); the chain goes on from the last record written,
        whatever file held it."""
        with self._lock:
            self._file.close()
            self._file = self._open()

    def write(self, **fields: Any) -> None:
        if not self.log_prompts:
            fields.pop("prompt", None)
        record = {"time": round(time.time(), 6), **fields}
        with self._lock:
            record["prev"] = self._prev
            record["hash"] = self._prev = _digest(self._prev, record)
            self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
            self._file.flush()

    def admin(self, key_name: str | None, action: str, client: str, status: int, **details: Any) -> None:
        """An administrator's change (a key reload, a backend drained): who, what, from where, and whether it
        took (`admin_ok`, or `admin_rejected_<status>` with why: apart from the requests' outcomes)."""
        self.write(key=key_name, outcome="admin_ok" if status < 400 else f"admin_rejected_{status}", endpoint=action,
                   client=client, status=status, **{k: v for k, v in details.items() if v is not None})

    def close(self) -> None:
        self._file.close()


def verify_chain(*paths: str, continues: bool = False) -> tuple[int, str | None]:
    """Files of one chain, oldest first: (number of valid records, None) if the chain is intact, else
    (index of the first bad record over all files, why). continues: the first file may continue an
    earlier one (a rotated file); otherwise the chain must start in it."""
    count, _, problem = _verify(paths, continues)
    return count, problem


def _verify(paths: tuple[str, ...], continues: bool) -> tuple[int, str | None, str | None]:
    # -> (records, the hash the first file continues from or None for the chain's start, problem)
    prev, count, start = None, 0, None
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f):
                where = f"{os.path.basename(path)} line {i + 1}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    return count, start, f"{where} is not JSON"
                claimed = record.pop("hash", None)
                if prev is None:  # the first record read: the chain's start, or a rotated file's
                    prev = record.get("prev") if continues else GENESIS
                    start = None if prev == GENESIS else prev
                if record.get("prev") != prev:
                    return count, start, f"{where} does not link to the record before it"
                if claimed != _digest(prev, record):
                    return count, start, f"{where} was modified (hash mismatch)"
                prev, count = claimed, count + 1
    return count, start, None


def main(paths: list[str], continues: bool = False) -> int:
    count, start, problem = _verify(tuple(paths), continues)
    if problem:
        print(f"BROKEN after {count} good records: {problem}")
        return 1
    origin = "from the start" if start is None else f"continuing from hash {start[:16]}... (an earlier file)"
    print(f"ok: {count} records, chain intact {origin}")
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main([a for a in args if a != "--continues"], "--continues" in args))
