"""`deepserve serve` flags and --config YAML, `deepserve keys`, and settings validation."""

from __future__ import annotations

import argparse
import errno
import os
import socket
import subprocess
import sys
import time

import pytest
from serverkit import ROOT

from deepserve.entrypoints.serve import add_keys_parser, add_serve_parser, apply_config_file, settings_from
from deepserve.server.auth import hash_key, load_key_file
from deepserve.server.settings import ServerSettings


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    add_keys_parser(sub)
    ns = parser.parse_args(argv)
    ns._argv = argv  # as cli.main keeps it
    return ns


def test_vllm_flag_names():
    ns = parse(["serve", "/models/x", "--host", "0.0.0.0", "--port", "9000", "--served-model-name", "a", "b",
                "--max-model-len", "4096", "--gpu-memory-utilization", "0.8", "--tensor-parallel-size", "1",
                "--enable-chunked-prefill", "--no-enable-prefix-caching", "--kv-cache-dtype", "auto",
                "--dtype", "bfloat16", "--max-num-seqs", "8", "--max-num-batched-tokens", "2048",
                "--api-key", "sk-abcdefgh", "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem",
                "--ssl-ca-certs", "ca.pem", "--ssl-cert-reqs", "2", "--reasoning-parser", "deepseek_r1",
                "--shutdown-timeout", "5"])
    s = settings_from(ns)
    assert (s.host, s.port, s.served_model_names, s.api_keys, s.ssl_cert_reqs, s.reasoning_parser) == \
        ("0.0.0.0", 9000, ["a", "b"], ["sk-abcdefgh"], 2, "deepseek_r1")
    assert ns.model == "/models/x" and ns.max_model_len == 4096 and ns.enable_prefix_caching is False
    assert ns.func.__name__ == "cmd_serve"


def test_tool_and_template_flags():
    ns = parse(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "deepseek_v31",
                "--default-chat-template-kwargs", '{"thinking": true}'])
    s = settings_from(ns)
    assert (s.enable_auto_tool_choice, s.tool_call_parser, s.default_chat_template_kwargs) == \
        (True, "deepseek_v31", {"thinking": True})
    with pytest.raises(SystemExit):
        parse(["serve", "--default-chat-template-kwargs", "[1]"])


def test_config_file_fills_defaults_and_flags_win(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("port: 7000\nmax-model-len: 2048\nserved_model_name: r1\nmax_num_seqs: '16'\n"
                   "reasoning-parser: deepseek_r1\nhf-overrides: {num_hidden_layers: 8}\n")
    ns = parse(["serve", "--config", str(cfg), "--port", "7100"])
    apply_config_file(ns, ns._parser)
    assert (ns.port, ns.max_model_len, ns.served_model_name, ns.max_num_seqs, ns.reasoning_parser) == \
        (7100, 2048, ["r1"], 16, "deepseek_r1")
    assert ns.hf_overrides == {"num_hidden_layers": 8}
    # A flag given with its default value still wins over the file (it was once taken for "not given").
    cfg.write_text("port: 7000\nenable-prefix-caching: false\nmax-num-seqs: 16\n")
    ns = parse(["serve", "--config", str(cfg), "--port", "8000", "--enable-prefix-caching"])
    apply_config_file(ns, ns._parser)
    assert (ns.port, ns.enable_prefix_caching, ns.max_num_seqs) == (8000, True, 16)
    # Reached without cli.main (no command line kept): flags at their defaults take the file's values.
    ns = parse(["serve", "--config", str(cfg), "--port", "8000"])
    del ns._argv
    apply_config_file(ns, ns._parser)
    assert (ns.port, ns.max_num_seqs) == (7000, 16)


@pytest.mark.parametrize(("text", "message"), [("prot: 1\n", "unknown key 'prot'"),
                                               ("port: many\n", "port must be int"), ("- 1\n", "mapping"),
                                               ('hf-overrides: "{not json"\n', "hf-overrides: --hf-overrides must"),
                                               ("hf-overrides: [1, 2]\n", "must be a JSON object")])
def test_config_file_errors(tmp_path, text, message):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    ns = parse(["serve", "--config", str(cfg)])
    with pytest.raises(ValueError, match=message):
        apply_config_file(ns, ns._parser)


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"port": 0}, "--port"), ({"max_n": 0}, "--max-n"), ({"shutdown_timeout": -1}, "--shutdown-timeout"),
    ({"reasoning_parser": "qwen"}, "--reasoning-parser"), ({"ssl_cert_reqs": 2}, "--ssl-cert-reqs"),
    ({"ssl_keyfile": "k.pem"}, "--ssl-keyfile"), ({"api_keys": ["short"]}, "--api-key"),
    ({"tool_call_parser": "hermes"}, "--tool-call-parser"), ({"enable_auto_tool_choice": True}, "--tool-call-parser"),
    ({"default_chat_template_kwargs": ["thinking"]}, "--default-chat-template-kwargs"),
    ({"default_chat_template_kwargs": {"add_generation_prompt": False}}, "--default-chat-template-kwargs: add_gen"),
])
def test_settings_errors_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        ServerSettings(**kwargs)


def test_keys_add_and_list(tmp_path, capsys):
    path = str(tmp_path / "keys.yaml")
    ns = parse(["keys", "add", "alice", "--role", "user", "--file", path, "--models", "m1",
                "--tokens-per-minute", "5000"])
    assert ns.func(ns) == 0
    secret = capsys.readouterr().out.strip()
    (key,) = load_key_file(path)
    assert key.digest.hex() == hash_key(secret)[7:] and key.tokens_per_minute == 5000
    ns = parse(["keys", "list", "--file", path])
    ns.func(ns)
    listed = capsys.readouterr().out
    assert "alice\tuser\tmodels=m1\ttokens_per_minute=5000" in listed and secret not in listed


def test_port_in_use_fails_fast_in_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "deepserve.entrypoints.cli", "serve", "--host", "127.0.0.1",
                            "--port", str(port), "--api-key", "sk-test-admin-0000"],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path,
                           env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode != 0
    assert f"port {port} on 127.0.0.1 is in use; pick another with --port" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout and "engine" not in r.stderr.lower(), r.stderr
    assert time.monotonic() - t0 < 60


def test_node_other_than_0_runs_its_ranks_without_binding_the_http_port(monkeypatch):
    import deepserve.entrypoints.cli as cli
    import deepserve.server.api_server as api_server

    ran = []
    monkeypatch.setattr(cli, "_run_worker_node", lambda args: ran.append(args.node_rank) or 0)
    monkeypatch.setattr(api_server, "bind_listener", lambda *a: pytest.fail("node 1 bound the HTTP port"))
    ns = parse(["serve", "--nnodes", "2", "--node-rank", "1", "--tensor-parallel-size", "2",
                "--master-port", "29999", "--device", "cpu"])
    with pytest.raises(SystemExit) as exit_info:
        ns.func(ns)
    assert exit_info.value.code == 0 and ran == [1]


@pytest.mark.parametrize("argv", [["serve", "--api-keys", "bad.yaml"], ["keys", "list", "--file", "bad.yaml"],
                                  ["keys", "add", "bob", "--role", "user", "--file", "bad.yaml"],
                                  ["keys", "revoke", "bob", "--file", "bad.yaml"],
                                  ["serve", "--config", "bad.yaml"]])
def test_malformed_yaml_is_one_line_error_not_a_traceback(tmp_path, argv):
    (tmp_path / "bad.yaml").write_text("port: 8000\nkeys: [\n")
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("DEEPSERVE_API_KEY", None)
    run = subprocess.run([sys.executable, "-m", "deepserve.entrypoints.cli", *argv], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    assert run.stderr.startswith("deepserve: error: bad.yaml: not valid YAML (line 3"), run.stderr


def test_a_bad_key_file_fails_before_the_port_is_bound_or_the_model_loaded(tmp_path, monkeypatch, capsys):
    # The key file is checked first: otherwise the same error came after the model had loaded, with the
    # port held meanwhile (and a taken port answered instead).
    import deepserve.server.api_server as api_server
    import deepserve.server.async_llm as async_llm
    from deepserve.entrypoints.cli import main

    monkeypatch.setattr(api_server, "bind_listener", lambda *a: pytest.fail("bound the port first"))
    monkeypatch.setattr(async_llm.AsyncLLM, "from_engine_args", lambda *a: pytest.fail("loaded the model first"))
    (tmp_path / "bad.yaml").write_text("keys: [\n")
    assert main(["serve", "--api-keys", str(tmp_path / "bad.yaml")]) == 2
    assert capsys.readouterr().err.startswith(f"deepserve: error: {tmp_path / 'bad.yaml'}: not valid YAML (line 2")


@pytest.mark.parametrize("make, message", [
    (lambda p: p.write_bytes(b"keys:\n  - name: caf\xe9\n"), "not UTF-8 text (byte 19: invalid continuation byte)"),
    (lambda p: p.mkdir(), "Is a directory"),
    (lambda p: None, "No such file or directory")])
@pytest.mark.parametrize("command", [["keys", "list", "--file"], ["keys", "revoke", "bob", "--file"],
                                     ["keys", "rotate", "bob", "--file"], ["serve", "--config"]])
def test_unreadable_yaml_is_one_line_error_naming_the_file(tmp_path, capsys, make, message, command):
    # A Latin-1 file once printed "'utf-8' codec can't decode byte 0xe9 ..." without the file's name, and
    # a directory gave an IsADirectoryError traceback.
    from deepserve.entrypoints.cli import main

    path = tmp_path / "keys.yaml"
    make(path)
    assert main([*command, str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"deepserve: error: {path}: {message}\n"


@pytest.mark.parametrize("lock_exists", [False, True], ids=["no-lock", "lock"])  # made while it was writable
@pytest.mark.parametrize("command", [["keys", "revoke", "alice", "--file"], ["keys", "rotate", "alice", "--file"],
                                     ["keys", "add", "bob", "--role", "user", "--file"]])
@pytest.mark.parametrize("err", [errno.EROFS, errno.EACCES], ids=["EROFS", "EACCES"])
def test_a_key_file_that_cannot_be_written_is_one_line_error_naming_it(tmp_path, capsys, monkeypatch, lock_exists,
                                                                       command, err):
    # A Kubernetes Secret mount is read-only: the edit was a PermissionError / OSError traceback. Nothing may be
    # created in the folder (simulated: this runs as root in CI, which a chmod does not stop).
    from deepserve.entrypoints.cli import main
    from deepserve.server.key_file import add_key_to_file

    path = str(tmp_path / "keys.yaml")
    add_key_to_file(path, "alice", "user", ["*"], {})
    if not lock_exists:
        os.unlink(path + ".lock")
    before = sorted(os.listdir(tmp_path)), open(path).read()
    real_open = os.open

    def refusing_open(file, flags, *args, **kwargs):  # as Linux: O_CREAT|O_EXCL on a file there is EEXIST
        exists = flags & os.O_EXCL and os.path.lexists(file)
        if flags & os.O_CREAT and os.path.dirname(os.fspath(file)) == str(tmp_path) and not exists:
            raise OSError(err, os.strerror(err), file)
        return real_open(file, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    assert main([*command, path]) == 2
    out = capsys.readouterr().err
    # One line naming the file and the system's reason; a read-only mount points at the Secret's way (deploy.md).
    assert out.startswith(f"deepserve: error: {path}: ") and out.count("\n") == 1, out
    assert os.strerror(err) in out and (("Secret" in out) == (err == errno.EROFS)), out
    assert (sorted(os.listdir(tmp_path)), open(path).read()) == before


def test_missing_tls_files_fail_before_the_engine_process_starts(tmp_path, monkeypatch, capsys):
    # uvicorn reads them only after the engine process was spawned: checked first, one line naming the flag.
    import deepserve.server.async_llm as async_llm
    from deepserve.entrypoints.cli import main

    monkeypatch.setattr(async_llm.AsyncLLM, "from_engine_args", lambda *a: pytest.fail("started the engine first"))
    (tmp_path / "k.pem").write_text("not a key\n")
    argv = ["serve", "--ssl-keyfile", str(tmp_path / "k.pem"), "--ssl-certfile"]  # fails before the port
    assert main([*argv, str(tmp_path / "missing.pem")]) == 2
    assert "--ssl-certfile" in capsys.readouterr().err
    (tmp_path / "c.pem").write_text("not a certificate\n")
    assert main([*argv, str(tmp_path / "c.pem")]) == 2
    assert "cannot be loaded" in capsys.readouterr().err


def test_a_server_that_fails_before_its_lifespan_stops_the_engine_process(monkeypatch):
    import deepserve.server.api_server as api_server
    import deepserve.server.async_llm as async_llm
    from deepserve.entrypoints.cli import main

    class Engine:
        stopped = False

        def kill_if_unstarted(self) -> None:
            Engine.stopped = True

    def fail(*_a, **_k):
        raise ValueError("uvicorn could not start")

    monkeypatch.setattr(async_llm.AsyncLLM, "from_engine_args", lambda *a: Engine())
    monkeypatch.setattr(api_server, "run_server", fail)
    with socket.socket() as probe:  # a free port: serve binds it before the engine
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(["serve", "--port", str(port), "--api-key", "sk-abcdefgh"]) == 2
    assert Engine.stopped


def test_log_level_reaches_the_engine_process_and_uvicorn(tmp_path):
    # `serve --log-level WARNING` once printed the engine process's INFO start-up lines and uvicorn's
    # ("Uvicorn running on ...", "Application startup complete") all the same. (Server passes --log-level INFO
    # before the command too: the one after it wins.)
    import signal

    from serverkit import Server

    srv = Server(["--log-level", "WARNING"], str(tmp_path))
    proc, log_path = srv.proc, srv.log_path
    try:
        srv.wait_ready()
        assert proc.poll() is None, srv.tail(3000)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, srv.tail(3000)
    finally:
        srv.stop()
    out = open(log_path).read()
    assert "draining: waiting" in out, out[-3000:]  # a WARNING: the log is there, its INFO lines are not
    assert "INFO" not in out, out[-3000:]
