"""Generate the OpenAPI 3.1 document from the route declarations."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue, models_json_schema
from pydantic_core import core_schema

from api.routing import INT64_MAX, INT64_MIN, RouteSpec
from metald import __version__

REF = "#/components/schemas/{model}"


class Int64Schema(GenerateJsonSchema):
    """Integers in the document carry the 64-bit range the API enforces (api/routing.py)."""

    def int_schema(self, schema: core_schema.IntSchema) -> JsonSchemaValue:
        out = super().int_schema(schema)
        out.setdefault("minimum", INT64_MIN)
        out.setdefault("maximum", INT64_MAX)
        return out


def build_openapi(specs: list[RouteSpec]) -> dict[str, Any]:
    models: set[type[BaseModel]] = set()
    for s in specs:
        for m in (s.body, s.response):
            if m is not None:
                models.add(m)
    keyed = [
        (m, "validation" if any(s.body is m for s in specs) else "serialization")
        for m in sorted(models, key=lambda m: m.__name__)
    ]
    refs, defs = models_json_schema(  # type: ignore[arg-type]
        keyed, ref_template=REF, schema_generator=Int64Schema
    )
    schemas = defs.get("$defs", {})
    paths: dict[str, dict[str, Any]] = {}
    for s in specs:
        op: dict[str, Any] = {
            "summary": s.summary,
            "operationId": s.handler.__name__,
            "tags": [s.tag] if s.tag else [],
            "responses": {},
        }
        if s.description:
            op["description"] = s.description
        if s.roles is not None:
            op["security"] = [{"bearer": []}]
            op["x-roles"] = sorted(r.value for r in s.roles)
        params = [
            {"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
            for p in s.path_params
        ]
        if s.query is not None:
            qschema = s.query.model_json_schema(ref_template=REF, schema_generator=Int64Schema)
            for k, v in qschema.get("properties", {}).items():
                param: dict[str, Any] = {
                    "name": k,
                    "in": "query",
                    "required": k in qschema.get("required", []),
                    "schema": v,
                }
                if "description" in v:
                    param["description"] = v["description"]
                params.append(param)
            schemas.update(qschema.get("$defs", {}))
        if s.versioned:
            params.append(
                {
                    "name": "If-Match",
                    "in": "header",
                    "required": False,
                    "description": "Write only if the resource is still at this ETag "
                    '(412 otherwise), e.g. "3"',
                    "schema": {"type": "string"},
                }
            )
        if params:
            op["parameters"] = params
        if s.body is not None:
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": refs[(s.body, "validation")]}},
            }
        ok: dict[str, Any] = {"description": "Success" if s.status != 201 else "Created"}
        if s.location is not None:
            ok["headers"] = {
                "Location": {
                    "description": "The path of the created resource",
                    "schema": {"type": "string"},
                }
            }
        if s.response is not None and "version" in s.response.model_fields:
            ok.setdefault("headers", {})["ETag"] = {
                "description": "The resource's version, quoted; send it back as If-Match",
                "schema": {"type": "string"},
            }
        if s.status == 204:
            pass
        elif s.response is not None:
            mode = "validation" if (s.response, "validation") in refs else "serialization"
            ok["content"] = {"application/json": {"schema": refs[(s.response, mode)]}}
        elif s.raw_response:
            ok["content"] = {s.raw_response: {"schema": {"type": "string"}}}
        op["responses"][str(s.status)] = ok
        errs = set(s.errors)
        if s.path_params:
            errs.add(404)  # an id that names nothing
        if s.roles is not None:
            errs |= {401, 403}
        if s.body is not None or s.query is not None:
            errs |= {400, 422} if s.body is not None else {422}
        if s.body is not None:
            errs |= {408, 413, 415}
        if s.method not in ("GET", "HEAD"):
            errs.add(412)  # If-Match that does not hold (or names a resource without a version)
        for code in sorted(errs):
            op["responses"][str(code)] = {"$ref": "#/components/responses/Problem"}
        paths.setdefault(s.openapi_path, {})[s.method.lower()] = op
    schemas["Problem"] = {
        "type": "object",
        "description": "RFC 9457 problem details",
        "properties": {
            "type": {"type": "string"},
            "title": {"type": "string"},
            "status": {"type": "integer"},
            "detail": {"type": "string"},
            "instance": {"type": "string"},
            "errors": {"type": "array", "items": {"type": "object"}},
        },
        "required": ["type", "title", "status", "detail"],
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "metald API", "version": __version__},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "responses": {
                "Problem": {
                    "description": "Error (RFC 9457 problem details)",
                    "content": {
                        "application/problem+json": {
                            "schema": {"$ref": "#/components/schemas/Problem"}
                        }
                    },
                }
            },
        },
    }
