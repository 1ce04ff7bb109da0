"""Penalties, logit_bias, min_new_tokens and logprobs (issue 13), exact under speculative decoding.

Tiny closed-form "bigram" models (tests/spec_models.py: the heads usually agree with the target, so drafted paths
of several tokens are verified) check that speculative greedy output with penalties equals plain greedy output with
the same penalties, token for token, for EAGLE3 and EAGLE trees (each tree node's penalties count the tokens drafted
above it), and that the logprobs the runners report under speculation equal the plain runner's (greedy rows) and
are the target's temperature-adjusted, penalised log_softmax (a sampled row, plain and speculative). A numpy
rendering of the penalty formulas checks ``sampling.process_logits`` itself.
"""

import numpy as np
import pytest
from spec_models import bigram_models, tiny_config

from specjax import sampling
from specjax.generate import generate
from specjax.serve.runners.plain import PlainRunner
from specjax.serve.runners.spec import SpecRunner
from specjax.speculative.spec_generate import speculative_generate

R = sampling.SamplingRow
MAX_NEW = 24
FAST_COMPILE = {"xla_backend_optimization_level": 0}


@pytest.fixture(scope="module")
def models():
    cfg = tiny_config()
    tp, _, e3, e1 = bigram_models(cfg, seed=0, draft_vocab=48, beta=0.25)  # margins that penalties can flip
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in (5, 17, 3, 30)]
    base = generate(tp, cfg, prompts, max_new_tokens=MAX_NEW, stop_token_ids=())
    return cfg, tp, {"EAGLE3": e3, "EAGLE": e1}, prompts, base


def penalised_rows(base):
    stop = base[2][3]  # row 2 would emit it as its 4th token: min_new_tokens holds it back
    return stop, [R(temperature=0, repetition_penalty=1.5),
                  R(temperature=0, frequency_penalty=0.8, presence_penalty=0.5,
                    logit_bias=((base[1][2], -100.0), (5, 1.0))),
                  R(temperature=0, min_new_tokens=10, stop_ids=(stop,)),
                  R(temperature=0)]


def numpy_penalised(logits, row: R, prompt, output):
    """The penalty formulas, written independently of specjax (module docstring of specjax.sampling)."""
    x = np.asarray(logits, np.float64).copy()
    seen = set(prompt) | set(output)
    for t in seen:
        x[t] = x[t] / row.repetition_penalty if x[t] > 0 else x[t] * row.repetition_penalty
    for t in set(output):
        x[t] -= row.frequency_penalty * output.count(t) + row.presence_penalty
    for t, b in row.logit_bias:
        x[t] += b
    if len(output) < row.min_new_tokens:
        x[list(row.stop_ids)] = -np.inf
    return x


def test_process_logits_matches_the_formulas():
    rng = np.random.default_rng(1)
    v = 16
    logits = rng.normal(size=(2, v)).astype(np.float32) * 3
    prompts = [[1, 2, 3, 3], [4]]
    outputs = [[3, 5, 5, 7], [4, 4, 9]]
    rows = [R(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=-0.25, logit_bias=((0, 2.0),),
              min_new_tokens=5, stop_ids=(7, 8)),
            R(repetition_penalty=0.8, frequency_penalty=-1.0, logit_bias=((9, -3.0), (10, 1.0)), min_new_tokens=3,
              stop_ids=(11,))]
    sb = sampling.SamplingBatch.from_rows(rows, v, prompts)
    for i, out in enumerate(outputs):
        for t in out:
            sb = sampling.record(sb, np.asarray([[t if r == i else 0] for r in range(2)], np.int32),
                                 np.asarray([1 if r == i else 0 for r in range(2)], np.int32))
    got = np.asarray(sampling.process_logits(logits, sb))
    for i in range(2):
        want = numpy_penalised(logits[i], rows[i], prompts[i], outputs[i])
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("alg,conf", [("EAGLE3", (5, 8, 32)), ("EAGLE", (3, 1, 4))])
def test_speculative_greedy_with_penalties_equals_plain(models, alg, conf):
    cfg, tp, heads, prompts, base = models
    stop, rows = penalised_rows(base)
    ref = generate(tp, cfg, prompts, max_new_tokens=MAX_NEW, stop_token_ids=(stop,), rows=rows)
    free = generate(tp, cfg, prompts, max_new_tokens=MAX_NEW, stop_token_ids=(stop,))
    assert ref[3] == free[3]  # the unpenalised row is unchanged
    assert all(r != f for r, f in zip(ref[:3], free))  # the penalties changed the others
    assert len(free[2]) == 4 and len(ref[2]) > 10 and stop not in ref[2][:10]  # min_new_tokens held the stop back
    assert base[1][2] not in ref[1]  # logit_bias -100
    s, k, m = conf
    out, stats = speculative_generate(tp, cfg, heads[alg], prompts, algorithm=alg, num_steps=s, topk=k,
                                      num_draft_tokens=m, max_new_tokens=MAX_NEW, stop_token_ids=(stop,), rows=rows,
                                      compiler_options=FAST_COMPILE)
    assert out == ref
    assert stats["tau"] > 1.15, stats  # drafted paths were accepted: the tree-path penalty state was exercised


PAGE, PPS = 8, 8
SAMPLED = R(temperature=0.7, seed=11, frequency_penalty=0.5, presence_penalty=0.3, logprobs=True)


def run_runner(runner, prompts, rows, max_new):
    """Every prompt in its own slot, stepped together; returns per prompt (tokens, logprobs, top ids, top logprobs,
    the logprobs of the row's ``logprob_ids``) of the first ``max_new`` tokens."""
    state = runner.init_state()
    out = [dict(tok=[], lp=[], ids=[], top=[], by_id=[]) for _ in prompts]

    def take(i, toks, lps, w):
        lp, ids, top, by_id = lps
        for j in range(w):
            out[i]["tok"].append(int(toks[j]))
            out[i]["lp"].append(float(lp[i, j]))
            out[i]["ids"].append(ids[i, j].tolist())
            out[i]["top"].append(top[i, j].tolist())
            out[i]["by_id"].append(by_id[i, j, :len(rows[i].logprob_ids)].tolist())

    for i, (p, r) in enumerate(zip(prompts, rows)):
        pages = np.arange(1 + i * PPS, 1 + (i + 1) * PPS)
        state, first = runner.prefill(state, i, np.asarray(p), pages, r)
        take(i, [first], runner.logprobs(state), 1)
    active = np.ones(len(prompts), bool)
    while min(len(o["tok"]) for o in out) < max_new:
        state, toks, counts = runner.step(state, active)
        lps = runner.logprobs(state)
        for i in range(len(prompts)):
            take(i, toks[i], lps, int(counts[i]))
    return [{k: v[:max_new] for k, v in o.items()} for o in out]


@pytest.fixture(scope="module")
def runner_outputs(models):
    cfg, tp, heads, prompts, base = models
    stop, rows = penalised_rows(base)
    # Row 3 samples (temperature 0.7, penalties): its logprobs are the temperature-adjusted ones.
    # Rows 0 and 3 also ask for the logprobs of a few ids (SGLang's token_ids_logprob), some repeated.
    rows = [sampling.dataclasses.replace(r, logprobs=True, seed=7) for r in rows[:3]] + [SAMPLED]
    rows[0] = sampling.dataclasses.replace(rows[0], logprob_ids=(5, 0, cfg.vocab_size - 1, 5))
    rows[3] = sampling.dataclasses.replace(rows[3], logprob_ids=tuple(range(cfg.vocab_size - 32, cfg.vocab_size)))
    kw = dict(max_batch=4, pages_per_seq=PPS, page_size=PAGE, num_pages=1 + 4 * PPS, attention_impl="xla")
    plain = run_runner(PlainRunner(cfg, tp, **kw), prompts, rows, 16)
    spec = {alg: run_runner(SpecRunner(cfg, tp, alg, *heads[alg], num_steps=3, topk=2, num_draft_tokens=5,
                                       prefill_chunk=16, **kw), prompts, rows, 16) for alg in heads}
    return prompts, rows, plain, spec, base


def check_target_logprobs(cfg, tp, prompt, row: R, out):
    """``out``'s logprobs are SGLang's: log_softmax(penalised target logits / temperature) (temperature 1 for greedy
    rows) at each emitted token, from a target forward over prompt + output and the numpy penalty formulas."""
    import jax.numpy as jnp

    from specjax.models import target
    o = out["tok"]
    seq = jnp.asarray([prompt + o], jnp.int32)
    pos = jnp.arange(seq.shape[1], dtype=jnp.int32)[None]
    logits = np.asarray(target.forward(tp, cfg, seq, pos).logits[0], np.float64)
    t = row.temperature if row.temperature > 0 else 1.0
    for j in range(len(o)):
        x = numpy_penalised(logits[len(prompt) - 1 + j], row, prompt, o[:j]) / t
        m = x[np.isfinite(x)].max()
        lse = np.log(np.exp(x - m).sum()) + m
        assert out["lp"][j] == pytest.approx(x[o[j]] - lse, abs=1e-4)
        order = np.argsort(-x, kind="stable")[:sampling.TOP_LOGPROBS]
        np.testing.assert_allclose(out["top"][j], x[order] - lse, atol=1e-4)
        want = np.maximum(x[list(row.logprob_ids)] - lse, np.finfo(np.float32).min)  # -inf reported as SGLang does
        np.testing.assert_allclose(out["by_id"][j], want, atol=1e-4, rtol=1e-6)


def test_runner_logprobs_are_the_penalised_log_softmax(models, runner_outputs):
    """The plain runner's logprobs, greedy and sampled rows: log_softmax of the penalised target logits (divided by
    the temperature) at each emitted token."""
    cfg, tp, _, _, _ = models
    prompts, rows, plain, _, _ = runner_outputs
    for i in range(4):
        check_target_logprobs(cfg, tp, prompts[i], rows[i], plain[i])


def numpy_filtered(logits, temperature, top_k, top_p, min_p):
    """temperature -> top_k -> top_p -> min_p by sorting, written independently of specjax."""
    x = np.asarray(logits, np.float64) / temperature
    if top_k > 0:
        x = np.where(x >= np.sort(x)[::-1][top_k - 1], x, -np.inf)
    p = np.exp(x - x.max())
    p /= p.sum()
    if top_p < 1:
        ps = np.sort(p)[::-1]
        keep = int(np.sum(np.cumsum(ps) - ps < top_p))
        p = np.where(p >= ps[max(keep, 1) - 1], p, 0.0)
    p = np.where(p >= min_p * p.max(), p, 0.0)
    return p / p.sum()


def test_target_probs_filters_match_sorting():
    """``sampling.target_probs`` finds the top-k and top-p edges by bisection on the values, not by sorting the
    vocabulary: the same distributions as the sorted definition, per row, ties and a mixed batch included."""
    rng = np.random.default_rng(2)
    v = 1000
    logits = rng.normal(size=(6, v)).astype(np.float32) * 2
    logits[1, :40] = 10.0  # a tie across the top-k edge
    rows = [(0.7, -1, 1.0, 0.0), (1.0, 20, 1.0, 0.0), (0.9, -1, 0.5, 0.0), (1.3, 50, 0.9, 0.05),
            (0.5, 1, 1.0, 0.0), (1.0, -1, 0.999, 0.0)]
    t, k, p, m = (np.asarray(c, dt) for c, dt in zip(zip(*rows), (np.float32, np.int32, np.float32, np.float32)))
    got = np.asarray(sampling.target_probs(logits, t, k, p, m))
    for i, row in enumerate(rows):
        want = numpy_filtered(logits[i], *row)
        np.testing.assert_array_equal(got[i] > 0, want > 0, err_msg=str(row))
        np.testing.assert_allclose(got[i], want, rtol=2e-5, atol=1e-7, err_msg=str(row))
    tied = (got[1] > 0).sum()
    assert tied == 40, tied  # every token tied at the edge stays


def test_inverse_cdf_draws_the_float64_token_and_never_a_zero():
    """``sampling.inverse_cdf`` (the draw of every sampled token, plain and speculative) picks the token whose
    float64 cumulative interval holds u x the row's mass, over sparse rows (a top-k / top-p filter's zeros), a
    vocabulary not a multiple of its block, rows that do not sum to 1, and u at 0 and just under 1 (where rounding
    would run past the last token with mass); ``token_uniforms`` depend on the key and the token's index alone."""
    rng = np.random.default_rng(5)
    for v in (1000, 49152, 37):
        p = rng.random((64, v)) ** 8 * (rng.random((64, v)) < 0.3)
        p[:, 0] += (p.sum(-1) == 0)  # every row has some mass
        p[:3] = 0.0
        p[:3, 1:6] = 0.2
        u = rng.random(64)
        u[:3] = (0.0, 0.9999999, 1.0 - 2.0 ** -24)
        got = np.asarray(sampling.inverse_cdf(p.astype(np.float32), u.astype(np.float32)))
        want = (np.cumsum(p, -1) <= (u * p.sum(-1))[:, None]).sum(-1)
        want[1:3] = 5  # just under 1: the last token with mass
        np.testing.assert_array_equal(got, want)
        assert (p[np.arange(64), got] > 0).all()
    nan_row = np.asarray(sampling.inverse_cdf(np.zeros((1, 1000), np.float32), np.asarray([0.5], np.float32)))
    assert 0 <= nan_row[0] < 1000  # a row without mass (NaN logits) still names a token of the vocabulary
    keys = np.stack([sampling._key_data(s) for s in (1, 2)])
    a = np.asarray(sampling.token_uniforms(keys, np.asarray([[0, 1, 2], [0, 1, 2]])))
    b = np.asarray(sampling.token_uniforms(keys, np.asarray([[2, 7, 0], [1, 9, 9]])))
    assert a.shape == (2, 3, 2) and (a[0, 2] == b[0, 0]).all() and (a[0, 0] == b[0, 2]).all()
    assert (a[1, 1] == b[1, 0]).all() and not (a[0] == a[1]).all()


@pytest.mark.parametrize("alg", ["EAGLE3", "EAGLE"])
def test_speculative_sampled_logprobs_are_the_targets(models, runner_outputs, alg):
    """A sampled, penalised row under speculation (its tokens differ from plain's: other random draws): the logprobs
    of the tokens it emitted are the target's temperature-adjusted, penalised ones, i.e. from the verify forward."""
    cfg, tp, _, _, _ = models
    prompts, rows, plain, spec, _ = runner_outputs
    assert rows[3].temperature > 0 and len(set(spec[alg][3]["tok"])) > 1
    check_target_logprobs(cfg, tp, prompts[3], rows[3], spec[alg][3])


@pytest.mark.parametrize("alg", ["EAGLE3", "EAGLE"])
def test_speculative_runner_tokens_and_logprobs_equal_plain(runner_outputs, alg):
    _, _, plain, spec, _ = runner_outputs
    for p, s in zip(plain[:3], spec[alg][:3]):  # the greedy rows (row 3 samples)
        assert s["tok"] == p["tok"]
        np.testing.assert_allclose(s["lp"], p["lp"], atol=1e-4)
        np.testing.assert_allclose(s["top"], p["top"], atol=1e-4)
