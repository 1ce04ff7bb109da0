"""What every route shares: OpenAI-shaped errors, bounded body reading and validation, the merged event stream
of the requests one HTTP call submits, server-sent events. The app (``serve.api.create_app``) puts the backend on
``app.state.backend``; a handler reaches it with :func:`backend_of`."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import time
from typing import Any

import pydantic
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from .. import protocol as P
from ..request import SamplingParams, has_lone_surrogate

log = logging.getLogger("specjax.serve")
DISCONNECT_POLL_S = 0.2  # how often a non-streaming handler checks that its client is still there
# A JSON string may spell a UTF-16 surrogate as an escape ("\\ud800"); json.loads joins a pair into one code point, so a
# surrogate left in a parsed string is a lone one: not valid Unicode, and no tokenizer (nor UTF-8 encoder) takes it.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")


def backend_of(request: Request):
    return request.app.state.backend


async def parse(request: Request, model, empty_ok: bool = False):
    """The request's body as ``model``, within the server's body-size and idle limits; with ``empty_ok`` no body
    means the defaults (SGLang's routes whose body is optional)."""
    args = backend_of(request).args
    return await parse_body(request, model, args.max_request_bytes, args.http_idle_timeout, empty_ok)


def check_model(backend, name: str | None) -> None:
    """A request may name the served model (its served name or path, or "default"), or none."""
    served, args = backend.args.model_name, backend.args
    if name and name not in (served, args.model_path, "default"):
        raise APIError(404, f"the model {name!r} does not exist; this server serves {served!r}",
                       param="model", code="model_not_found", type_="not_found_error")


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
            and x.split("[")[0].split("-")[0].lower() not in _TYPE_TAGS]  # "function-before[...]": a tag


def validation_message(e: pydantic.ValidationError | RequestValidationError) -> tuple[str, str | None]:
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


def lone_surrogate(data) -> tuple[str, str | None] | None:
    """(where, field name) of the first string or object key of a parsed JSON body that holds a lone surrogate
    (``where`` a path such as ``messages[0].content``), None when there is none. Iterative: any nesting depth."""
    stack = [(data, "the body", None)]
    while stack:
        value, where, field = stack.pop()
        if isinstance(value, str):
            if has_lone_surrogate(value):
                return where, field
        elif isinstance(value, dict):
            if any(has_lone_surrogate(k) for k in value):
                return f"a field name in {where}", field
            stack.extend((v, k if where == "the body" else f"{where}.{k}", k) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]", field) for i, v in reversed(list(enumerate(value))))
    return None


async def parse_body(request: Request, model: type[P._Body], limit: int, idle_timeout: float,
                     empty_ok: bool = False):
    raw = await read_body(request, limit, idle_timeout)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 ({e.reason} at byte {e.start})",
                       code="invalid_utf8") from None
    try:
        data = {} if empty_ok and not text.strip() else json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(400, f"malformed JSON in the request body: {e.msg} (line {e.lineno} column {e.colno})",
                       code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "the request body nests JSON too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(text) and (bad := lone_surrogate(data)):
        where, field = bad
        raise APIError(400, f"{where} is not valid Unicode: it contains a lone surrogate (a \\ud800-\\udfff escape "
                            f"without its pair)", param=field, code="invalid_unicode")
    try:
        body = model.model_validate(data)
    except pydantic.ValidationError as e:
        msg, param = validation_message(e)
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

    def __init__(self, backend, priority: int | None = None):
        self.backend, self.priority = backend, priority  # SGLang's request priority, for every request added
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.reqs: list = []
        self.done: set[int] = set()
        self.text: list[str] = []
        self.ids: list[list[int]] = []
        self.meta: list[dict] = []

    def add(self, ids: list[int], sp: SamplingParams, rid: str | None = None, seed: int | None = None,
            group: str | None = None) -> int:
        i = len(self.reqs)

        def sink(ev, i=i):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (i, ev))

        try:
            self.reqs.append(self.backend.submit(ids, dataclasses.replace(sp), sink, rid=rid, seed=seed,
                                                 group=group, priority=self.priority))
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
        """Until every request finished; a request the scheduler refused (a full queue) answers the whole call
        with its status, as SGLang, and the others are aborted at once rather than run for nothing."""
        async for _, ev in self.events(request):
            refused = (ev["meta_info"].get("finish_reason") or {}) if ev["finished"] else {}
            if refused.get("status_code"):
                self.abort()
                raise APIError(refused["status_code"], refused["message"], type_="service_unavailable")
        if len(self.done) < len(self.reqs):
            raise APIError(499, "client closed the request")


def sse(obj: Any) -> str:
    if isinstance(obj, pydantic.BaseModel):
        obj = obj.model_dump(exclude_none=False)
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def seed_for(sp: SamplingParams, j: int) -> int | None:
    return None if sp.seed is None else sp.seed + j


async def drain(fan: Fanout) -> None:
    async for _ in fan.events():
        pass
