"""API keys: a YAML file of SHA-256 hashes, roles, model scopes and per-key limits.

Deny by default: a route is reachable only if `ROUTE_ROLES` names it, and only /health and /ready are
public. The decision is keyed by the route template Starlette actually matched (never a URL rebuilt
from Host or X-Forwarded-* headers), and the key check compares digests in constant time against every
stored key, without an early exit.

Key file (`deepserve keys add|revoke|rotate` write it: server/key_file.py; SIGHUP or POST /admin/keys/reload
reloads it):

    keys:
      - name: alice
        key_hash: sha256:<64 hex>
        role: user              # admin | user | metrics
        models: ["*"]           # served model names this key may use; "*" = all
        requests_per_minute: 60 # optional limits; absent = unlimited
        tokens_per_minute: 100000
        max_concurrent: 4
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
from dataclasses import dataclass, field

import yaml

from deepserve.server.errors import APIError
from deepserve.server.yaml_file import load_yaml

logger = logging.getLogger(__name__)

ROLES = ("admin", "user", "metrics")
PUBLIC_ROUTES = frozenset({"/health", "/ready"})
_API = frozenset({"admin", "user"})
ROUTE_ROLES: dict[str, frozenset[str]] = {
    "/v1/models": _API,
    "/v1/models/{model:path}": _API,
    "/v1/completions": _API,
    "/v1/chat/completions": _API,
    "/tokenize": _API,
    "/detokenize": _API,
    "/metrics": frozenset({"admin", "metrics"}),
    "/admin/usage": frozenset({"admin"}),
    "/admin/keys/reload": frozenset({"admin"}),
    "/admin/openapi.json": frozenset({"admin"}),
}
LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent")


@dataclass(frozen=True)
class ApiKey:
    name: str
    role: str
    digest: bytes = field(repr=False)
    models: tuple[str, ...] = ("*",)
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None

    def may_use(self, model: str) -> bool:
        return "*" in self.models or model in self.models


def generate_key() -> str:
    return "sk-ds-" + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()


def parse_key_entry(i: int, entry: object) -> ApiKey:
    where = f"keys[{i}]"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be a mapping with name, key_hash and role")
    unknown = set(entry) - {"name", "key_hash", "role", "models", *LIMIT_FIELDS}
    if unknown:
        raise ValueError(f"{where} has unknown field(s) {sorted(unknown)}")
    name, role, key_hash = entry.get("name"), entry.get("role"), entry.get("key_hash")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.name must be a non-empty string")
    if role not in ROLES:
        raise ValueError(f"{where}.role must be one of {list(ROLES)}, got {role!r}")
    if not isinstance(key_hash, str) or not key_hash.startswith("sha256:") or len(key_hash) != 71:
        raise ValueError(f"{where}.key_hash must be 'sha256:' followed by 64 hex digits")
    models = entry.get("models", ["*"])
    if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
        raise ValueError(f"{where}.models must be a list of model names (or [\"*\"])")
    limits = {}
    for f in LIMIT_FIELDS:
        v = entry.get(f)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{where}.{f} must be a positive integer, got {v!r}")
        limits[f] = v
    return ApiKey(name, role, bytes.fromhex(key_hash[7:]), tuple(models), **limits)


def load_key_file(path: str) -> list[ApiKey]:
    return keys_from_doc(load_yaml(path), path)


def keys_from_doc(doc: object, path: str) -> list[ApiKey]:
    """The keys of a key file's parsed document (`path` names it in errors); the document is not changed."""
    doc = doc or {}
    entries = doc.get("keys", []) if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a mapping with a 'keys' list")
    keys = [parse_key_entry(i, e) for i, e in enumerate(entries)]
    names = [k.name for k in keys]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"{path}: duplicate key name(s) {dupes}")
    return keys


def _one_entry_per_secret(keys: list[ApiKey], path: str | None) -> list[ApiKey]:
    """Two entries with one secret would give it the rights of whichever matched last, and revoking one
    entry would leave the other working: refused, naming both."""
    seen: dict[bytes, str] = {}
    for key in keys:
        if key.digest in seen:
            raise ValueError(f"{path or 'the key list'}: keys '{seen[key.digest]}' and '{key.name}' are the same "
                             "secret (one key_hash, or an --api-key also in the file); give each entry its own key")
        seen[key.digest] = key.name
    return keys


class KeyStore:
    """The keys in force. `reload()` swaps the whole set atomically; a bad file keeps the old set."""

    def __init__(self, path: str | None = None, inline_keys: tuple[str, ...] = ()) -> None:
        self.path = path
        self._inline = [  # one entry per distinct key: --api-key X with $DEEPSERVE_API_KEY=X is one key
            ApiKey(f"api-key-{i}" if i else "api-key", "admin", hashlib.sha256(k.encode()).digest())
            for i, k in enumerate(dict.fromkeys(inline_keys))
        ]
        self._keys: list[ApiKey] = list(self._inline)
        self._lock = threading.Lock()
        if path:
            self._keys = self._load()  # a bad file at startup is fatal

    def _load(self) -> list[ApiKey]:
        """The inline keys and the file's, one entry per secret."""
        return _one_entry_per_secret(self._inline + load_key_file(self.path), self.path)

    @property
    def configured(self) -> bool:
        return bool(self._keys)

    def names(self) -> list[str]:
        return [k.name for k in self._keys]

    def reload(self) -> str | None:
        """Reads the key file again; None when it loaded, else why it did not (the keys then stay)."""
        if not self.path:
            return None
        try:
            keys = self._load()
        except (OSError, ValueError, yaml.YAMLError) as e:
            logger.error("key file reload failed, keeping the previous %d keys: %s", len(self._keys), e)
            return f"{type(e).__name__}: {e}"
        with self._lock:
            self._keys = keys
        logger.info("reloaded %d API keys from %s", len(keys), self.path)
        return None

    def lookup(self, token: str) -> ApiKey | None:
        digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        found = None
        for key in self._keys:  # no early exit: time does not depend on which key matched
            if hmac.compare_digest(digest, key.digest):
                found = key
        return found


def bearer_token(auth_headers: list[str]) -> str | None:
    if len(auth_headers) != 1:
        return None  # none, or several: ambiguous, so refused
    scheme, _, token = auth_headers[0].partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def authorize(store: KeyStore, route_path: str | None, auth_headers: list[str],
              route_roles: dict[str, frozenset[str]] | None = None) -> ApiKey | None:
    """The key allowed on `route_path` (the matched route's template), None on a public route.
    `route_roles` is the app's table (the server's ROUTE_ROLES unless given; the router has its own)."""
    if route_path in PUBLIC_ROUTES:
        return None
    token = bearer_token(auth_headers)
    hint = "" if store.configured else " (this server has no API keys configured; see --api-key)"
    if token is None:
        raise APIError(401, "missing or malformed 'Authorization: Bearer <key>' header" + hint,
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    key = store.lookup(token)
    if key is None:
        raise APIError(401, "invalid API key" + hint, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    allowed = (ROUTE_ROLES if route_roles is None else route_roles).get(route_path or "", frozenset())
    if key.role not in allowed:
        raise RoleDenied(key, route_path)
    return key


class RoleDenied(APIError):
    """A 403 for a known key whose role may not use the route; carries the key's name for the audit log."""

    def __init__(self, key: ApiKey, route_path: str | None) -> None:
        super().__init__(403, f"key '{key.name}' (role {key.role}) may not access {route_path}",
                         code="insufficient_role")
        self.key_name = key.name
