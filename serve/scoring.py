"""SGLang's decoder-only scoring (``POST /v1/score``, ``Engine.score``): for each item, how likely each of
``label_token_ids`` is as the next token after query + item (item + query with ``item_first``).

Each pair is one prefill-only request (``max_new_tokens: 0``) that asks for the labels' logprobs after its prompt
(``token_ids_logprob``; the scheduler keeps them for a request that emits nothing), so the pairs batch like any
prompts. When the prompts share a prefix of a page or more (the query, when it comes first), the first item is
scored alone and the others after it, so that they find the shared prefix in the prefix cache (``waves``) instead
of each computing it. Text is joined before it
is tokenized, as SGLang does (``f"{query}{item}"``); token ids are concatenated. Scores per item, in the labels'
order: with ``apply_softmax`` the softmax over the labels' logprobs (the next-token distribution restricted to the
labels, summing to 1), else each label's probability exp(logprob).
"""

from __future__ import annotations

import dataclasses
import math

from specjax import sampling

from .request import RequestError, SamplingParams, check_text, token_ids


def score_prompts(encode, query, items, item_first: bool = False) -> list[list[int]]:
    """One prompt's token ids per item: query and items both text (``encode`` tokenizes) or both token ids;
    a RequestError naming the field otherwise."""
    if query is None or items is None:
        raise RequestError("give both query and items", param="query" if query is None else "items")
    if isinstance(items, str):
        items = [items]
    if not isinstance(items, (list, tuple)) or not items:
        raise RequestError("items must be a non-empty list of strings or of token id lists", param="items")
    if isinstance(query, str):
        if not all(isinstance(x, str) for x in items):
            raise RequestError("a text query takes text items (token id items need a token id query)", "items")
        check_text(query, "query")
        texts = [check_text(x, "items") for x in items]
        return [encode(x + query if item_first else query + x) for x in texts]
    q = token_ids(query, "query")
    if not all(isinstance(x, (list, tuple)) for x in items):
        raise RequestError("a token id query takes items that are lists of token ids", param="items")
    lists = [token_ids(x, "items") for x in items]
    return [x + q if item_first else q + x for x in lists]


def score_params(label_token_ids, vocab_size: int) -> SamplingParams:
    """A prefill-only request's parameters asking for the labels' logprobs after its prompt."""
    if not isinstance(label_token_ids, (list, tuple)) or not label_token_ids:
        raise RequestError("label_token_ids must be a non-empty list of token ids", param="label_token_ids")
    labels = token_ids(label_token_ids, "label_token_ids")
    bad = next((t for t in labels if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"label token id {bad} is outside the vocabulary [0, {vocab_size})",
                           param="label_token_ids")
    if len(labels) > sampling.MAX_TOKEN_IDS_LOGPROB:
        raise RequestError(f"at most {sampling.MAX_TOKEN_IDS_LOGPROB} label_token_ids, got {len(labels)}",
                           param="label_token_ids")
    sp = SamplingParams(max_new_tokens=0, return_logprob=True, token_ids_logprob=labels)
    sp.validate()
    return sp


class ItemNotScored(RuntimeError):
    """A scoring request finished without its logprobs (aborted by a client or a pause, or its prefill failed)."""


def waves(prompts: list[list[int]], page_size: int, cache_on: bool) -> list[list[int]]:
    """The prompts' indices in the order to submit them: the first alone, then the rest, when they share at least
    a page (which the first one's prefill puts in the prefix cache); else all at once."""
    head = prompts[0][:page_size]  # one page in common is what the cache shares: compare that much only
    shared = len(head) == page_size and all(p[:page_size] == head for p in prompts[1:])
    if cache_on and len(prompts) > 1 and shared:
        return [[0], list(range(1, len(prompts)))]
    return [list(range(len(prompts)))]


def item_scores(meta: dict, apply_softmax: bool, index: int = 0) -> list[float]:
    """Item ``index``'s scores from its request's meta_info (``output_token_ids_logprobs``: the position after the
    prompt), in the labels' order; ItemNotScored when the request ended without them."""
    entries = meta.get("output_token_ids_logprobs") or [None]
    if entries[0] is None:
        reason = meta.get("finish_reason") or {}
        raise ItemNotScored(f"item {index} was not scored: {reason.get('message') or reason.get('type')}")
    lps = [lp for lp, _, _ in entries[0]]
    if not apply_softmax:
        return [math.exp(x) for x in lps]
    top = max(lps)
    e = [math.exp(x - top) for x in lps]
    total = sum(e)
    return [x / total for x in e]


@dataclasses.dataclass
class ScoreJob:
    """One scoring call: a prompt per item, the parameters of their requests, the waves to submit them in
    (``waves``), and the scores of the waves recorded so far (``record``). Its callers submit and wait."""
    prompts: list[list[int]]
    params: SamplingParams
    apply_softmax: bool
    waves: list[list[int]]
    scores: list

    @classmethod
    def make(cls, encode, vocab_size: int, page_size: int, cache_on: bool, query, items, label_token_ids,
             apply_softmax: bool = False, item_first: bool = False) -> "ScoreJob":
        """The job of SGLang's arguments (``score_params`` and ``score_prompts`` check them, in that order)."""
        params = score_params(label_token_ids, vocab_size)
        prompts = score_prompts(encode, query, items, item_first)
        return cls(prompts, params, apply_softmax, waves(prompts, page_size, cache_on), [None] * len(prompts))

    def record(self, wave: list[int], metas) -> None:
        """The scores of a finished wave's items from their meta_info, in its order (ItemNotScored for one that
        ended without them: the caller stops before the next wave)."""
        for i, meta in zip(wave, metas):
            self.scores[i] = item_scores(meta, self.apply_softmax, i)
