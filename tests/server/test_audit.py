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
    assert verify_chain(str(path)) == (1, "audit.jsonl line 2 was modified (hash mismatch)")

    path.write_text("\n".join(lines[:1] + lines[2:]) + "\n")  # a deleted record
    assert verify_chain(str(path))[0] == 1

    path.write_text("\n".join(lines[:2] + ["{not json"] + lines[2:]) + "\n")
    assert verify_chain(str(path)) == (2, "audit.jsonl line 3 is not JSON")

    path.write_text("\n".join(lines[1:]) + "\n")  # the first record deleted
    assert verify_chain(str(path)) == (0, "audit.jsonl line 1 does not link to the record before it")
    assert verify_chain(str(path), continues=True) == (3, None)  # unless told it is a rotated file


def test_rotation_keeps_one_chain_across_files(tmp_path, capsys):
    from deepserve.server.audit import main

    path = tmp_path / "audit.jsonl"
    log = AuditLog(str(path))
    files = []
    for n in range(3):  # three rotations, as logrotate renames then signals
        for i in range(2):
            log.write(key="k", outcome="ok", prompt_tokens=10 * n + i)
        files.append(str(tmp_path / f"audit.jsonl.{3 - n}"))
        path.rename(files[-1])
        log.reopen()
    log.write(key="k", outcome="ok", prompt_tokens=99)
    log.close()
    files.append(str(path))
    assert verify_chain(*files) == (7, None)
    assert main(files) == 0 and "ok: 7 records, chain intact from the start" in capsys.readouterr().out
    assert verify_chain(files[0], files[2], files[3])[1] == "audit.jsonl.1 line 1 does not link to the record before it"
    assert main([files[3]], continues=True) == 0 and "continuing from hash" in capsys.readouterr().out
    assert main([files[3]]) == 1 and "BROKEN after 0 good records" in capsys.readouterr().out
    from deepserve.entrypoints.cli import main as deepserve

    assert deepserve(["audit", "verify", *files]) == 0 and "7 records" in capsys.readouterr().out
