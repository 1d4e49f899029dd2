"""The server's OpenAPI document, for admin keys at /admin/openapi.json (schemathesis and client
generators read it; the public docs routes stay off).

The routes read their bodies themselves (bounded reads, OpenAI-shaped errors), so FastAPI knows no request
schema for them: each POST route's body schema is added here from the pydantic model the route parses
with, its nested definitions moved under components/schemas.
"""

from __future__ import annotations

from typing import Any

from deepserve.server import protocol as p

REF = "#/components/schemas/{model}"
BODIES: dict[str, type] = {
    "/v1/completions": p.CompletionRequest,
    "/v1/chat/completions": p.ChatCompletionRequest,
    "/tokenize": p.TokenizeRequest,
    "/detokenize": p.DetokenizeRequest,
}


def openapi_document(app: Any) -> dict:
    cached = getattr(app.state, "openapi_document", None)
    if cached is None:
        cached = app.state.openapi_document = _build(app)
    return cached


def _build(app: Any) -> dict:
    from fastapi.openapi.utils import get_openapi

    from deepserve import __version__

    doc = get_openapi(title="deepserve", version=__version__, routes=app.routes,
                      description="OpenAI-compatible API of a deepserve server")
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for path, model in BODIES.items():
        schema = model.model_json_schema(ref_template=REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        doc["paths"][path]["post"]["requestBody"] = {
            "required": True, "content": {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}}}
    doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    doc["security"] = [{"bearer": []}]
    return doc
