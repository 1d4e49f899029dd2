"""ServerSettings: everything `deepserve serve` knows beyond the engine's own EngineArgs."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field

from deepserve.server.protocol import RESERVED_TEMPLATE_KWARGS, RequestLimits
from deepserve.server.reasoning import PARSERS
from deepserve.server.tool_parsers import PARSERS as TOOL_PARSERS


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: list[str] = field(default_factory=list)
    api_keys: list[str] = field(default_factory=list)  # --api-key: each one an admin key
    api_keys_file: str | None = None
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = int(ssl.CERT_NONE)
    reasoning_parser: str | None = None
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (the default with tools) is allowed
    tool_call_parser: str | None = None  # the model's tool-call markup: deepseek_v3 | deepseek_v31
    default_chat_template_kwargs: dict = field(default_factory=dict)  # under each request's own
    shutdown_timeout: float = 30.0
    max_n: int = 16
    max_waiting_requests: int = 256
    max_waiting_tokens: int = 1 << 20
    max_body_bytes: int = 8 << 20
    max_header_bytes: int = 16 << 10
    ip_requests_per_minute: int | None = None
    audit_log: str | None = None
    audit_log_prompts: bool = False
    engine_stall_timeout: float = 120.0
    request_read_timeout: float = 30.0  # seconds a request's headers, and then its body, may take to arrive
    forwarded_allow_ips: str | None = None  # None: X-Forwarded-* ignored (clients could forge them)

    def __post_init__(self) -> None:
        _positive("port", self.port, hi=65535)
        for name in ("max_n", "max_waiting_requests", "max_waiting_tokens", "max_body_bytes",
                     "max_header_bytes"):
            _positive(name.replace("_", "-"), getattr(self, name))
        if self.ip_requests_per_minute is not None:
            _positive("ip-requests-per-minute", self.ip_requests_per_minute)
        if self.shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {self.shutdown_timeout}")
        if not self.request_read_timeout > 0:
            raise ValueError(f"--request-read-timeout must be > 0 seconds, got {self.request_read_timeout}")
        if self.engine_stall_timeout <= 0:
            raise ValueError(f"--engine-stall-timeout must be > 0 seconds, got {self.engine_stall_timeout}")
        if self.reasoning_parser not in (None, *PARSERS):
            raise ValueError(f"--reasoning-parser must be one of {list(PARSERS)}, got {self.reasoning_parser!r}")
        if self.tool_call_parser not in (None, *TOOL_PARSERS):
            raise ValueError(f"--tool-call-parser must be one of {list(TOOL_PARSERS)}, got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (deepseek_v3 or deepseek_v31): "
                             "the parser reads the model's tool calls out of its text")
        if not isinstance(self.default_chat_template_kwargs, dict):
            raise ValueError("--default-chat-template-kwargs must be a JSON object, e.g. '{\"thinking\": true}'")
        reserved = sorted(set(self.default_chat_template_kwargs) & RESERVED_TEMPLATE_KWARGS)
        if reserved:  # else every chat request would fail in the template, far from the cause
            raise ValueError(f"--default-chat-template-kwargs: {', '.join(reserved)} are set by the server itself; "
                             "leave them out")
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ValueError("--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required client certs)")
        if bool(self.ssl_keyfile) != bool(self.ssl_certfile):
            raise ValueError("--ssl-keyfile and --ssl-certfile must be given together")
        if self.ssl_cert_reqs and not (self.ssl_ca_certs and self.ssl_certfile):
            raise ValueError("--ssl-cert-reqs (mTLS) needs --ssl-ca-certs and --ssl-certfile/--ssl-keyfile")
        for name in self.api_keys:
            if len(name) < 8:
                raise ValueError("--api-key must be at least 8 characters; generate one with `openssl rand -hex 24` "
                                 "(or keep keys in a file: `deepserve keys add NAME --role admin` and --api-keys FILE)")

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(max_n=self.max_n)


def _positive(flag: str, value: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (hi is not None and value > hi):
        bound = f"between 1 and {hi}" if hi else "a positive integer"
        raise ValueError(f"--{flag} must be {bound}, got {value!r}")
