"""The audit log's hash chain: intact across restarts, and any edit, insert or deletion detected."""

from __future__ import annotations

import json

from deepserve.server.audit import AuditLog, verify_chain


def write_records(path, n: int, log_prompts: bool = False) -> None:
    log = AuditLog(str(path), log_prompts=log_prompts)
    for i in range(n):
        log.write(key="k", outcome="ok", prompt_tokens=i, prompt="secret prompt")
    log.close()


def test_chain_continues_across_restarts(tmp_path):
    path = tmp_path / "audit.jsonl"
    write_records(path, 3)
    write_records(path, 2)
    assert verify_chain(str(path)) == (5, None)
    assert "secret prompt" not in path.read_text()


def test_prompts_only_when_enabled(tmp_path):
    path = tmp_path / "audit.jsonl"
    write_records(path, 1, log_prompts=True)
    assert json.loads(path.read_text())["prompt"] == "secret prompt"


def test_tampering_detected(tmp_path):
    path = tmp_path / "audit.jsonl"
    write_records(path, 4)
    lines = path.read_text().splitlines()

    edited = lines.copy()
    edited[1] = edited[1].replace('"prompt_tokens": 1', '"prompt_tokens": 99')
    path.write_text("\n".join(edited) + "\n")
    assert verify_chain(str(path)) == (1, "line 2 was modified (hash mismatch)")

    path.write_text("\n".join(lines[:1] + lines[2:]) + "\n")  # a deleted record
    assert verify_chain(str(path))[0] == 1

    path.write_text("\n".join(lines[:2] + ["{not json"] + lines[2:]) + "\n")
    assert verify_chain(str(path)) == (2, "line 3 is not JSON")
