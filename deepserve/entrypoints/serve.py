"""`deepserve serve [MODEL]` (vLLM's flag names, plus --config FILE.yaml) and `deepserve keys ...`.

cli.py calls add_serve_parser/add_keys_parser and dispatches to the `func` default each sets.
A --config file holds the same keys as the flags (`max-model-len: 4096` or `max_model_len: 4096`);
a flag given on the command line wins over the file.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from deepserve import envs
from deepserve.entrypoints.cli import _json_object_flag
from deepserve.server.settings import ServerSettings
from deepserve.server.yaml_file import load_yaml

DEMO_MODEL_NAME = "deepserve-demo"


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from deepserve.entrypoints.cli import DefaultsHelp, add_engine_args, add_model_args

    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                              description="Serve MODEL (a checkpoint folder; the built-in demo model without one) over "
                                          "an OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, "
                                          "/v1/models, /tokenize, /detokenize, /metrics, /health, /ready. Every route "
                                          "but /health and /ready needs a key (--api-key or --api-keys).",
                              formatter_class=DefaultsHelp)
    add_model_args(p)
    p.add_argument("--config", default=None, help="YAML file with any of these flags as keys")
    d = ServerSettings()
    g = p.add_argument_group("server")
    g.add_argument("--host", default=d.host, help="address to bind (use 0.0.0.0 to expose on every interface)")
    g.add_argument("--port", type=int, default=d.port, help="TCP port to listen on")
    g.add_argument("--api-key", action="append", default=None,
                   help="an admin key (repeatable; also $DEEPSERVE_API_KEY)")
    g.add_argument("--api-keys", default=None, metavar="FILE", help="YAML key file (see `deepserve keys add`)")
    g.add_argument("--ssl-keyfile", default=None, help="TLS private key (PEM); with --ssl-certfile serves HTTPS")
    g.add_argument("--ssl-certfile", default=None, help="TLS certificate chain (PEM)")
    g.add_argument("--ssl-ca-certs", default=None, help="CA bundle for client certificates (mTLS)")
    g.add_argument("--ssl-cert-reqs", type=int, default=d.ssl_cert_reqs,
                   help="client certificates: 0 none, 1 optional, 2 required (mTLS)")
    add_request_args(g)
    g.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help="seconds in-flight requests may run after SIGTERM")
    g.add_argument("--max-waiting-requests", type=int, default=d.max_waiting_requests,
                   help="requests waiting for their first token before new ones get 503")
    g.add_argument("--max-waiting-tokens", type=int, default=d.max_waiting_tokens,
                   help="prompt tokens of the waiting requests before new ones get 503")
    g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, metavar="BYTES",
                   help="largest request body in bytes (larger: 413)")
    g.add_argument("--max-header-bytes", type=int, default=d.max_header_bytes, metavar="BYTES",
                   help="largest request header block in bytes (larger: 431)")
    g.add_argument("--ip-requests-per-minute", type=int, default=None,
                   help="requests per minute per client address (429 beyond); default: no limit")
    g.add_argument("--engine-stall-timeout", type=float, default=d.engine_stall_timeout, metavar="SECONDS",
                   help="/ready answers 503 when requests wait and the engine has sent nothing for this long")
    g.add_argument("--request-read-timeout", type=float, default=d.request_read_timeout, metavar="SECONDS",
                   help="a request whose headers, or then whose body, have not arrived within this many seconds "
                        "is closed (headers) or answered 408 (body)")
    g.add_argument("--forwarded-allow-ips", default=None,
                   help="trust X-Forwarded-For from these proxy IPs (default: trust none)")
    add_engine_args(p)
    p.set_defaults(func=cmd_serve, _parser=p)
    return p


def add_request_args(g: argparse._ArgumentGroup) -> None:
    """How requests are read and answered: the flags `serve` and `run-batch` share."""
    d = ServerSettings()
    g.add_argument("--served-model-name", nargs="+", default=None, help="model name(s) clients ask for")
    g.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1"],
                   help="split <think>...</think> into reasoning_content (DeepSeek-R1 and its distills)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='allow tool_choice "auto" (the default when a request has tools); needs --tool-call-parser')
    g.add_argument("--tool-call-parser", default=None, choices=["deepseek_v3", "deepseek_v31"],
                   help="the model's tool-call markup: deepseek_v3 (V3, R1, the demo) or deepseek_v31 (V3.1)")
    g.add_argument("--default-chat-template-kwargs", type=_json_object_flag("--default-chat-template-kwargs"),
                   default={}, metavar="JSON",
                   help='chat template variables for every request, under the request\'s own '
                        'chat_template_kwargs, e.g. \'{"thinking": true}\' (DeepSeek-V3.1)')
    g.add_argument("--max-n", type=int, default=d.max_n, help="largest n (choices per request) accepted")
    g.add_argument("--audit-log", default=None, metavar="FILE", help="append hash-chained JSON lines here")
    g.add_argument("--audit-log-prompts", action="store_true", help="include prompts in the audit log")


def flags_given(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The dests that `argv` (the command's own arguments) sets: parsed again with every default hidden, so
    a flag given with its default value counts as given."""
    saved = [(a, a.default) for a in parser._actions]
    for action, _ in saved:
        action.default = argparse.SUPPRESS
    try:
        given, _ = parser.parse_known_args(argv, argparse.Namespace())
    finally:
        for action, default in saved:
            action.default = default
    return set(vars(given)) - set(parser._defaults)


def apply_config_file(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Fill the flags the command line did not give from ns.config: the command line wins, even where it
    repeats a default (`--port 8000` over a file's `port: 8100`)."""
    argv = getattr(ns, "_argv", None)  # main() keeps the command line; what came after `serve` is this command's
    given = flags_given(parser, argv[argv.index("serve") + 1:]) if argv and "serve" in argv else {
        a.dest for a in parser._actions if getattr(ns, a.dest, None) != a.default}  # no command line: by value
    doc = load_yaml(ns.config) or {}
    if not isinstance(doc, dict):
        raise ValueError(f"{ns.config}: expected a mapping of flag names to values")
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    for key, value in doc.items():
        dest = str(key).replace("-", "_")
        action = actions.get(dest)
        if action is None:
            raise ValueError(f"{ns.config}: unknown key {key!r}; keys are the flags of `deepserve serve --help`")
        if action.type is not None and value is not None and not (isinstance(value, list) and action.nargs):
            try:
                value = action.type(value)
            except argparse.ArgumentTypeError as e:
                raise ValueError(f"{ns.config}: {key}: {e}") from None
            except (TypeError, ValueError):
                raise ValueError(f"{ns.config}: {key} must be {action.type.__name__}, got {value!r}") from None
        if dest in ("served_model_name", "api_key") and isinstance(value, str):
            value = [value]
        if dest not in given:
            setattr(ns, dest, value)


def settings_from(ns: argparse.Namespace) -> ServerSettings:
    api_keys = list(ns.api_key or [])
    if envs.DEEPSERVE_API_KEY:
        api_keys.append(envs.DEEPSERVE_API_KEY)
    return ServerSettings(
        host=ns.host, port=ns.port, served_model_names=list(ns.served_model_name or []),
        api_keys=api_keys, api_keys_file=ns.api_keys, ssl_keyfile=ns.ssl_keyfile,
        ssl_certfile=ns.ssl_certfile, ssl_ca_certs=ns.ssl_ca_certs, ssl_cert_reqs=ns.ssl_cert_reqs,
        reasoning_parser=ns.reasoning_parser, enable_auto_tool_choice=ns.enable_auto_tool_choice,
        tool_call_parser=ns.tool_call_parser, default_chat_template_kwargs=ns.default_chat_template_kwargs,
        shutdown_timeout=ns.shutdown_timeout, max_n=ns.max_n,
        max_waiting_requests=ns.max_waiting_requests, max_waiting_tokens=ns.max_waiting_tokens,
        max_body_bytes=ns.max_body_bytes, max_header_bytes=ns.max_header_bytes,
        ip_requests_per_minute=ns.ip_requests_per_minute, audit_log=ns.audit_log,
        audit_log_prompts=ns.audit_log_prompts, engine_stall_timeout=ns.engine_stall_timeout,
        request_read_timeout=ns.request_read_timeout,
        forwarded_allow_ips=ns.forwarded_allow_ips,
    )


def cmd_serve(ns: argparse.Namespace) -> int:
    from deepserve.server.api_server import bind_listener, defer_sighup, run_server

    defer_sighup()  # before the slow work: a SIGHUP while we start is a key reload once the app runs, not our end
    from deepserve.entrypoints.cli import engine_args_from, preset_tokenizer
    from deepserve.server.async_llm import AsyncLLM
    from deepserve.server.state import ServerState

    if ns.config:
        apply_config_file(ns, ns._parser)
    if ns.node_rank != 0:
        # A node k > 0 serves no HTTP: it runs its ranks until node 0 stops (engine_args_from exits).
        engine_args_from(ns, ns.model)
    preset_tokenizer(ns)
    settings = settings_from(ns)
    if settings.api_keys_file:  # a bad key file fails now, not after the model has loaded
        from deepserve.server.auth import load_key_file

        load_key_file(settings.api_keys_file)
    check_tls_files(settings)  # uvicorn reads them only after the engine process has been started
    names = settings.served_model_names or [ns.model or DEMO_MODEL_NAME]
    sock = bind_listener(settings.host, settings.port)  # before the engine: a taken port fails fast
    try:
        engine = AsyncLLM.from_engine_args(engine_args_from(ns, ns.model))
    except BaseException:
        sock.close()
        raise
    try:
        return run_server(ServerState(settings, engine, names), sock)
    finally:
        engine.kill_if_unstarted()  # the server failed before its lifespan connected to the engine


def check_tls_files(settings: ServerSettings) -> None:
    """Load the TLS files as uvicorn will, so a missing or bad one is a one-line error naming its flag."""
    import ssl

    if not settings.ssl_certfile:
        return
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(settings.ssl_certfile, settings.ssl_keyfile)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"--ssl-certfile {settings.ssl_certfile} / --ssl-keyfile {settings.ssl_keyfile}: cannot be "
                         f"loaded ({e.strerror or e})") from None
    if settings.ssl_ca_certs:
        try:
            context.load_verify_locations(settings.ssl_ca_certs)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"--ssl-ca-certs {settings.ssl_ca_certs}: cannot be loaded ({e.strerror or e})") from None


# What makes a running server (or router) read the key file again; both keep the old keys if it does not load.
RELOAD_HOW = "SIGHUP (kill -HUP <pid>) or POST /admin/keys/reload with an admin key"


def add_keys_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("keys", help="manage the API key file")
    sub = p.add_subparsers(dest="keys_command", required=True)
    add = sub.add_parser("add", help="create a key, store its hash and print it once")
    add.add_argument("name")
    add.add_argument("--role", required=True, choices=["admin", "user", "metrics"])
    add.add_argument("--file", default="keys.yaml", help="key file to create or extend (default: keys.yaml)")
    add.add_argument("--models", nargs="+", default=["*"], help="served model names the key may use")
    add.add_argument("--requests-per-minute", type=int, default=None,
                     help="requests this key may start per minute (a 429 beyond; default: no limit)")
    add.add_argument("--tokens-per-minute", type=int, default=None,
                     help="tokens this key may use per minute; a request reserves prompt + max_tokens x n, and "
                          "what it did not use comes back (default: no limit)")
    add.add_argument("--max-concurrent", type=int, default=None,
                     help="requests of this key in flight at once (default: no limit)")
    add.set_defaults(func=cmd_keys_add)
    ls = sub.add_parser("list", help="show the keys in a file (names, roles, models, limits; never secrets)")
    ls.add_argument("--file", default="keys.yaml")
    ls.set_defaults(func=cmd_keys_list)
    revoke = sub.add_parser("revoke", help="remove a key from the file (a running server drops it on reload)")
    revoke.add_argument("name")
    revoke.add_argument("--file", default="keys.yaml")
    revoke.set_defaults(func=cmd_keys_revoke)
    rotate = sub.add_parser("rotate", help="give a key a new secret, same role, models and limits; print it once")
    rotate.add_argument("name")
    rotate.add_argument("--file", default="keys.yaml")
    rotate.set_defaults(func=cmd_keys_rotate)
    return p


def add_audit_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("audit", help="check the audit log's hash chain")
    sub = p.add_subparsers(dest="audit_command", required=True)
    verify = sub.add_parser("verify", help="verify one chain: the rotated files oldest first, then the live one")
    verify.add_argument("files", nargs="+")
    verify.add_argument("--continues", action="store_true",
                        help="the first file is a rotated one that continues an earlier file not given here")
    verify.set_defaults(func=cmd_audit_verify)
    return p


def cmd_audit_verify(ns: argparse.Namespace) -> int:
    from deepserve.server.audit import main

    return main(ns.files, ns.continues)


def cmd_keys_add(ns: argparse.Namespace) -> int:
    from deepserve.server.key_file import add_key_to_file

    limits: dict[str, Any] = {"requests_per_minute": ns.requests_per_minute,
                              "tokens_per_minute": ns.tokens_per_minute, "max_concurrent": ns.max_concurrent}
    secret = add_key_to_file(ns.file, ns.name, ns.role, ns.models, limits)
    print(secret)
    print(f"added key '{ns.name}' ({ns.role}) to {ns.file}; this is the only time it is shown. "
          f"A running server picks it up on {RELOAD_HOW}.", file=sys.stderr)
    return 0


def cmd_keys_revoke(ns: argparse.Namespace) -> int:
    from deepserve.server.key_file import revoke_key_in_file

    key = revoke_key_in_file(ns.file, ns.name)
    # A server checks the set it loaded, not the file: the revoke is not done there until it reloads.
    print(f"revoked key '{key.name}' ({key.role}, models={','.join(key.models)}) from {ns.file}. "
          f"A running server drops it when it reloads the file ({RELOAD_HOW}) and accepts it until then.",
          file=sys.stderr)
    return 0


def cmd_keys_rotate(ns: argparse.Namespace) -> int:
    from deepserve.server.key_file import rotate_key_in_file

    secret, key = rotate_key_in_file(ns.file, ns.name)
    print(secret)  # stdout holds the secret alone, as for add, so `$(deepserve keys rotate ...)` captures it
    print(f"rotated key '{key.name}' ({key.role}) in {ns.file}; this is the only time the new secret is shown. "
          f"A running server swaps the old secret for it when it reloads the file ({RELOAD_HOW}); "
          "until then only the old one works there.", file=sys.stderr)
    return 0


def cmd_keys_list(ns: argparse.Namespace) -> int:
    from deepserve.server.auth import load_key_file

    for k in load_key_file(ns.file):
        limits = {f: getattr(k, f) for f in ("requests_per_minute", "tokens_per_minute", "max_concurrent")}
        shown = ", ".join(f"{f}={v}" for f, v in limits.items() if v is not None) or "no limits"
        print(f"{k.name}\t{k.role}\tmodels={','.join(k.models)}\t{shown}")
    return 0
