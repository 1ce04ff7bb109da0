"""HTTP front (FastAPI): SGLang's native endpoints and the OpenAI-compatible /v1 endpoints over one Backend.

Request bodies are parsed here (not by FastAPI) so that malformed JSON, invalid UTF-8, wrong field types and
out-of-range values all come back as a 400 with OpenAI's ``{"error": {message, type, param, code}}`` body, and a
``curl -d`` body (form content type) still works. Streaming is server-sent events: ``data: {json}\\n\\n`` ...
``data: [DONE]\\n\\n``. A client that goes away aborts its requests, which frees their slots and KV pages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
import uuid
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import protocol as P
from .request import RequestError, SamplingParams

log = logging.getLogger("specjax.serve")
DISCONNECT_POLL_S = 0.2  # how often a non-streaming handler checks that its client is still there


# ---- errors ------------------------------------------------------------------------------------------------------
def error_response(status: int, message: str, *, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | int | None = None) -> JSONResponse:
    body = P.ErrorResponse(error=P.ErrorInfo(message=message, type=type_, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type_ = status, message, param, code, type_


_TYPE_TAGS = ("str", "int", "float", "bool", "none", "list", "dict", "literal", "function", "union", "tagged")


def _field_path(loc) -> list[str]:
    """pydantic's error location without list indices and union-member tags: the field names only."""
    return [str(x) for x in loc if isinstance(x, str) and x != "body" and not x[:1].isupper()
            and x.split("[")[0].lower() not in _TYPE_TAGS]


def _validation_message(e: pydantic.ValidationError | RequestValidationError) -> tuple[str, str | None]:
    errs = e.errors()
    if not errs:
        return "invalid request", None
    names = _field_path(errs[0].get("loc", ()))
    msg = "; ".join(f"{'.'.join(_field_path(er.get('loc', ()))) or 'body'}: {er.get('msg')}" for er in errs[:4])
    return msg, names[-1] if names else None


async def read_body(request: Request, limit: int, idle_timeout: float) -> bytes:
    """The raw body, refused with 413 as soon as it is known to exceed ``limit`` bytes (from Content-Length before
    a byte is read, else while it streams in) and with 408 when the client stalls ``idle_timeout`` s mid-body."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body has {int(declared)} bytes; this server accepts at most {limit} "
                            f"(--max-request-bytes)", code="request_too_large")
    chunks, size = [], 0
    stream = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), timeout=idle_timeout)
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise APIError(408, f"the client sent no body bytes for {idle_timeout:g} s", code="request_timeout") \
                from None
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body exceeds {limit} bytes (--max-request-bytes)",
                           code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(request: Request, model: type[P._Body], limit: int, idle_timeout: float):
    raw = await read_body(request, limit, idle_timeout)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 ({e.reason} at byte {e.start})",
                       code="invalid_utf8") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(400, f"malformed JSON in the request body: {e.msg} (line {e.lineno} column {e.colno})",
                       code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "the request body nests JSON too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        body = model.model_validate(data)
    except pydantic.ValidationError as e:
        msg, param = _validation_message(e)
        raise APIError(400, msg, param=param) from None
    except RecursionError:
        raise APIError(400, "the request body nests JSON too deeply", code="invalid_json") from None
    body.check()
    return body


async def off_loop(fn, *args):
    """Run blocking work (tokenization, detokenization, chat templates) in a worker thread so that the event loop
    keeps answering other clients (/health included) meanwhile."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


# ---- merged event streams of several requests ---------------------------------------------------------------------
class Fanout:
    """Requests submitted together (a batch, n > 1) whose output events merge into one asyncio queue."""

    def __init__(self, backend):
        self.backend = backend
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.reqs: list = []
        self.done: set[int] = set()
        self.text: list[str] = []
        self.ids: list[list[int]] = []
        self.meta: list[dict] = []

    def add(self, ids: list[int], sp: SamplingParams, rid: str | None = None, seed: int | None = None) -> int:
        i = len(self.reqs)

        def sink(ev, i=i):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (i, ev))

        try:
            self.reqs.append(self.backend.submit(ids, dataclasses.replace(sp), sink, rid=rid, seed=seed))
        except Exception:
            self.abort()
            raise
        self.text.append("")
        self.ids.append([])
        self.meta.append({})
        return i

    def abort(self) -> None:
        for i, r in enumerate(self.reqs):
            if i not in self.done:
                self.backend.scheduler.abort(r.rid)

    async def events(self, request: Request | None = None):
        """Yields (index, event) until every request finished. A disconnected client (polled when ``request`` is
        given; streaming responses are cancelled by the server instead) aborts the rest."""
        last_check = time.monotonic()
        try:
            while len(self.done) < len(self.reqs):
                try:
                    i, ev = await asyncio.wait_for(self.queue.get(), timeout=DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    i, ev = None, None
                if request is not None and time.monotonic() - last_check >= DISCONNECT_POLL_S:
                    last_check = time.monotonic()
                    if await request.is_disconnected():
                        log.info("client disconnected; aborting %d request(s)", len(self.reqs) - len(self.done))
                        return
                if ev is None:
                    continue
                self.text[i] += ev["text"]
                self.ids[i] += ev["token_ids"]
                self.meta[i] = ev["meta_info"]
                if ev["finished"]:
                    self.done.add(i)
                yield i, ev
        finally:
            self.abort()

    async def wait(self, request: Request) -> None:
        async for _ in self.events(request):
            pass
        if len(self.done) < len(self.reqs):
            raise APIError(499, "client closed the request")


class APIKeyMiddleware:
    """``Authorization: Bearer KEY`` on every path but /health. A plain ASGI middleware (not BaseHTTPMiddleware,
    which hides the client's disconnect from the handlers)."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            got = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                resp = error_response(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                      code="invalid_api_key")
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def http_protocol(header_timeout: float):
    """uvicorn's h11 protocol, plus a deadline for each request's line and headers: a connection that has not
    completed them ``header_timeout`` s after it opened (or after its previous response) is closed, so clients
    that trickle headers (slowloris) cannot hold connections forever. uvicorn's own keep-alive timer restarts on
    every byte received, so it cannot do this."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadlineProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_deadline()

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def _arm_header_deadline(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(header_timeout, self._header_deadline)

        def _header_deadline(self) -> None:
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                log.info("closing a connection that sent no complete request headers in %gs", header_timeout)
                self.transport.close()

    return HeaderDeadlineProtocol


def sse(obj: Any) -> str:
    if isinstance(obj, pydantic.BaseModel):
        obj = obj.model_dump(exclude_none=False)
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def _seed(sp: SamplingParams, j: int) -> int | None:
    return None if sp.seed is None else sp.seed + j


def create_app(backend) -> FastAPI:
    args = backend.args
    app = FastAPI(title="specjax server", version=_version())
    served = args.model_name

    # ---- error handlers and auth ---------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return error_response(e.status, e.message, type_=e.type_, param=e.param, code=e.code)

    @app.exception_handler(RequestError)
    async def _req_error(_, e: RequestError):
        return error_response(400, str(e), param=e.param, code=e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_, e: RequestValidationError):
        msg, param = _validation_message(e)
        return error_response(400, msg, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, str(e.detail), type_=kind)

    @app.exception_handler(Exception)
    async def _internal(_, e: Exception):
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(e).__name__}: {e}", type_="internal_server_error")

    if args.api_key:
        app.add_middleware(APIKeyMiddleware, key=args.api_key)

    async def parse(request: Request, model):
        return await parse_body(request, model, args.max_request_bytes, args.http_idle_timeout)

    def check_model(name: str | None) -> None:
        if name and name not in (served, args.model_path, "default"):
            raise APIError(404, f"the model {name!r} does not exist; this server serves {served!r}",
                           param="model", code="model_not_found", type_="not_found_error")

    # ---- info ----------------------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not backend.scheduler.alive:
            return error_response(503, "the scheduler is not running", type_="service_unavailable")
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        fan = Fanout(backend)
        sp = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        try:
            fan.add([backend.cfg.bos_token_id or 0], sp, rid=f"health-{uuid.uuid4().hex[:8]}")
            await asyncio.wait_for(_drain(fan), timeout=30.0)
        except Exception as e:  # noqa: BLE001
            fan.abort()
            return error_response(503, f"could not generate: {type(e).__name__}: {e}", type_="service_unavailable")
        if (fan.meta[0].get("finish_reason") or {}).get("type") == "abort":
            return error_response(503, "generation failed", type_="service_unavailable")
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info():
        return {"model_path": args.model_path, "tokenizer_path": args.tokenizer_path or args.model_path,
                "is_generation": True}

    @app.get("/get_server_info")
    async def get_server_info():
        info = {k: v for k, v in dataclasses.asdict(args).items() if k != "api_key"}
        info.update(version=_version(), context_length=backend.context_length,
                    internal_states=[backend.scheduler.stats()], startup_seconds=round(backend.startup_s, 2))
        return info

    @app.get("/v1/models")
    async def models():
        return P.ModelList(data=[P.ModelCard(id=served, root=args.model_path,
                                             max_model_len=backend.context_length)]).model_dump()

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        ok = await asyncio.get_running_loop().run_in_executor(None, backend.scheduler.flush_cache)
        if not ok:
            return error_response(400, "cache not flushed: requests are running or waiting; retry when idle")
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await parse(request, P.AbortRequest)
        if body.abort_all:
            sched = backend.scheduler
            rids = await asyncio.get_running_loop().run_in_executor(None, lambda: sched.call(lambda: [
                r.rid for r in sched.waiting] + [r.rid for r in sched.slots if r is not None]))
            for rid in rids:
                backend.scheduler.abort(rid)
        elif body.rid:
            backend.scheduler.abort(body.rid)
        else:
            raise APIError(400, "give 'rid' or 'abort_all': true", param="rid")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        if not args.enable_metrics:
            raise APIError(404, "metrics are off; start the server with --enable-metrics", type_="not_found_error")
        return Response(backend.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---- native /generate ----------------------------------------------------------------------------------------
    @app.post("/generate")
    async def generate(request: Request):
        body = await parse(request, P.GenerateRequest)
        if (body.text is None) == (body.input_ids is None):
            raise APIError(400, "give exactly one of 'text' or 'input_ids'", param="text")
        if body.text is not None:
            batch = isinstance(body.text, list)
            texts = body.text if batch else [body.text]
            prompts = await off_loop(lambda: [backend.encode(t) for t in texts])
        else:
            batch = bool(body.input_ids) and isinstance(body.input_ids[0], list)
            prompts = body.input_ids if batch else [body.input_ids]
        if not prompts:
            raise APIError(400, "empty batch", param="text")
        sps = body.sampling_params
        if isinstance(sps, list):
            if len(sps) != len(prompts):
                raise APIError(400, f"{len(sps)} sampling_params for {len(prompts)} prompts", param="sampling_params")
        else:
            sps = [sps or P.GenerateSamplingParams()] * len(prompts)
        params = body.with_logprobs([P.to_sampling(s) for s in sps])
        for ids, s in zip(prompts, sps):
            if "max_new_tokens" in s.model_fields_set and s.max_new_tokens is not None:
                backend.check_output_budget(len(ids), s.max_new_tokens, "max_new_tokens")
        rids = body.rid if isinstance(body.rid, list) else [body.rid] * len(prompts)
        fan = Fanout(backend)
        for k, (ids, sp) in enumerate(zip(prompts, params)):
            for j in range(sp.n):
                rid = rids[k] if k < len(rids) else None
                if rid is not None and (sp.n > 1 or (len(prompts) > 1 and not isinstance(body.rid, list))):
                    rid = f"{rid}-{k}-{j}"
                fan.add(list(ids), sp, rid=rid, seed=_seed(sp, j))
        single = not batch and len(fan.reqs) == 1

        def item(i):
            return {"text": fan.text[i], "output_ids": fan.ids[i], "meta_info": fan.meta[i]}

        if body.stream:
            async def gen():
                async for i, _ in fan.events():
                    out = item(i)
                    if not single:
                        out["index"] = i
                    yield sse(out)
                yield SSE_DONE
            return StreamingResponse(gen(), media_type="text/event-stream")
        await fan.wait(request)
        outs = [item(i) for i in range(len(fan.reqs))]
        return outs[0] if single else outs

    # ---- OpenAI /v1/completions ----------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse(request, P.CompletionRequest)
        check_model(body.model)
        sp = body.sampling(body.max_tokens)
        p = body.prompt
        if isinstance(p, str):
            prompts = [p]
        elif p and isinstance(p[0], int):
            prompts = [p]
        else:
            prompts = list(p)
        if not prompts:
            raise APIError(400, "prompt is empty", param="prompt")
        ids_list = await off_loop(lambda: [backend.encode(x) if isinstance(x, str) else list(x) for x in prompts])
        if body.max_tokens is not None:
            for ids in ids_list:
                backend.check_output_budget(len(ids), body.max_tokens, "max_tokens")
        echo_text = await off_loop(lambda: [(x if isinstance(x, str) else backend.tokenizer.decode(x))
                                            if body.echo else "" for x in prompts])
        fan = Fanout(backend)
        for ids in ids_list:
            for j in range(sp.n):
                fan.add(ids, sp, seed=_seed(sp, j))
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def usage():
            pt = sum(len(i) for i in ids_list)
            ct = sum(m.get("completion_tokens", 0) for m in fan.meta)
            cached = sum(fan.meta[k * sp.n].get("cached_tokens", 0) for k in range(len(ids_list)))
            return P.UsageInfo(prompt_tokens=pt, completion_tokens=ct, total_tokens=pt + ct,
                               prompt_tokens_details={"cached_tokens": cached})

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            async def gen():
                echoed, sent = set(), {}
                async for i, ev in fan.events():
                    text = ev["text"]
                    lps = P.completion_logprobs(ev["meta_info"], backend.tokenizer, sp.top_logprobs_num, body.echo,
                                                start=sent.get(i, 0))
                    sent[i] = len(ev["meta_info"].get("output_token_logprobs", ()))
                    if body.echo and i not in echoed:
                        text, _ = echo_text[i // sp.n] + text, echoed.add(i)
                    fr = P.finish_reason_openai(ev["meta_info"]["finish_reason"]) if ev["finished"] else None
                    if not text and fr is None:
                        continue
                    yield sse(P.CompletionStreamResponse(id=cid, created=created, model=served, choices=[
                        P.CompletionStreamChoice(index=i, text=text, finish_reason=fr, logprobs=lps)]))
                if include_usage:
                    yield sse(P.CompletionStreamResponse(id=cid, created=created, model=served, choices=[],
                                                         usage=usage()))
                yield SSE_DONE
            return StreamingResponse(gen(), media_type="text/event-stream")
        await fan.wait(request)
        choices = [P.CompletionChoice(index=i, text=echo_text[i // sp.n] + fan.text[i],
                                      logprobs=P.completion_logprobs(fan.meta[i], backend.tokenizer,
                                                                     sp.top_logprobs_num, body.echo),
                                      finish_reason=P.finish_reason_openai(fan.meta[i]["finish_reason"]),
                                      matched_stop=(fan.meta[i]["finish_reason"] or {}).get("matched"))
                   for i in range(len(fan.reqs))]
        return P.CompletionResponse(id=cid, created=created, model=served, choices=choices,
                                    usage=usage()).model_dump()

    # ---- OpenAI /v1/chat/completions -----------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parse(request, P.ChatCompletionRequest)
        check_model(body.model)
        sp = body.sampling(body.token_limit)
        messages = [m.template_dict() for m in body.messages]
        ids = await off_loop(lambda: backend.encode(backend.render_chat(messages, body.chat_template_kwargs),
                                                    add_special_tokens=False))
        if body.token_limit is not None:
            backend.check_output_budget(len(ids), body.token_limit, body.token_limit_param)
        fan = Fanout(backend)
        for j in range(sp.n):
            fan.add(ids, sp, seed=_seed(sp, j))
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def usage():
            ct = sum(m.get("completion_tokens", 0) for m in fan.meta)
            return P.UsageInfo(prompt_tokens=len(ids), completion_tokens=ct, total_tokens=len(ids) + ct,
                               prompt_tokens_details={"cached_tokens": fan.meta[0].get("cached_tokens", 0)})

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def chunk(i, delta, fr=None, usage_=None, lps=None):
                choices = [] if i is None else [P.ChatStreamChoice(index=i, delta=delta, finish_reason=fr,
                                                                   logprobs=lps)]
                return sse(P.ChatCompletionStreamResponse(id=cid, created=created, model=served, choices=choices,
                                                          usage=usage_))

            async def gen():
                for j in range(sp.n):
                    yield chunk(j, P.DeltaMessage(role="assistant", content=""))
                sent = {}
                async for i, ev in fan.events():
                    lps = P.chat_logprobs(ev["meta_info"], backend.tokenizer, sp.top_logprobs_num, sent.get(i, 0))
                    sent[i] = len(ev["meta_info"].get("output_token_logprobs", ()))
                    if ev["text"] or (lps and lps["content"]):
                        yield chunk(i, P.DeltaMessage(content=ev["text"]), lps=lps)
                    if ev["finished"]:
                        yield chunk(i, P.DeltaMessage(), P.finish_reason_openai(ev["meta_info"]["finish_reason"]))
                if include_usage:
                    yield chunk(None, None, usage_=usage())
                yield SSE_DONE
            return StreamingResponse(gen(), media_type="text/event-stream")
        await fan.wait(request)
        choices = [P.ChatChoice(index=i, message=P.ChatMessageOut(content=fan.text[i]),
                                logprobs=P.chat_logprobs(fan.meta[i], backend.tokenizer, sp.top_logprobs_num),
                                finish_reason=P.finish_reason_openai(fan.meta[i]["finish_reason"]),
                                matched_stop=(fan.meta[i]["finish_reason"] or {}).get("matched"))
                   for i in range(len(fan.reqs))]
        return P.ChatCompletionResponse(id=cid, created=created, model=served, choices=choices,
                                        usage=usage()).model_dump()

    return app


async def _drain(fan: Fanout) -> None:
    async for _ in fan.events():
        pass


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("specjax")
    except Exception:  # noqa: BLE001
        return "0.0.0"
