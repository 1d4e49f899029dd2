"""The request fields that ask for structured output, turned into one StructuredOutputsParams.

Three spellings reach the same engine feature: OpenAI's `response_format` ({"type": "json_object"} or
{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}), vLLM's `structured_outputs`
object ({"json" | "regex" | "choice" | "grammar" | "json_object"}) and vLLM's older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`. A request uses at most one of them; each error is
a 400 naming the field. Whether the schema, regex or grammar itself is valid is decided when the engine
compiles it (InputProcessor.check_grammar); serving.py names the field `origin` returns.
"""

from __future__ import annotations

from typing import Any

from deepserve.sampling_params import StructuredOutputsParams
from deepserve.server.errors import bad_request

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")


def structured_outputs_of(req: Any) -> tuple[StructuredOutputsParams | None, str | None]:
    """(what the output must match or None, the request field that asked for it); raises APIError(400)."""
    asked = [name for name in ("response_format", "structured_outputs", *GUIDED) if _asks(req, name)]
    if len(asked) > 1:
        raise bad_request(f"give only one of {', '.join(asked)}: each asks for structured output", param=asked[1])
    if not asked:
        return None, None
    origin = asked[0]
    if origin == "response_format":
        return _from_response_format(req.response_format), origin
    if origin == "structured_outputs":
        return _from_structured_outputs(req.structured_outputs), origin
    return _build({GUIDED[origin]: getattr(req, origin)}, origin), origin


def _asks(req: Any, name: str) -> bool:
    value = getattr(req, name, None)
    if name == "response_format":
        return value is not None and value.get("type", "text") != "text"
    return value is not None


def _from_response_format(rf: dict[str, Any]) -> StructuredOutputsParams:
    kind = rf.get("type")
    if kind == "json_object":
        _only_keys(rf, ("type",), "response_format")
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise bad_request("response_format.type must be 'text', 'json_object' or 'json_schema', "
                          f"got {kind!r}", param="response_format.type")
    _only_keys(rf, ("type", "json_schema"), "response_format")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema must be an object with a 'schema'",
                          param="response_format.json_schema")
    _only_keys(spec, ("name", "description", "schema", "strict"), "response_format.json_schema")
    schema = spec.get("schema")
    if schema is None:  # OpenAI allows a schema-less json_schema format: any JSON object
        return StructuredOutputsParams(json_object=True)
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema must be a JSON schema object",
                          param="response_format.json_schema.schema")
    return StructuredOutputsParams(json=schema)


def _from_structured_outputs(so: dict[str, Any]) -> StructuredOutputsParams:
    _only_keys(so, _STRUCTURED_KEYS, "structured_outputs")
    return _build(so, "structured_outputs")


def _build(kwargs: dict[str, Any], origin: str) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except (ValueError, TypeError) as e:
        raise bad_request(f"{origin}: {e}", param=origin) from None


def _only_keys(obj: dict[str, Any], allowed: tuple[str, ...], where: str) -> None:
    extra = sorted(set(obj) - set(allowed))
    if extra:
        raise bad_request(f"{where}.{extra[0]} is not supported (known: {', '.join(allowed)})",
                          param=f"{where}.{extra[0]}")
