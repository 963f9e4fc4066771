"""RFC 9457 problem details for the API: ``metald.problem``'s builder, and the sentence and
field list a request that does not validate gets."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from pydantic import ValidationError

from metald.problem import PROBLEM_TYPE, problem

__all__ = ["PROBLEM_TYPE", "describe_validation", "problem", "validation_problem"]


def describe_validation(e: ValidationError) -> tuple[str, list[dict[str, Any]]]:
    errors = []
    for err in e.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(body)"
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        elif err["type"] == "missing":
            msg = "is required"
        else:
            msg = err["msg"]
        errors.append({"field": field, "message": msg})
    sentence = "; ".join(f"{x['field']}: {x['message']}" for x in errors)
    return sentence, errors


def validation_problem(e: ValidationError, *, instance: str | None = None) -> web.Response:
    sentence, errors = describe_validation(e)
    return problem(
        422,
        "Invalid request",
        f"the request does not validate: {sentence}",
        instance=instance,
        errors=errors,
    )
