"""The ingress's edge: what every request passes before a route runs, and the one shape
every error leaves in.

    request ─▶ EdgeMiddleware ─▶ /v1/*: Authorization: Bearer <api key>?  no ─▶ 401
                    │            Content-Length, or the bytes read, > limit?  ─▶ 413
                    ▼            (the body is buffered here and replayed to the route)
               FastAPI route ─▶ pydantic (schemas.py) ─▶ 400
    any error of any layer (404 route, 405 method, parse, 422, 500) ─▶ OpenAI's error JSON
                                            {"error": {"message", "type", "param", "code"}}

Serve freezes (deep-copies) the FastAPI app when ``serve.ingress`` decorates the class,
so the middleware cannot be handed the replica's settings: ``OpenAIIngress.__init__``
registers them here with ``activate`` (one ingress per Serve replica process).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.cluster.front.openai.schemas import error_body
from pagedserve.cluster.front.tenants import DEFAULT_TENANT, TENANT_HEADER, check_tenant_name
from pagedserve.cluster.wire.failures import ReplicaLost

logger = logging.getLogger("pagedserve")

API_KEY_ENV = "PAGEDSERVE_API_KEY"
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's opt-in to loading adapters at run time
# The default body limit: room for a prompt of max_model_len tokens in its most verbose
# legitimate JSON, plus headroom. Token ids take <= 8 bytes each ("151935, "); text takes
# ~4 bytes per token in English, ~6-12 once a client escapes non-ASCII as \uXXXX (Python's
# json and the openai SDK do), and up to ~32 for long whitespace/code tokens. 32 bytes a
# token covers all of these; 4 MiB covers chat framing and the other fields. Anything
# bigger can only be a prompt over max_model_len (a 400 anyway), refused here before it
# is read, parsed or tokenized.
BODY_BYTES_PER_TOKEN = 32
BODY_HEADROOM_BYTES = 4 << 20
# A body over the limit with a Content-Length up to this is read and dropped by the HTTP
# server after its 413, so the client sees the answer; a longer one gets the connection closed.
DRAIN_BOUND_BYTES = 256 << 20


def default_max_request_body_bytes(max_model_len: int) -> int:
    return BODY_HEADROOM_BYTES + BODY_BYTES_PER_TOKEN * max_model_len


@dataclass(slots=True)
class IngressConfig:
    """HTTP-front settings (not engine settings: they never reach an engine replica)."""

    api_key: str | None = None  # /v1/* needs "Authorization: Bearer <api_key>"
    max_request_body_bytes: int | None = None  # None: default_max_request_body_bytes
    # {key: tenant} from --api-keys-file (tenants.py); any of them is a valid key too.
    api_keys: dict[str, str] | None = None
    allow_tenant_header: bool = False  # x-tenant names the tenant of an unmapped key
    # The router needs token ids (the KV router): the front tokenizes (prompt_tokens.py).
    # A tuple: one flag per model of an app of several (app.py build_openai_app).
    tokenize_for_router: bool | tuple[bool, ...] = False
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter answer (serving_models.py).
    allow_runtime_lora_updating: bool = False

    @classmethod
    def from_options(cls, api_key: str | None = None, max_request_body_bytes: int | None = None,
                     api_keys: dict[str, str] | None = None, allow_tenant_header: bool = False,
                     tokenize_for_router: bool | tuple[bool, ...] = False) -> "IngressConfig":
        """``api_key`` falls back to $PAGEDSERVE_API_KEY of the process that builds the app
        (the CLI, or ``serve run``), so a key need not be written into a config file; the
        LoRA routes follow that process's VLLM_ALLOW_RUNTIME_LORA_UPDATING (vLLM's opt-in)."""
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        if max_request_body_bytes is not None and max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be >= 1, got {max_request_body_bytes}.")
        lora_updates = os.environ.get(RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")
        return cls(api_key=key or None, max_request_body_bytes=max_request_body_bytes,
                   api_keys=api_keys or None, allow_tenant_header=bool(allow_tenant_header),
                   tokenize_for_router=(tokenize_for_router if isinstance(tokenize_for_router, tuple)
                                        else bool(tokenize_for_router)), allow_runtime_lora_updating=lora_updates)


class EdgeGuard:
    """One ingress replica's settings, as the middleware reads them."""

    def __init__(self, config: IngressConfig, max_model_len: Callable[[], Awaitable[int]]):
        self.config = config
        self._max_model_len = max_model_len
        self._limit = config.max_request_body_bytes
        # Compared as digests: equal length, so compare_digest's time says nothing.
        self._key_digest = (None if config.api_key is None
                            else hashlib.sha256(config.api_key.encode()).digest())
        # Mapped keys are looked up by digest: the dict never holds a key itself, and a
        # lookup's time depends on the digest, which says nothing about the key.
        self._tenant_of = {hashlib.sha256(k.encode()).digest(): t
                           for k, t in (config.api_keys or {}).items()}
        self.keys_required = self._key_digest is not None or bool(self._tenant_of)

    def identify(self, authorization: str | None) -> tuple[bool, str | None]:
        """(authorized, the key's tenant or None)."""
        if not self.keys_required:
            return True, None
        scheme, _, token = (authorization or "").partition(" ")
        given = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).digest()
        if scheme.lower() != "bearer":
            return False, None
        tenant = self._tenant_of.get(given)
        if tenant is not None:
            return True, tenant
        return (self._key_digest is not None and hmac.compare_digest(given, self._key_digest)), None

    def authorized(self, authorization: str | None) -> bool:
        return self.identify(authorization)[0]

    def tenant(self, key_tenant: str | None, header: str | None) -> tuple[str | None, str]:
        """(error message or None, tenant) for a request with this key tenant and x-tenant."""
        if header is None:
            return None, key_tenant or DEFAULT_TENANT
        if not self.config.allow_tenant_header:
            return (f"the {TENANT_HEADER} header is not accepted by this server (start it with "
                    f"--allow-tenant-header)"), DEFAULT_TENANT
        try:
            check_tenant_name(header, TENANT_HEADER)
        except ValueError as e:
            return str(e), DEFAULT_TENANT
        if key_tenant is not None and header != key_tenant:
            return f"this API key belongs to another tenant than {header!r}", DEFAULT_TENANT
        return None, header

    async def body_limit(self) -> int:
        if self._limit is None:  # max_model_len is the engine's; ask once
            self._limit = default_max_request_body_bytes(await self._max_model_len())
        return self._limit


_guard: EdgeGuard | None = None


def activate(guard: EdgeGuard) -> None:
    global _guard
    _guard = guard


class ErrorJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error message may quote user text, and a lone
    surrogate in it must not turn the error into an encoding failure (a 500)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error(status: int, message: str, retry_after: int | None = None,
          param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    headers = dict(headers or {})
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    return ErrorJSONResponse(error_body(status, message, param), status_code=status,
                             headers=headers or None)


def remote_error(e: Exception) -> JSONResponse:
    """An exception raised by a replica method (it arrives wrapped, RayTaskError): a
    ValueError is the user's (400); anything else is the system's: logged, 500."""
    cause = getattr(e, "cause", None) or e
    if isinstance(cause, ValueError):
        return error(400, str(cause).splitlines()[-1] if str(cause) else type(cause).__name__)
    logger.error("replica call failed", exc_info=e)
    return error(500, "internal error; see the server log")


def generation_error(rid: str, e: Exception) -> JSONResponse:
    """The answer of a whole (not streamed) response whose engine stream failed: a lost
    replica that no other replica stood in for (failover.Resumable) is a 503; anything
    else is the system's, logged with the request id, a 500 for this request only."""
    if isinstance(e, ReplicaLost):
        return error(503, f"{e}; request {rid} could not be completed elsewhere", 1)
    logger.error("request %s failed", rid, exc_info=e)
    return error(500, f"internal error while generating request {rid}; see the server log")


def _loc(e: dict) -> str:
    loc = [str(p) for p in e.get("loc", ())]
    return ".".join(loc[1:] if loc and loc[0] == "body" else loc)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # OpenAI answers 400 (not FastAPI's 422) for a malformed body.
        errors = exc.errors()
        parts = []
        params = []
        for e in errors:
            msg, kind, where = e.get("msg", "invalid"), e.get("type"), _loc(e)
            if kind == "json_invalid":
                msg = f"the body is not valid JSON ({(e.get('ctx') or {}).get('error', msg)})"
            elif kind == "extra_forbidden":  # an unknown field inside a nested object
                msg = ("unknown field: this server does not implement it (deploy/README.md lists "
                       "the fields it accepts and ignores)")
            elif kind == "not_implemented":  # schemas.NOT_IMPLEMENTED: OpenAI's or vLLM's, not done here
                where = ", ".join(f"{where}.{f}" if where else f for f in e["ctx"]["fields"].split(", "))
                msg = "not implemented by this server (deploy/README.md lists what is)"
            elif kind == "value_error":  # our own validators' messages, as written
                msg = msg.removeprefix("Value error, ")
            else:  # pydantic's own check: its error type too, as vLLM's 400 carries it
                msg = f"{msg} [type={kind}]"
            parts.append(f"{where or 'body'}: {msg}")
            params.append(where.split(", ")[0])
        param = params[0] if params else None
        return error(400, "; ".join(parts) or "invalid request", param=param or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.url.path}; see /openapi.json"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        elif exc.status_code == 400 and "parsing the body" in message:
            # Non-UTF-8 bytes, or JSON nested deeper than the parser's recursion limit.
            message = "could not parse the body: it must be UTF-8 encoded JSON"
        return error(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error(500, "internal error; see the server log")


class EdgeMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware: that would buffer streaming responses)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        guard = _guard
        if scope["type"] != "http" or guard is None:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        root, path = scope.get("root_path", ""), scope["path"]
        if root and path.startswith(root):  # under a Serve route prefix
            path = path[len(root):]
        # As vLLM's --api-key: /v1/* (/health, /metrics, /tokenize stay open), and
        # /invocations, which generates as /v1 does; never an OPTIONS preflight.
        if (path.startswith("/v1") or path == "/invocations") and scope["method"] != "OPTIONS":
            authorization = headers.get("authorization")
            if authorization is None and path.startswith("/v1/messages") and "x-api-key" in headers:
                authorization = f"Bearer {headers['x-api-key']}"  # the anthropic SDK's way to send it
            ok, key_tenant = guard.identify(authorization)
            if not ok:
                await _send(send, error(401, "invalid or missing API key: send "
                                             "'Authorization: Bearer <key>'",
                                        headers={"WWW-Authenticate": "Bearer"}), scope, receive)
                return
            bad, tenant = guard.tenant(key_tenant, headers.get(TENANT_HEADER))
            if bad is not None:
                await _send(send, error(400 if key_tenant is None else 403, bad, param=TENANT_HEADER),
                            scope, receive)
                return
            # Routes read it as request.state.tenant (Starlette's scope["state"]).
            scope.setdefault("state", {})["tenant"] = tenant
        has_body = "content-length" in headers or "transfer-encoding" in headers
        if not has_body:
            await self.app(scope, receive, send)
            return
        limit = await guard.body_limit()
        too_big = error(413, f"request body larger than {limit} bytes (--max-request-body-bytes)")
        try:
            declared = int(headers.get("content-length", "0"))
        except ValueError:
            declared = 0
        if declared > limit:  # refused before a byte of it is read (by this app)
            # The HTTP server reads the rest and drops it (uvicorn discards a request's
            # body once its response is complete), so a client that writes its whole body
            # first still reads this 413; closing now would reset the connection under it.
            # Past DRAIN_BOUND_BYTES the connection closes (a reset), not to read that much.
            await _send(send, too_big, scope, receive, close=declared > DRAIN_BOUND_BYTES)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:  # chunked, or a lying Content-Length: stop reading
                await _send(send, too_big, scope, receive)
                return
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls wait for http.disconnect, as before

        await self.app(scope, replay, send)


async def _send(send, response: JSONResponse, scope, receive, close: bool = True) -> None:
    """``close``: the connection ends with the response (a chunked body's unread rest, whose
    length nobody knows, is not read away)."""
    if close:
        response.headers["connection"] = "close"
    await response(scope, receive, send)
