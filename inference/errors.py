"""OpenAI's error responses: :class:`APIError`, the app's exception handlers, and request-body parsing.

Every error has OpenAI's body ``{"error": {"message", "type", "param", "code"}}`` (see :mod:`inference.api_server`
for the statuses). Pydantic validation errors become one 400 naming the first offending parameter
(``messages[0].content`` style). Refusals of the completion endpoints are counted in the metrics and logged.
"""

from __future__ import annotations

import hmac
import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from inference.async_engine import EngineUnavailable
from inference.protocol import ErrorInfo, ErrorResponse, RequestError

log = logging.getLogger("inference.api_server")  # the server's request records share one logger

ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}  # path -> metrics label
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


class APIError(Exception):
    """An error response in OpenAI's format."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def install_error_handlers(app: FastAPI) -> None:
    def refuse(request: Request, err: APIError) -> JSONResponse:
        endpoint = ENDPOINTS.get(request.url.path)
        if endpoint is not None:
            request.app.state.server.metrics.observe_request(endpoint, str(err.status))
            log.info("request refused", extra={"fields": {
                "event": "request_refused", "endpoint": endpoint, "status": err.status, "code": err.code,
                "param": err.param, "message": err.message}})
        return err.response()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return refuse(request, err)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, err: RequestError):
        return refuse(request, APIError(400, err.message, param=err.param, code=err.code))

    @app.exception_handler(EngineUnavailable)
    async def _unavailable(request: Request, err: EngineUnavailable):
        return refuse(request, APIError(503, err.message, type="server_error", code=err.code,
                                        headers={"Retry-After": "1"}))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, err: RequestValidationError):
        return refuse(request, _validation_error(err.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException):
        return refuse(request, APIError(err.status_code, str(err.detail),
                                        "invalid_request_error" if err.status_code < 500 else "server_error",
                                        headers=getattr(err, "headers", None)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception):
        log.error("unhandled error", exc_info=err, extra={"fields": {"event": "unhandled_error",
                                                                     "path": request.url.path}})
        return refuse(request, APIError(500, f"internal server error ({type(err).__name__})", "server_error",
                                        code="internal_error"))


def _param_of(loc: tuple) -> tuple[str | None, str | None]:
    """(``messages[0].content``-style parameter, union member tag) of a pydantic error location."""
    param, tag = "", None
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_]\w*", part) and part not in _TYPE_TAGS:
            param += ("." if param else "") + part
        elif tag is None:
            tag = part
    return param or None, tag


def _validation_error(errors: list[dict]) -> APIError:
    """Turn pydantic errors into one 400 naming the first offending parameter."""
    # the most specific error: with a union (str | list[...]) the deepest location names the real culprit
    first = max(errors, key=lambda e: len([p for p in e["loc"] if _param_of((p,))[0] or isinstance(p, int)]))
    kind = first["type"]
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", first["msg"])
        return APIError(400, f"the request body is not valid JSON: {detail}", code="invalid_json")
    param, _ = _param_of(tuple(first["loc"]))
    if param is None:
        return APIError(400, "the request body must be a JSON object", code="invalid_request_body")
    if kind == "extra_forbidden":
        return APIError(400, f"unsupported parameter '{param}'", param=param, code="unsupported_parameter")
    if kind == "missing":
        return APIError(400, f"missing required parameter '{param}'", param=param, code="missing_required_parameter")
    same = [e for e in errors if _param_of(tuple(e["loc"]))[0] == param]
    tags = [t for t in (_param_of(tuple(e["loc"]))[1] for e in same) if t]
    if len(same) > 1 and len(set(tags)) > 1:
        message = f"invalid value for '{param}': expected one of {', '.join(dict.fromkeys(tags))}"
    else:
        message = f"invalid value for '{param}': {first['msg'].removeprefix('Value error, ')}"
    return APIError(400, message, param=param, code="invalid_value")


async def parse_body(request: Request, schema: type[BaseModel]) -> BaseModel:
    """Read and validate a JSON body (strict UTF-8, size-limited). Raises APIError 400/413."""
    limit = request.app.state.server.max_request_bytes
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    try:
        text = b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as err:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {err.start})", code="invalid_utf8") from None
    try:
        return schema.model_validate_json(text)
    except ValidationError as err:
        errors = err.errors(include_url=False)
        if errors[0]["type"] == "json_invalid":
            _check_surrogates(text)
        raise _validation_error(errors) from None


def _check_surrogates(text: str) -> None:
    """Raise APIError 400 naming the string when ``text`` is valid JSON apart from a lone UTF-16 surrogate escape
    (``"\\ud800"``: Python's reader accepts it, pydantic's and UTF-8 cannot)."""
    try:
        data = json.loads(text)
    except ValueError:
        return
    stack = [("", data)]
    while stack:
        param, value = stack.pop()
        if isinstance(value, dict):
            stack.extend((f"{param}.{k}" if param else k, v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((f"{param}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, str) and any(0xD800 <= ord(c) <= 0xDFFF for c in value):
            raise APIError(400, f"the string of '{param}' is not valid UTF-16/UTF-8: it holds a lone surrogate "
                           f"escape (\\ud800-\\udfff without its pair)", param=param or None, code="invalid_utf16")


async def require_api_key(request: Request) -> None:
    key = request.app.state.server.api_key
    if not key:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
