"""The OpenAI-compatible HTTP server: a FastAPI app over an `AsyncEngineClient` (docs/ARCHITECTURE.md §8.3).

`build_app(args)` makes the app (the engine process starts in its lifespan); `run_server(args)` serves it
with uvicorn, which turns SIGINT/SIGTERM into a graceful shutdown that also stops the engine process.

If the engine process dies (killed, out of memory, a kernel fault), in-flight requests fail with a 503,
/health answers 503, and the server shuts down and exits with status 1 so that its supervisor (systemd,
Kubernetes, a container runtime) restarts it, as vLLM does: a server without an engine must not sit up
answering 503 forever.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import hyserve
from hyserve import envs
from hyserve.config import DEFAULT_MODEL, EMBEDDED_MODEL_DIR, EMBEDDED_MODEL_NAME, EngineConfig
from hyserve.entrypoints.anthropic.serving_messages import messages_router
from hyserve.entrypoints.chat import get_chat_encoder
from hyserve.entrypoints.engine_args import engine_kwargs_from_args
from hyserve.entrypoints.engine_client import AsyncEngineClient
from hyserve.entrypoints.openai import api_docs
from hyserve.entrypoints.openai.errors import install_error_handlers
from hyserve.entrypoints.openai.middleware import RequestIdAndAuth
from hyserve.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeRequest,
)
from hyserve.entrypoints.openai.responses_store import ResponseStore
from hyserve.entrypoints.openai.serving_chat import create_chat_completion
from hyserve.entrypoints.openai.serving_common import ServerState
from hyserve.entrypoints.openai.serving_completion import create_completion
from hyserve.entrypoints.openai.serving_responses import responses_router
from hyserve.entrypoints.serve import SERVE_EXCLUDED
from hyserve.metrics import ServerMetrics
from hyserve.sampling_params import max_n
from hyserve.tokenizer import load_tokenizer, tokenizer_source

log = logging.getLogger("hyserve.server")

_PARSER_FAMILIES = {"kimi_k3": "k3", "k3": "k3", "kimi_k2": "k2", "k2": "k2"}


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


def build_app(args: argparse.Namespace, on_engine_dead: Callable[[str], None] | None = None) -> FastAPI:
    """`on_engine_dead(message)` is called once if the engine process dies (run_server exits then)."""
    cfg = engine_config_from_args(args)
    default_name = EMBEDDED_MODEL_NAME if os.path.abspath(cfg.model) == EMBEDDED_MODEL_DIR else cfg.model
    served = getattr(args, "served_model_name", None) or default_name
    holder: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client = AsyncEngineClient(cfg)
        metrics = ServerMetrics(served, lambda: client.stats)
        client.observer = metrics
        client.on_dead = on_engine_dead
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
        store = ResponseStore.for_server(getattr(args, "responses_store_size", None),
                                         getattr(args, "responses_store_mib", None))
        holder["state"] = ServerState(
            client=client, tokenizer=tokenizer, served_model_name=served, model_path=cfg.model, family=family,
            chat_encoding=encoding, max_waiting_requests=args.max_waiting_requests,
            emit_reasoning_content=bool(getattr(args, "reasoning_content", False)), metrics=metrics,
            extra={"responses_store": store},
        )
        log.info("engine ready: %s", client.info.get("cache_description"))
        log.info("cache config: %s", describe_config(client.info["config"], client.info))
        try:
            yield
        finally:
            await client.shutdown()

    app = FastAPI(title="hyserve", version=hyserve.__version__, lifespan=lifespan)
    app.add_middleware(RequestIdAndAuth, api_key=args.api_key)

    def bounds() -> dict[str, Any] | None:
        """The largest token id and max_tokens (a prompt has one token at least) and n; the model's names."""
        s = holder.get("state")
        if s is None:
            return None
        return {"token_id": int(s.client.info["vocab_size"]) - 1, "max_tokens": s.max_model_len - 1, "n": max_n(),
                "model_names": list(dict.fromkeys((s.served_model_name, s.model_path)))}

    api_docs.install_openapi(app, bounds)

    def state() -> ServerState:
        return holder["state"]

    install_error_handlers(app)

    @app.get("/health", response_class=Response, responses=api_docs.HEALTH)
    async def health() -> Response:
        """200 with an empty body while the engine runs (as vLLM); 503 once it has died."""
        client = state().client
        if client.is_alive:
            return Response(status_code=200)
        err = APIError(503, f"The engine is not running: {client.dead or 'it has stopped'}")
        return JSONResponse(err.body(), status_code=503)

    @app.get("/version", responses=api_docs.json_ok(api_docs.VersionResponse))
    async def version() -> dict:
        return {"version": hyserve.__version__}

    @app.get("/metrics", response_class=Response, responses=api_docs.METRICS)
    async def metrics() -> Response:
        return Response(state().metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses={**api_docs.json_ok(ModelList), **api_docs.errors(401)})
    async def models() -> dict:
        s = state()
        card = ModelCard(id=s.served_model_name, root=s.model_path, max_model_len=s.max_model_len)
        return ModelList(data=[card]).model_dump()

    @app.post("/v1/completions", responses={**api_docs.json_ok(api_docs.CompletionResponse, stream=True),
                                            **api_docs.GENERATE})
    async def completions(req: CompletionRequest, request: Request):
        return await create_completion(state(), req, request)

    @app.post("/v1/chat/completions", responses={**api_docs.json_ok(api_docs.ChatCompletionResponse, stream=True),
                                                 **api_docs.GENERATE})
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await create_chat_completion(state(), req, request)

    app.include_router(responses_router(state))
    app.include_router(messages_router(state))

    @app.post("/tokenize", responses={**api_docs.json_ok(api_docs.TokenizeResponse), **api_docs.TOKENS})
    async def tokenize(req: TokenizeRequest) -> dict:
        s = state()
        s.check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            kwargs = dict(req.chat_template_kwargs or {})
            kwargs.setdefault("add_generation_prompt", req.add_generation_prompt)
            try:
                ids = get_chat_encoder(s.chat_encoding).encode(s.tokenizer, req.messages, req.tools, **kwargs)
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:  # as in chat
                raise APIError(400, f"invalid messages: {e}", param="messages") from e
        else:
            ids = s.tokenizer.encode(req.prompt)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": s.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = [s.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        return out

    @app.post("/detokenize", responses={**api_docs.json_ok(api_docs.DetokenizeResponse), **api_docs.TOKENS})
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
    died: list[str] = []

    def engine_died(message: str) -> None:
        # In-flight requests already hold their 503; a graceful shutdown lets their responses go out.
        log.error("the engine process died; shutting down so that a supervisor can restart the server")
        died.append(message)
        server.should_exit = True

    app = build_app(args, on_engine_dead=engine_died)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5,
                            access_log=False)
    server = uvicorn.Server(config)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises SIGINT after its graceful shutdown; nothing is left to do
        pass
    if died:
        sys.exit(1)
