"""A dependency-free fake OpenAI-compatible server for testing the benchmark clients.

It streams one token per SSE chunk at a fixed pace, keeps an exact block prefix cache (so replayed
hit rates can be checked against the theoretical ones), exports the §4 prefix-cache counters on
/metrics, and can be told to fail requests. Not a server for anything else: HTTP/1.1 with
`Connection: close` on every response keeps the parser trivial.

    python tests/bench_fake_server.py --port 8011
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

# (status, message) to fail a request before streaming, or None to serve it.
FailRule = Callable[[dict], "tuple[int, str] | None"]


@dataclass
class FakeServerConfig:
    host: str = "127.0.0.1"
    port: int = 0
    model: str = "fake-model"
    ttft_s: float = 0.0
    token_delay_s: float = 0.0
    block_size: int = 16
    fail: FailRule | None = None
    # Emit `{"error": ...}` mid-stream after this many tokens (None: never).
    midstream_error_after: int | None = None
    include_usage: bool = True


@dataclass
class _State:
    cached_blocks: set = field(default_factory=set)
    queries: int = 0
    hits: int = 0
    requests: list[dict] = field(default_factory=list)


class FakeServer:
    def __init__(self, cfg: FakeServerConfig | None = None) -> None:
        self.cfg = cfg or FakeServerConfig()
        self.state = _State()
        self._server: asyncio.base_events.Server | None = None

    @property
    def base_url(self) -> str:
        assert self._server is not None, "server not started"
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    async def start(self) -> FakeServer:
        self._server = await asyncio.start_server(self._handle, self.cfg.host, self.cfg.port)
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def __aenter__(self) -> FakeServer:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # ------------------------------------------------------------------ prefix cache
    def _cache_lookup(self, prompt: list | str, salt: str | None) -> int:
        tokens = list(prompt) if isinstance(prompt, list) else list(prompt.encode())
        bs = self.cfg.block_size
        h = hashlib.sha256((salt or "").encode())
        hit, missed = 0, False
        for i in range(len(tokens) // bs):
            h = h.copy()
            h.update(json.dumps(tokens[i * bs : (i + 1) * bs]).encode())
            key = h.hexdigest()
            if not missed and key in self.state.cached_blocks:
                hit += bs
            else:
                missed = True
                self.state.cached_blocks.add(key)
        self.state.queries += len(tokens)
        self.state.hits += hit
        return hit

    # ------------------------------------------------------------------ HTTP
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {
                k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)
            }
            n = int(headers.get("content-length", 0))
            raw = await reader.readexactly(n) if n else b""
            await self._route(method, path, raw, writer)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError, ValueError):
            pass
        finally:
            try:
                writer.close()
                await writer.wait_closed()
            except ConnectionError:
                pass

    async def _send_json(self, writer: asyncio.StreamWriter, status: int, obj: dict) -> None:
        body = json.dumps(obj).encode()
        head = (
            f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        )
        writer.write(head.encode() + body)
        await writer.drain()

    async def _route(self, method: str, path: str, raw: bytes, writer: asyncio.StreamWriter) -> None:
        if method == "GET" and path == "/metrics":
            text = (
                "# TYPE vllm:prefix_cache_queries_total counter\n"
                f'vllm:prefix_cache_queries_total{{model_name="{self.cfg.model}",engine="0"}} {self.state.queries}\n'
                f'vllm:prefix_cache_hits_total{{model_name="{self.cfg.model}",engine="0"}} {self.state.hits}\n'
            ).encode()
            head = f"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {len(text)}\r\n"
            writer.write((head + "Connection: close\r\n\r\n").encode() + text)
            await writer.drain()
            return
        if method == "GET" and path == "/v1/models":
            await self._send_json(writer, 200, {"object": "list", "data": [{"id": self.cfg.model}]})
            return
        if method != "POST" or path not in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            await self._send_json(writer, 404, _error(404, f"no route {method} {path}"))
            return
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            await self._send_json(writer, 400, _error(400, "invalid JSON"))
            return
        if path == "/tokenize":
            toks = list(str(body.get("prompt", "")).encode())
            await self._send_json(writer, 200, {"tokens": toks, "count": len(toks), "max_model_len": 1 << 20})
            return
        await self._generate(path, body, writer)

    async def _generate(self, path: str, body: dict, writer: asyncio.StreamWriter) -> None:
        self.state.requests.append(body)
        if self.cfg.fail and (failure := self.cfg.fail(body)):
            status, msg = failure
            await self._send_json(writer, status, _error(status, msg))
            return
        chat = path.endswith("chat/completions")
        prompt = body.get("messages", [{}])[-1].get("content", "") if chat else body.get("prompt", "")
        n_out = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        n_in = len(prompt) if isinstance(prompt, (list, str)) else 0
        cached = self._cache_lookup(prompt, body.get("cache_salt"))
        usage = {
            "prompt_tokens": n_in,
            "completion_tokens": n_out,
            "total_tokens": n_in + n_out,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        obj = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            await asyncio.sleep(self.cfg.ttft_s + self.cfg.token_delay_s * max(n_out - 1, 0))
            choice = {"index": 0, "finish_reason": "length"}
            choice |= (
                {"message": {"role": "assistant", "content": "a" * n_out}} if chat else {"text": "a" * n_out}
            )
            await self._send_json(
                writer,
                200,
                {
                    "id": "x",
                    "object": obj,
                    "created": int(time.time()),
                    "model": self.cfg.model,
                    "choices": [choice],
                    "usage": usage,
                },
            )
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")

        async def event(data: dict | str) -> None:
            writer.write(f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode())
            await writer.drain()

        if chat:  # role-only first delta, as OpenAI servers send: it carries no token
            await event({"object": obj + ".chunk", "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        await asyncio.sleep(self.cfg.ttft_s)
        for i in range(n_out):
            if i:
                await asyncio.sleep(self.cfg.token_delay_s)
            if self.cfg.midstream_error_after is not None and i == self.cfg.midstream_error_after:
                await event(_error(500, "engine died mid-stream"))
                await event("[DONE]")
                return
            fin = "length" if i == n_out - 1 else None
            choice = {"index": 0, "finish_reason": fin}
            choice |= {"delta": {"content": "a"}} if chat else {"text": "a"}
            await event({"object": obj + (".chunk" if chat else ""), "choices": [choice], "usage": None})
        opts = body.get("stream_options") or {}
        if opts.get("include_usage") and self.cfg.include_usage:
            await event({"object": obj, "choices": [], "usage": usage})
        await event("[DONE]")


def _error(status: int, message: str) -> dict:
    kind = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}.get(status, "Error")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--ttft", type=float, default=0.01)
    p.add_argument("--token-delay", type=float, default=0.002)
    args = p.parse_args()

    async def serve() -> None:
        srv = await FakeServer(
            FakeServerConfig(args.host, args.port, ttft_s=args.ttft, token_delay_s=args.token_delay)
        ).start()
        print(f"fake server on {srv.base_url}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
