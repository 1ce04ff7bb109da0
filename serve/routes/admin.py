"""Server administration routes (SGLang's names): liveness, model and server info, cache flush, aborts, pausing
and continuing generation, weight updates from disk and reading weights by name, Prometheus metrics."""

from __future__ import annotations

import asyncio
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from .. import protocol as P
from ..request import SamplingParams
from .common import APIError, Fanout, backend_of, drain, error_response, off_loop, parse

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    backend = backend_of(request)
    if not backend.scheduler.alive:
        return error_response(503, "the scheduler is not running", type_="service_unavailable")
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(request: Request):
    backend = backend_of(request)
    fan = Fanout(backend)
    sp = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    try:
        fan.add([backend.cfg.bos_token_id or 0], sp, rid=f"health-{uuid.uuid4().hex[:8]}")
        await asyncio.wait_for(drain(fan), timeout=30.0)
    except Exception as e:  # noqa: BLE001
        fan.abort()
        return error_response(503, f"could not generate: {type(e).__name__}: {e}", type_="service_unavailable")
    if (fan.meta[0].get("finish_reason") or {}).get("type") == "abort":
        return error_response(503, "generation failed", type_="service_unavailable")
    return Response(status_code=200)


@router.get("/get_model_info")
async def get_model_info(request: Request):
    backend = backend_of(request)
    args = backend.args
    return {"model_path": args.model_path, "tokenizer_path": args.tokenizer_path or args.model_path,
            "is_generation": True, "weight_version": backend.weight_version}


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request):
    """SGLang's: the target's weights replaced from a folder (or hub id) of the same shapes, without a restart."""
    backend = backend_of(request)
    body = await parse(request, P.UpdateWeightsFromDiskRequest)
    unsupported = next((n for n in ("is_async", "keep_pause") if getattr(body, n)), None)
    if unsupported:
        ok, message, paused = False, f"{unsupported} is not supported: the update returns when the new weights " \
                                     f"serve", 0
    else:
        ok, message, paused = await off_loop(backend.update_weights_from_disk, body.model_path, body.load_format,
                                             body.abort_all_requests, body.weight_version, body.flush_cache)
    return JSONResponse({"success": ok, "message": message, "num_paused_requests": paused},
                        status_code=200 if ok else 400)


@router.api_route("/get_weights_by_name", methods=["GET", "POST"])
async def get_weights_by_name(request: Request):
    """SGLang's: a served weight by its checkpoint name, as float32 nested lists (its first ``truncate_size`` rows),
    to check what a weight update loaded."""
    backend = backend_of(request)
    body = await parse(request, P.GetWeightsByNameRequest)
    return await off_loop(backend.get_weights_by_name, body.name, body.truncate_size)


@router.get("/get_server_info")
async def get_server_info(request: Request):
    return backend_of(request).server_info()


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request):
    backend = backend_of(request)
    ok = await asyncio.get_running_loop().run_in_executor(None, backend.scheduler.flush_cache)
    if not ok:
        return error_response(400, "cache not flushed: requests are running or waiting; retry when idle")
    return PlainTextResponse("Cache flushed.\n")


async def _abort_all(backend) -> None:
    """Abort every waiting and running request."""
    sched = backend.scheduler
    rids = await asyncio.get_running_loop().run_in_executor(None, lambda: sched.call(lambda: [
        r.rid for r in sched.waiting] + [r.rid for r in sched.slots if r is not None]))
    for rid in rids:
        sched.abort(rid)


@router.post("/abort_request")
async def abort_request(request: Request):
    backend = backend_of(request)
    body = await parse(request, P.AbortRequest)
    if body.abort_all:
        await _abort_all(backend)
    elif body.rid:
        backend.scheduler.abort(body.rid)
    else:
        raise APIError(400, "give 'rid' or 'abort_all': true", param="rid")
    return Response(status_code=200)


@router.post("/update_weight_version")
async def update_weight_version(request: Request):
    """SGLang's: the label ``/get_model_info`` and ``/get_weight_version`` report for the weights served (a trainer
    that updates the weights by other means names them so)."""
    backend = backend_of(request)
    body = await parse(request, P.UpdateWeightVersionRequest)
    if body.abort_all_requests:
        await _abort_all(backend)
    backend.weight_version = body.new_version
    return {"success": True, "message": f"Weight version updated to {body.new_version}",
            "new_version": body.new_version}


@router.get("/get_weight_version")
async def get_weight_version(request: Request):
    return {"weight_version": backend_of(request).weight_version}


@router.api_route("/release_memory_occupation", methods=["GET", "POST"])
@router.api_route("/resume_memory_occupation", methods=["GET", "POST"])
async def memory_occupation(request: Request):
    """SGLang's pair: the device memory of the weights (kept in host memory) and / or the KV pool freed while the
    server is idle, for a trainer on the same device (requests wait meanwhile), then taken back
    (``Scheduler.release_memory_occupation`` / ``resume_memory_occupation``)."""
    backend = backend_of(request)
    body = await parse(request, P.MemoryOccupationRequest)
    action = request.url.path.rsplit("/", 1)[-1]  # release_memory_occupation or resume_memory_occupation
    await off_loop(getattr(backend.scheduler, action), body.tags)
    return Response(status_code=200)


@router.api_route("/open_session", methods=["GET", "POST"])
async def open_session(request: Request):
    """SGLang's: open a session (``serve.sessions``); the answer is its id, a JSON string."""
    backend = backend_of(request)
    body = await parse(request, P.OpenSessionRequest)
    sid = backend.sessions.open(body.capacity_of_str_len, body.session_id)
    if sid is None:
        raise APIError(400, "Failed to open the session. Check if a session with the same id is still open.",
                       param="session_id")
    return sid


@router.api_route("/close_session", methods=["GET", "POST"])
async def close_session(request: Request):
    backend = backend_of(request)
    body = await parse(request, P.CloseSessionRequest)
    backend.sessions.close(body.session_id)
    return Response(status_code=200)


@router.api_route("/start_profile", methods=["GET", "POST"])
async def start_profile(request: Request):
    """SGLang's: a ``jax.profiler`` trace of the server's forward steps (``serve.profiler``)."""
    backend = backend_of(request)
    body = await parse(request, P.ProfileRequest, empty_ok=True)
    message = await off_loop(lambda: backend.scheduler.profiler.start(**body.model_dump()))
    return PlainTextResponse(message)


@router.api_route("/stop_profile", methods=["GET", "POST"])
async def stop_profile(request: Request):
    backend = backend_of(request)
    await parse(request, P.ProfileRequest, empty_ok=True)  # (no fields used; limits and JSON checked the same)
    return PlainTextResponse(await off_loop(backend.scheduler.profiler.stop))


@router.post("/pause_generation")
async def pause_generation(request: Request):
    """SGLang's: no request is admitted, prefilled or stepped until ``/continue_generation``; ``mode`` ``abort``
    (the default) aborts every running and waiting request first, ``retract`` frees the running ones' slots and K/V
    (they are prefilled again over prompt and output when generation continues), ``in_place`` keeps them where they
    stopped."""
    backend = backend_of(request)
    body = await parse(request, P.PauseGenerationRequest)
    await off_loop(backend.pause_generation, body.mode)
    return {"message": "Generation paused successfully.", "status": "ok"}


@router.post("/continue_generation")
async def continue_generation(request: Request):
    backend = backend_of(request)
    await off_loop(backend.continue_generation)
    return {"message": "Generation continued successfully.", "status": "ok"}


@router.get("/metrics")
async def metrics(request: Request):
    backend = backend_of(request)
    if not backend.args.enable_metrics:
        raise APIError(404, "metrics are off; start the server with --enable-metrics", type_="not_found_error")
    return Response(backend.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
