"""Every error the server answers is an OpenAI error body ``{"error": {"message", "type", "param",
"code"}}`` with JSON content type: validation failures (400, as OpenAI and vLLM answer them), unknown
routes (404), a method a route does not take (405 with ``Allow``), bodies over the size limit (413),
failed requests (500) and anything unexpected (500, logged; the server keeps serving).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hybridkv.engine.sampling import SamplingParamError
from hybridkv.errors import InvalidInputError

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered as an OpenAI error body with ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    @classmethod
    def bad_input(cls, exc: InvalidInputError, param: str | None = None) -> APIError:
        """A 400 for ``exc``, naming the field (a ``SamplingParamError`` knows it)."""
        return cls(400, str(exc), param=getattr(exc, "param", None) if isinstance(exc, SamplingParamError)
                   else param)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return ErrorResponse(self.body(), status_code=self.status, headers=self.headers)


class ErrorResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: a message quoting client input stays valid UTF-8."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def validation_error(errors: Sequence[Any]) -> APIError:
    """A 400 naming the offending fields of pydantic/FastAPI validation ``errors``."""
    invalid_json = next((e for e in errors if e.get("type") == "json_invalid"), None)
    if invalid_json is not None:
        detail = invalid_json.get("ctx", {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON: {detail}".rstrip(": "))
    if any(tuple(e.get("loc", ())) == ("body",) for e in errors):
        return APIError(400, "the request body must be a JSON object (sent with Content-Type: application/json)")
    parts, fields = [], []
    for e in errors:
        loc = [str(p) for p in e.get("loc", ()) if p != "body"]
        field = ".".join(loc) or "body"
        fields.append(field)
        hint = f" (unknown field {loc[-1]!r})" if e.get("type") == "extra_forbidden" and loc else ""
        parts.append(f"{field}: {e.get('msg', 'invalid')}{hint}")
    return APIError(400, "; ".join(parts)[:2000], param=fields[0].split(".", 1)[0] if fields else None)


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI error bodies for ``APIError``, validation errors, HTTP errors and unexpected exceptions."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def request_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, f"{exc.detail} ({request.method} {request.url.path})",
                        type="invalid_request_error" if exc.status_code < 500 else "server_error",
                        code="request_too_large" if exc.status_code == 413 else None,
                        headers=exc.headers).response()  # a 405 keeps its Allow header

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}"[:2000], type="server_error",
                        code="internal_error").response()


class BodySizeLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets 413 before the app parses any of it."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    def _error(self) -> JSONResponse:
        return APIError(413, f"the request body is larger than the server's limit of {self.limit} bytes "
                             f"(--max-request-bytes)", code="request_too_large").response()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers", ())).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await self._error()(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise StarletteHTTPException(413, f"the request body is larger than the server's limit of "
                                                      f"{self.limit} bytes (--max-request-bytes)")
            return message

        await self.app(scope, limited, send)
