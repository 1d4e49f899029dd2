"""`deepserve router`: the flags (see docs/deploy.md, "Router")."""

from __future__ import annotations

import argparse
import os


def add_router_parser(sub: argparse._SubParsersAction) -> None:
    from deepserve.entrypoints.cli import DefaultsHelp  # cli builds this parser: loaded by then

    r = sub.add_parser("router", help="one OpenAI-compatible endpoint over many replicas (prefix affinity, "
                       "failover, global per-key quotas in Redis)", formatter_class=DefaultsHelp)
    r.add_argument("--backend", action="append", default=[], metavar="URL",
                   help="a replica's base URL (repeat the flag for each); any OpenAI-compatible server works")
    r.add_argument("--backend-dns", action="append", default=[], metavar="HOST:PORT",
                   help="every address HOST resolves to is a backend, re-resolved each second (a Kubernetes "
                        "headless Service)")
    r.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    r.add_argument("--port", type=int, default=8080, help="TCP port to listen on")
    r.add_argument("--api-key", action="append", default=[], help="an admin key (repeatable); "
                   "default: $DEEPSERVE_API_KEY")
    r.add_argument("--api-keys", default=None, metavar="FILE",
                   help="the server's key file (deepserve keys add): roles, model scopes, per-key limits")
    r.add_argument("--backend-api-key", default=os.environ.get("DEEPSERVE_BACKEND_API_KEY"),
                   help="the key the router presents to the backends (default: $DEEPSERVE_BACKEND_API_KEY; "
                        "unset: each client's own Authorization header is forwarded)")
    r.add_argument("--redis-url", default=os.environ.get("DEEPSERVE_REDIS_URL"),
                   help="redis://HOST:PORT/DB for the global per-key quotas (default: $DEEPSERVE_REDIS_URL; "
                        "unset: no global quotas)")
    r.add_argument("--quota-redis-down", choices=["closed", "open"], default="closed",
                   help="when Redis cannot be reached: closed (default) answers 503 to keys with a limit; "
                        "open admits them (the replicas' own limits remain)")
    r.add_argument("--health-path", default="/health",
                   help="probed on every backend each --health-interval (deepserve: /ready skips loading "
                        "replicas; vLLM and SGLang: /health)")
    r.add_argument("--health-interval", type=float, default=1.0, help="seconds between active health probes")
    r.add_argument("--affinity-prefix-chars", type=int, default=1024,
                   help="the leading prompt characters hashed for prefix affinity")
    r.add_argument("--affinity-min-chars", type=int, default=256,
                   help="shorter prompts (and no X-Session-ID header) go to the least-loaded backend")
    r.add_argument("--affinity-load-factor", type=float, default=1.25,
                   help="bounded loads: a backend takes affinity traffic while its in-flight requests stay "
                        "under this factor x the average")
    r.add_argument("--max-retries", type=int, default=2,
                   help="other backends tried when one fails before the response started")
    r.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a backend may stay silent (no byte of its answer) before the request fails there")
    r.add_argument("--max-body-bytes", type=int, default=8 << 20, help="largest request body accepted (413 above)")
    r.add_argument("--no-strict-validation", dest="strict_validation", action="store_false",
                   help="pass request fields through unchecked (for backends with fields deepserve lacks); "
                        "default: deepserve's validation and error shapes at the router")
    r.add_argument("--audit-log", default=None, metavar="FILE", help="hash-chained JSON lines, one per request")
    r.set_defaults(func=cmd_router)


def cmd_router(ns: argparse.Namespace) -> int:
    from deepserve.server.api_server import defer_sighup

    defer_sighup()  # a SIGHUP before the app's lifespan is a reload once it runs, not our end
    from deepserve.router.app import run_router
    from deepserve.router.state import RouterSettings

    keys = ns.api_key or ([os.environ["DEEPSERVE_API_KEY"]] if os.environ.get("DEEPSERVE_API_KEY") else [])
    settings = RouterSettings(
        backends=ns.backend, backend_dns=ns.backend_dns, host=ns.host, port=ns.port, api_keys=keys,
        api_keys_file=ns.api_keys, backend_api_key=ns.backend_api_key, redis_url=ns.redis_url,
        quota_redis_down=ns.quota_redis_down, health_path=ns.health_path, health_interval=ns.health_interval,
        affinity_prefix_chars=ns.affinity_prefix_chars, affinity_min_chars=ns.affinity_min_chars,
        affinity_load_factor=ns.affinity_load_factor, max_retries=ns.max_retries,
        request_timeout=ns.request_timeout, max_body_bytes=ns.max_body_bytes,
        strict_validation=ns.strict_validation, audit_log=ns.audit_log)
    return run_router(settings)
