"""The OpenAI-compatible routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``, and SGLang's
``/v1/score``, ``/v1/tokenize`` and ``/v1/detokenize`` (also at ``/tokenize`` and ``/detokenize``)."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from .. import protocol as P
from .. import scoring
from .common import SSE_DONE, APIError, Fanout, backend_of, check_model, off_loop, parse, seed_for, sse

router = APIRouter()


async def openai_request(request: Request, model, text: bool = True):
    """(backend, served model name, body) of a /v1 request, refused with 404 when it names another model, and with
    400 when the route answers in ``text`` and the server has no tokenizer (``--skip-tokenizer-init``)."""
    backend = backend_of(request)
    body = await parse(request, model)
    check_model(backend, body.model)
    if text:
        backend.text_tokenizer(None)
    return backend, backend.args.model_name, body


def cache_report(backend, cached: int) -> dict | None:
    """``usage.prompt_tokens_details``: the prompt tokens found cached, with ``--enable-cache-report`` (SGLang's)."""
    return {"cached_tokens": cached} if backend.args.enable_cache_report else None


@router.get("/v1/models")
async def models(request: Request):
    backend = backend_of(request)
    args = backend.args
    served = args.model_name
    return P.ModelList(data=[P.ModelCard(id=served, root=args.model_path,
                                         max_model_len=backend.context_length)]).model_dump()


@router.post("/v1/completions")
async def completions(request: Request):
    backend, served, body = await openai_request(request, P.CompletionRequest)
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
    given = await off_loop(lambda: [backend.encode(x) if isinstance(x, str) else list(x) for x in prompts])
    ids_list = [backend.fit_prompt(ids) for ids in given]  # (--allow-auto-truncate cuts a long one)
    if body.max_tokens is not None:
        for ids in ids_list:
            backend.check_output_budget(len(ids), body.max_tokens, "max_tokens")
    echo_text = await off_loop(lambda: [(x if isinstance(x, str) and len(ids) == len(g) else
                                         backend.tokenizer.decode(ids)) if body.echo else ""
                                        for x, g, ids in zip(prompts, given, ids_list)])
    fan = Fanout(backend, priority=body.priority)
    for ids in ids_list:
        for j in range(sp.n):
            fan.add(ids, sp, seed=seed_for(sp, j))
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def usage():
        pt = sum(len(i) for i in ids_list)
        ct = sum(m.get("completion_tokens", 0) for m in fan.meta)
        cached = sum(fan.meta[k * sp.n].get("cached_tokens", 0) for k in range(len(ids_list)))
        return P.UsageInfo(prompt_tokens=pt, completion_tokens=ct, total_tokens=pt + ct,
                           prompt_tokens_details=cache_report(backend, cached))

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def gen():
            echoed, sent, offset = set(), {}, {}  # per choice: tokens with logprobs sent, characters they start
            async for i, ev in fan.events():
                text = ev["text"]
                lps, offset[i] = P.completion_logprobs_chunk(ev["meta_info"], backend.tokenizer, sp.top_logprobs_num,
                                                             body.echo, start=sent.get(i, 0),
                                                             text_offset=offset.get(i, 0),
                                                             skip_special=sp.skip_special_tokens)
                sent[i] = len(ev["meta_info"].get("output_token_logprobs", ()))
                if body.echo and i not in echoed:
                    text, _ = echo_text[i // sp.n] + text, echoed.add(i)
                fr = P.finish_reason_openai(ev["meta_info"]["finish_reason"]) if ev["finished"] else None
                if not text and fr is None and not (lps and lps["tokens"]):
                    continue  # (a token whose text is held back still sends its logprobs, as chat does)
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
                                                                 sp.top_logprobs_num, body.echo,
                                                                 skip_special=sp.skip_special_tokens),
                                  finish_reason=P.finish_reason_openai(fan.meta[i]["finish_reason"]),
                                  matched_stop=(fan.meta[i]["finish_reason"] or {}).get("matched"))
               for i in range(len(fan.reqs))]
    return P.CompletionResponse(id=cid, created=created, model=served, choices=choices,
                                usage=usage()).model_dump()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    backend, served, body = await openai_request(request, P.ChatCompletionRequest)
    sp = body.sampling(body.token_limit, body.token_limit_param)
    messages = [m.template_dict() for m in body.messages]
    ids = await off_loop(lambda: backend.fit_prompt(backend.encode(
        backend.render_chat(messages, body.chat_template_kwargs), add_special_tokens=False)))
    if body.token_limit is not None:
        backend.check_output_budget(len(ids), body.token_limit, body.token_limit_param)
    fan = Fanout(backend, priority=body.priority)
    for j in range(sp.n):
        fan.add(ids, sp, seed=seed_for(sp, j))
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def usage():
        ct = sum(m.get("completion_tokens", 0) for m in fan.meta)
        return P.UsageInfo(prompt_tokens=len(ids), completion_tokens=ct, total_tokens=len(ids) + ct,
                           prompt_tokens_details=cache_report(backend, fan.meta[0].get("cached_tokens", 0)))

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


@router.post("/v1/score")
async def score(request: Request):
    """SGLang's decoder-only scoring: per item, the probabilities of ``label_token_ids`` as the next token after
    query + item (``serve.scoring``); each pair is a prefill-only request."""
    backend, served, body = await openai_request(request, P.ScoringRequest, text=False)
    job = await off_loop(backend.score_job, body.query, body.items, body.label_token_ids, body.apply_softmax,
                         body.item_first)
    for wave in job.waves:
        fan = Fanout(backend)
        for i in wave:
            fan.add(job.prompts[i], job.params)
        await fan.wait(request)
        try:  # a wave that failed answers before the next is submitted
            job.record(wave, fan.meta)
        except scoring.ItemNotScored as e:
            raise APIError(503, str(e), type_="service_unavailable") from None
    pt = sum(len(ids) for ids in job.prompts)
    return P.ScoringResponse(scores=job.scores, model=served,
                             usage=P.UsageInfo(prompt_tokens=pt, total_tokens=pt)).model_dump()


@router.post("/v1/tokenize")
@router.post("/tokenize", include_in_schema=False)
async def tokenize(request: Request):
    """Token ids of a prompt (or of each of a list of prompts) with the served tokenizer, and the served context."""
    backend, _, body = await openai_request(request, P.TokenizeRequest)
    one = isinstance(body.prompt, str)
    texts = [body.prompt] if one else body.prompt
    ids = await off_loop(lambda: [backend.encode(t, add_special_tokens=body.add_special_tokens) for t in texts])
    return P.TokenizeResponse(tokens=ids[0] if one else ids, count=len(ids[0]) if one else [len(i) for i in ids],
                              max_model_len=backend.context_length).model_dump()


@router.post("/v1/detokenize")
@router.post("/detokenize", include_in_schema=False)
async def detokenize(request: Request):
    """The text of a list of token ids (or of each of a list of them) with the served tokenizer."""
    backend, _, body = await openai_request(request, P.DetokenizeRequest)
    one = not body.tokens or isinstance(body.tokens[0], int)
    lists = [body.tokens] if one else body.tokens
    n = max(len(backend.tokenizer), backend.cfg.vocab_size)  # a padded vocabulary's ids decode to nothing
    for ids in lists:
        bad = next((t for t in ids if not 0 <= t < n), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {n})", param="tokens")
    texts = await off_loop(lambda: [backend.tokenizer.decode(ids, skip_special_tokens=body.skip_special_tokens)
                                    for ids in lists])
    return P.DetokenizeResponse(text=texts[0] if one else texts).model_dump()
