"""OpenAI's error body, the exceptions that carry it, and the handlers that turn every failure into one."""

import logging
from http import HTTPStatus
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


class APIError(Exception):
    """A failure a client sees as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    status = HTTPStatus.BAD_REQUEST
    type = "invalid_request_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else type(self).code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class InvalidRequest(APIError):
    pass


class ContextLengthExceeded(APIError):
    code = "context_length_exceeded"


class Unauthorized(APIError):
    status = HTTPStatus.UNAUTHORIZED
    code = "invalid_api_key"


class ModelNotFound(APIError):
    status = HTTPStatus.NOT_FOUND
    code = "model_not_found"


class QueueFull(APIError):
    status = HTTPStatus.TOO_MANY_REQUESTS
    type = "requests"
    code = "rate_limit_exceeded"


class PayloadTooLarge(APIError):
    status = HTTPStatus.REQUEST_ENTITY_TOO_LARGE
    code = "request_too_large"


class ServiceUnavailable(APIError):
    status = HTTPStatus.SERVICE_UNAVAILABLE
    type = "service_unavailable"
    code = "service_unavailable"


class InternalError(APIError):
    status = HTTPStatus.INTERNAL_SERVER_ERROR
    type = "server_error"
    code = "internal_error"


def format_validation_errors(errors: list[dict]) -> tuple[str, str | None]:
    """A readable message and the first offending parameter from pydantic's error list."""
    unknown = [_loc(e["loc"]) for e in errors if e["type"] == "extra_forbidden"]
    if unknown:
        return f"Unsupported parameter(s): {', '.join(unknown)}", unknown[0]
    located = {}  # loc -> message; a union yields one error per member at the same place
    for e in errors:
        located.setdefault(_loc(e["loc"]), e["msg"].removeprefix("Value error, "))
    # Of a union's alternatives keep the deepest complaint: "content[0]: bad part type", not "content: not a str".
    deepest = [loc for loc in located if not any(o.startswith((f"{loc}.", f"{loc}[")) for o in located)]
    parts = [f"{loc}: {located[loc]}" if loc else located[loc] for loc in deepest[:8]]
    return "; ".join(parts), deepest[0] or None


# Discriminator tags pydantic puts into a location after a list index ("messages", 0, "user", ...) or after a
# tagged field ("response_format", "json_schema", ...).
_TAGS = frozenset({"system", "developer", "user", "assistant", "tool", "text", "image_url", "json_object", "json_schema"})
_TAGGED_FIELDS = frozenset({"response_format"})


def _loc(loc: tuple) -> str:
    out = ""
    prev: object = None
    for part in loc:
        skip = (
            (part == "body" and prev is None)  # FastAPI's prefix for body fields
            or (isinstance(part, str) and ("[" in part or part in ("str", "int")))  # union member labels
            or ((isinstance(prev, int) or prev in _TAGGED_FIELDS) and part in _TAGS)
        )
        if not skip:
            out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
        prev = part
    return out


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with a 413 as soon as it is known to pass `limit` bytes (by its Content-Length,
    else while it arrives): nothing larger is held in memory."""
    too_large = PayloadTooLarge(f"The request body is larger than this server accepts ({limit} bytes).")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


async def parse_body(request: Request, model: type[M], limit: int) -> M:
    """The request body as `model`, whatever the Content-Type says; any defect is a 400 naming it."""
    body = await read_body(request, limit)
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors()
        if any(e["type"] == "json_invalid" for e in errors):
            raise InvalidRequest("Request body is not valid JSON.") from None
        if any(e["type"] == "model_type" and not e["loc"] for e in errors):
            raise InvalidRequest("Request body must be a JSON object.") from None
        message, param = format_validation_errors(errors)
        raise InvalidRequest(message, param=param) from None


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves the server as OpenAI's error body; nothing a client sends yields a 500."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Routing errors (404 unknown path, 405 wrong method) in the same body.
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        body = {"error": {"message": str(exc.detail), "type": kind, "param": None, "code": None}}
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        return InternalError(f"Internal error: {type(exc).__name__}").response()
