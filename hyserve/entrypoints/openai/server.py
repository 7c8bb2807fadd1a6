"""The OpenAI-compatible HTTP server: a FastAPI app over an `AsyncEngineClient` (docs/ARCHITECTURE.md §8.3).

`build_app(args)` makes the app (the engine process starts in its lifespan); `run_server(args)` serves it
with uvicorn, which turns SIGINT/SIGTERM into a graceful shutdown that also stops the engine process.
"""

from __future__ import annotations

import argparse
import logging
import os
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import hyserve
from hyserve import envs
from hyserve.config import DEFAULT_MODEL, EMBEDDED_MODEL_DIR, EMBEDDED_MODEL_NAME, EngineConfig
from hyserve.engine.engine_client import AsyncEngineClient
from hyserve.entrypoints.anthropic.protocol import error_body as anthropic_error_body
from hyserve.entrypoints.anthropic.serving_messages import messages_router
from hyserve.entrypoints.chat import get_chat_encoder
from hyserve.entrypoints.engine_args import engine_kwargs_from_args
from hyserve.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from hyserve.entrypoints.openai.serving_chat import create_chat_completion
from hyserve.entrypoints.openai.serving_common import ServerState
from hyserve.entrypoints.openai.serving_completion import create_completion
from hyserve.entrypoints.openai.serving_responses import responses_router
from hyserve.entrypoints.serve import SERVE_EXCLUDED
from hyserve.metrics import ServerMetrics
from hyserve.tokenizer import load_tokenizer, tokenizer_source

log = logging.getLogger("hyserve.server")

# Paths that need the API key; health, version and metrics stay open for probes and scrapers (as vLLM).
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
_PARSER_FAMILIES = {"kimi_k3": "k3", "k3": "k3", "kimi_k2": "k2", "k2": "k2"}


def _is_anthropic(path: str) -> bool:
    """Paths of the Anthropic Messages API, whose errors have Anthropic's shape."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


class RequestIdAndAuth:
    """ASGI middleware: echo X-Request-Id, and check the API key. Pure ASGI (not BaseHTTPMiddleware),
    so streaming responses and disconnect detection pass through untouched."""

    def __init__(self, app, api_key: str | None) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        request_id = headers.get(b"x-request-id")
        if self.api_key and scope["path"].startswith(_PROTECTED_PREFIXES):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            # Anthropic's clients send the key as `x-api-key`, OpenAI's as a bearer token: either will do.
            if auth != f"Bearer {self.api_key}" and headers.get(b"x-api-key", b"").decode("latin-1") != self.api_key:
                message = "Invalid or missing API key."
                body = anthropic_error_body(401, message) if _is_anthropic(scope["path"]) else APIError(401, message).body()
                extra = {"x-request-id": request_id.decode("latin-1")} if request_id else {}
                return await JSONResponse(body, status_code=401, headers=extra)(scope, receive, send)

        async def send_with_id(message) -> None:
            if request_id and message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = list(message.get("headers") or []) + [(b"x-request-id", request_id)]
            await send(message)

        return await self.app(scope, receive, send_with_id)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the engine flags given (entrypoints/engine_args.py), the model from MODEL."""
    envs.get()  # a bad HYSERVE_* value fails here, naming the switch, not later in the engine process
    return EngineConfig(model=args.model or DEFAULT_MODEL, **engine_kwargs_from_args(args, exclude=SERVE_EXCLUDED))


def describe_config(cfg: EngineConfig, info: dict[str, Any]) -> str:
    """The effective cache settings for the start-up log: `cfg` as the engine resolved it, the sizes the
    engine chose filled in."""
    offload = f"{cfg.cpu_offload_bytes / 2**30:g} GiB" if cfg.cpu_offload_bytes else "off"
    return (f"prefix_caching={cfg.enable_prefix_caching} "
            f"retention_interval={cfg.prefix_cache_retention_interval} "
            f"second_hit={cfg.prefix_cache_second_hit} end_of_generation={cfg.prefix_cache_end_of_generation} "
            f"kv_offloading={offload} num_gpu_blocks={info.get('num_blocks')}"
            f"{' (override)' if cfg.num_gpu_blocks is not None else ''} "
            f"num_state_slots={info.get('num_state_slots')} "
            f"num_checkpoint_slots={info.get('num_checkpoint_slots', cfg.num_checkpoint_slots)} "
            f"enforce_eager={cfg.enforce_eager} scheduling_policy={cfg.scheduling_policy}")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return f"Invalid JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}", None
        param = param or (loc[0] if loc else None)
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request", param


def build_app(args: argparse.Namespace) -> FastAPI:
    cfg = engine_config_from_args(args)
    default_name = EMBEDDED_MODEL_NAME if os.path.abspath(cfg.model) == EMBEDDED_MODEL_DIR else cfg.model
    served = getattr(args, "served_model_name", None) or default_name
    holder: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client = AsyncEngineClient(cfg)
        metrics = ServerMetrics(served, lambda: client.stats)
        client.observer = metrics
        await client.start()
        metrics.set_cache_config(client.info)
        family = client.info["tokenizer_family"]
        chosen = args.chat_encoding or _PARSER_FAMILIES.get(args.tool_call_parser or args.reasoning_parser or "")
        encoding = chosen or family
        tokenizer = load_tokenizer(tokenizer_source(cfg.model, cfg.tokenizer, cfg.load_format), family)
        try:  # fail at start-up, not per request, when the encoding does not fit the tokenizer
            get_chat_encoder(encoding).stop_token_ids(tokenizer)
        except (KeyError, ValueError) as e:
            await client.shutdown()
            raise RuntimeError(f"chat encoding {encoding!r} does not fit this model's tokenizer: {e}") from e
        holder["state"] = ServerState(
            client=client, tokenizer=tokenizer, served_model_name=served, model_path=cfg.model, family=family,
            chat_encoding=encoding, max_waiting_requests=args.max_waiting_requests,
            emit_reasoning_content=bool(getattr(args, "reasoning_content", False)), metrics=metrics,
        )
        log.info("engine ready: %s", client.info.get("cache_description"))
        log.info("cache config: %s", describe_config(client.info["config"], client.info))
        try:
            yield
        finally:
            await client.shutdown()

    app = FastAPI(title="hyserve", version=hyserve.__version__, lifespan=lifespan)
    app.add_middleware(RequestIdAndAuth, api_key=args.api_key)

    def state() -> ServerState:
        return holder["state"]

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(APIError(400, message, param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Routing (404/405) and body-parsing errors (bad UTF-8, nesting too deep) get the OpenAI error
        # shape too, not FastAPI's {"detail": ...}, so clients can read them like every other error.
        err = APIError(exc.status_code, str(exc.detail), headers=exc.headers)
        body = anthropic_error_body(exc.status_code, err.message) if _is_anthropic(request.url.path) else err.body()
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(UnicodeEncodeError)
    async def _unencodable_text(_: Request, exc: UnicodeEncodeError) -> JSONResponse:
        # JSON allows escaped lone surrogates ("\ud800"), which no tokenizer can encode: the client's fault.
        message = f"the request holds text that is not valid Unicode: {exc.reason} at {exc.object[exc.start:exc.end]!r}"
        return JSONResponse(APIError(400, message).body(), status_code=400)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(APIError(500, f"{type(exc).__name__}: {exc}").body(), status_code=500)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state().client.is_alive else 503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": hyserve.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state().metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        s = state()
        card = ModelCard(id=s.served_model_name, root=s.model_path, max_model_len=s.max_model_len)
        return ModelList(data=[card]).model_dump()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await create_completion(state(), req, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await create_chat_completion(state(), req, request)

    app.include_router(responses_router(state))
    app.include_router(messages_router(state))

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        s = state()
        s.check_model(req.model)
        if req.messages is not None:
            kwargs = dict(req.chat_template_kwargs or {})
            kwargs.setdefault("add_generation_prompt", req.add_generation_prompt)
            try:
                ids = get_chat_encoder(s.chat_encoding).encode(s.tokenizer, req.messages, req.tools, **kwargs)
            except (ValueError, KeyError, TypeError, AttributeError) as e:  # as in chat: malformed messages
                raise APIError(400, f"invalid messages: {e}", param="messages") from e
        elif req.prompt is not None:
            ids = s.tokenizer.encode(req.prompt)
        else:
            raise APIError(400, "tokenize needs prompt or messages")
        out: dict[str, Any] = {"count": len(ids), "max_model_len": s.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = [s.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        s = state()
        s.check_model(req.model)
        vocab = int(s.client.info["vocab_size"])
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids out of range [0, {vocab}): {bad[:5]}", param="tokens")
        return {"prompt": s.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    return app


def run_server(args: argparse.Namespace) -> None:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(args)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5,
                            access_log=False)
    try:
        uvicorn.Server(config).run()
    except KeyboardInterrupt:  # uvicorn re-raises SIGINT after its graceful shutdown; nothing is left to do
        pass
