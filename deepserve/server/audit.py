"""Audit log: one JSON line per request, each chained to the previous one by SHA-256.

Record i carries `prev` = the hash of record i-1 and `hash` = SHA-256(prev + canonical JSON of the
record without `hash`). Editing, inserting or deleting a line breaks every later link, which
`verify_chain()` reports (`python -m deepserve.server.audit FILE`). The chain continues across
restarts from the file's last line. Prompts are recorded only when enabled.
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
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._file = os.fdopen(fd, "a", encoding="utf-8")

    def write(self, **fields: Any) -> None:
        if not self.log_prompts:
            fields.pop("prompt", None)
        record = {"time": round(time.time(), 6), **fields}
        with self._lock:
            record["prev"] = self._prev
            record["hash"] = self._prev = _digest(self._prev, record)
            self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
            self._file.flush()

    def close(self) -> None:
        self._file.close()


def verify_chain(path: str) -> tuple[int, str | None]:
    """(number of valid records, None) if the chain is intact, else (index of the first bad line, why)."""
    prev, count = GENESIS, 0
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                return i, f"line {i + 1} is not JSON"
            claimed = record.pop("hash", None)
            if record.get("prev") != prev:
                return i, f"line {i + 1} does not link to the line before it"
            if claimed != _digest(prev, record):
                return i, f"line {i + 1} was modified (hash mismatch)"
            prev, count = claimed, count + 1
    return count, None


if __name__ == "__main__":
    count, problem = verify_chain(sys.argv[1])
    print(problem or f"ok: {count} records, chain intact")
    sys.exit(1 if problem else 0)
