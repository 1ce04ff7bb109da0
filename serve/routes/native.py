"""SGLang's native ``POST /generate``: text or token ids in, one request per prompt and per ``n``, JSON or
server-sent events out."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from .. import protocol as P
from .common import SSE_DONE, APIError, Fanout, backend_of, off_loop, parse, seed_for, sse

router = APIRouter()


def batch_rids(rid: str | list[str] | None, count: int) -> list[str | None]:
    """The rid of each of ``count`` prompts: a list gives one per prompt, each its own (an abort by rid would stop
    every request under it; a rid still in flight is the scheduler's refusal)."""
    if not isinstance(rid, list):
        return [rid] * count
    if len(rid) != count:
        raise APIError(400, f"{len(rid)} rids for {count} prompts: give one rid per prompt", param="rid")
    seen = set()
    for r in rid:
        if r and r in seen:  # "" asks for none: the scheduler makes one
            raise APIError(400, f"the rid {r!r} repeats in the batch: give each prompt its own rid", param="rid",
                           code="duplicate_rid")
        seen.add(r)
    return list(rid)


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
    fan = Fanout(backend)
    for k, (ids, sp) in enumerate(zip(prompts, params)):
        for j in range(sp.n):
            rid, group = rids[k], None
            if rid is not None and (sp.n > 1 or (len(prompts) > 1 and not isinstance(body.rid, list))):
                rid, group = f"{rid}-{k}-{j}", rid  # an abort by the client's rid still reaches every copy
            fan.add(list(ids), sp, rid=rid, seed=seed_for(sp, j), group=group)
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
