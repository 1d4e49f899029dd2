"""The reliability tier's fuzzing: schemathesis generates requests from the server's own OpenAPI document
(served to admin keys) and sends them to a real server; not one may get a 5xx. Bounded: a fixed seed, a
few examples per operation, a demo engine whose context is 64 tokens, so a generated max_tokens stays
cheap on CPU."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import httpx
import pytest
from serverkit import ADMIN, USER, auth, write_keys

pytest.importorskip("schemathesis")


@pytest.fixture(scope="module")
def srv(server_factory, tmp_path_factory):
    keys = write_keys(str(tmp_path_factory.mktemp("fuzz") / "keys.yaml"))
    return server_factory(["--api-keys", keys, "--max-model-len", "64"])


def test_the_openapi_document_is_for_admin_keys_and_lists_the_bodies(srv):
    assert httpx.get(f"{srv.url}/admin/openapi.json", headers=auth(USER), timeout=30).status_code == 403
    doc = httpx.get(f"{srv.url}/admin/openapi.json", headers=auth(ADMIN), timeout=30).json()
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    assert "messages" in doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]


def test_no_generated_request_gets_a_server_error(srv, tmp_path):
    # The venv's own first: a suite run by the venv's python without activating it has no st on PATH.
    st = shutil.which("st", path=os.path.dirname(sys.executable)) or shutil.which("st")
    assert st, "schemathesis's CLI is part of the test extras"
    done = subprocess.run(
        [st, "run", f"{srv.url}/admin/openapi.json", "--header", f"Authorization: Bearer {ADMIN}",
         "--checks", "not_a_server_error", "--max-examples", "12", "--seed", "20261201", "--workers", "1",
         "--request-timeout", "60", "--exclude-path", "/admin/keys/reload", "--no-color"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)  # its example database goes there
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    generated = re.search(r"(\d+) generated, (\d+) passed", done.stdout)
    assert generated and int(generated.group(1)) > 500, done.stdout[-2000:]  # it really fuzzed every operation
    assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
