"""SGLang's native ``POST /generate``: text or token ids in, one request per prompt and per ``n``, JSON or
server-sent events out."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from .. import protocol as P
from ..request import batch_rids, copy_rid
from .common import SSE_DONE, APIError, Fanout, backend_of, off_loop, parse, seed_for, sse

router = APIRouter()


@router.post("/generate")
async def generate(request: Request):
    backend = backend_of(request)
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
    prompts, recorders = backend.prepare_prompts(prompts, body.session_params)
    sps = body.sampling_params
    if isinstance(sps, list):
        if len(sps) != len(prompts):
            raise APIError(400, f"{len(sps)} sampling_params for {len(prompts)} prompts", param="sampling_params")
    else:
        sps = [sps or P.GenerateSamplingParams()] * len(prompts)
    params = body.with_logprobs([P.to_sampling(s) for s in sps])
    for ids, s, sp in zip(prompts, sps, params):
        backend.check_request(ids, sp, "max_new_tokens" in s.model_fields_set and s.max_new_tokens is not None)
    rids = batch_rids(body.rid, len(prompts))
    fan = Fanout(backend, priority=body.priority)
    for k, (ids, sp) in enumerate(zip(prompts, params)):
        for j in range(sp.n):
            rid, group = copy_rid(body.rid, rids, k, j, sp.n, len(prompts))
            fan.add(list(ids), sp, rid=rid, seed=seed_for(sp, j), group=group)
            recorders[k](fan.reqs[-1])
    single = not batch and len(fan.reqs) == 1

    def item(i):
        return {"text": fan.text[i], "output_ids": fan.ids[i], "meta_info": fan.meta[i]}

    if body.stream:
        incremental = backend.args.incremental_streaming_output

        async def gen():
            async for i, ev in fan.events():
                out = item(i) if not incremental else \
                    {"text": ev["text"], "output_ids": ev["token_ids"], "meta_info": fan.meta[i]}
                if not single:
                    out["index"] = i
                yield sse(out)
            yield SSE_DONE
        return StreamingResponse(gen(), media_type="text/event-stream")
    await fan.wait(request)
    outs = [item(i) for i in range(len(fan.reqs))]
    return outs[0] if single else outs
