"""Speculative sampling is lossless: the joint distribution of the first three generated tokens under speculative
decoding equals the target's, computed exactly by enumeration on a 32-token vocab.

Thousands of rows with the same prompt and different seeds run in ONE jitted call. The first token comes from
prefill; the 2nd and 3rd come from tree verification (num_steps=2, topk=3: siblings are tried in turn, so the
reject-and-renormalise rule is exercised, not only single-child acceptance). Criterion: Pearson chi-square over the
cells (those with expected count < 5 pooled), p > 0.001. The same check must FAIL for deliberately broken verifiers,
so the test can fail.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from spec_models import bigram_models, random_models, tiny_config

from specjax import sampling
from specjax.models import target
from specjax.speculative import verify
from specjax.speculative.spec_generate import speculative_generate

N = 4000  # sampled rows per run
N_GREEDY = 4  # extra greedy rows in the same batch (mixed batches take the per-row path)
TEMP, TOP_K, TOP_P = 0.8, 8, 0.9
CONF = (2, 3, 6)
PROMPT = [3, 17, 5, 29, 11, 2]
FAST_COMPILE = {"xla_backend_optimization_level": 0}


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config(vocab=32, hidden=32)
    tp, _, b_e3, b_e1 = bigram_models(cfg, seed=1, beta=0.25)
    _, r_e3, _ = random_models(cfg, seed=2)
    return cfg, tp, {"agreeing": b_e1, "agreeing3": b_e3, "random3": r_e3}


def exact_joint(cfg, tp, row=None):
    """{(x1, x2, x3): probability} under the target with the test's sampling parameters (and ``row``'s penalties,
    applied by the independent numpy formulas of test_sampling_params)."""
    from test_sampling_params import numpy_penalised

    def probs(seqs):
        seqs = jnp.asarray(seqs, jnp.int32)
        pos = jnp.broadcast_to(jnp.arange(seqs.shape[1], dtype=jnp.int32), seqs.shape)
        logits = target.forward(tp, cfg, seqs, pos, logits_at=jnp.full((seqs.shape[0], 1), seqs.shape[1] - 1)).logits
        if row is not None:
            logits = jnp.asarray(np.stack([numpy_penalised(lg, row, PROMPT, list(np.asarray(sq)[len(PROMPT):]))
                                           for lg, sq in zip(np.asarray(logits[:, 0]), seqs)])[:, None], jnp.float32)
        n = seqs.shape[0]
        return np.asarray(sampling.target_probs(logits[:, 0], jnp.full((n,), TEMP), jnp.full((n,), TOP_K),
                                                jnp.full((n,), TOP_P), jnp.zeros((n,))), np.float64)

    joint = {(): 1.0}
    for _ in range(3):
        prefixes = list(joint)
        p = probs([PROMPT + list(x) for x in prefixes])
        joint = {x + (t,): joint[x] * p[i, t] for i, x in enumerate(prefixes) for t in np.nonzero(p[i] > 0)[0]}
    return joint


def chi_square(samples, joint):
    """(p-value, total variation) of the observed triples against the exact joint."""
    counts = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    assert set(counts) <= set(joint), f"tokens outside the target's support: {set(counts) - set(joint)}"
    n = len(samples)
    cells = sorted(joint, key=joint.get, reverse=True)
    big = [c for c in cells if n * joint[c] >= 5]
    small = [c for c in cells if n * joint[c] < 5]
    obs = [counts.get(c, 0) for c in big] + [sum(counts.get(c, 0) for c in small)]
    exp = [n * joint[c] for c in big] + [n * sum(joint[c] for c in small)]
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    obs, exp = np.asarray(obs, np.float64), np.asarray(exp, np.float64)
    stat = float(((obs - exp) ** 2 / exp).sum())
    pval = float(jax.scipy.stats.chi2.sf(stat, len(obs) - 1))
    tv = 0.5 * sum(abs(counts.get(c, 0) / n - joint[c]) for c in joint)
    return pval, tv


def run(cfg, tp, head, alg, sample_accept_fn=None, row=None, thresholds=verify.LOSSLESS):
    rows = N + N_GREEDY
    temps = [TEMP] * N + [0.0] * N_GREEDY
    kw = dict(temperature=temps, top_k=TOP_K, top_p=TOP_P, seed=list(range(rows)))
    if row is not None:  # penalised rows: the same sampling parameters plus the row's penalties
        kw = dict(rows=[sampling.dataclasses.replace(row, temperature=t, top_k=TOP_K, top_p=TOP_P, seed=i)
                        for i, t in enumerate(temps)])
    out, stats = speculative_generate(tp, cfg, head, [PROMPT] * rows, algorithm=alg, num_steps=CONF[0],
                                      topk=CONF[1], num_draft_tokens=CONF[2], max_new_tokens=3, stop_token_ids=(),
                                      sample_accept_fn=sample_accept_fn, compiler_options=FAST_COMPILE,
                                      thresholds=thresholds, **kw)
    return [tuple(o) for o in out[:N]], out[N:], stats


@pytest.fixture(scope="module")
def joint(setup):
    cfg, tp, _ = setup
    return exact_joint(cfg, tp)


@pytest.mark.parametrize("head,alg", [("agreeing", "EAGLE"), ("agreeing3", "EAGLE3"), ("random3", "EAGLE3")])
def test_speculative_sampling_matches_target(setup, joint, head, alg):
    cfg, tp, heads = setup
    samples, greedy_rows, stats = run(cfg, tp, heads[head], alg)
    pval, tv = chi_square(samples, joint)
    print(f"\n{head}/{alg}: chi-square p={pval:.3g} TV={tv:.3f} tau={stats['tau']:.2f}")
    assert pval > 1e-3, (pval, tv)
    # The greedy rows of the same batch reproduce plain greedy decoding.
    from specjax.generate import generate
    assert all(g == generate(tp, cfg, [PROMPT], max_new_tokens=3, stop_token_ids=())[0] for g in greedy_rows)
    if head.startswith("agreeing"):
        assert stats["tau"] > 1.3, stats["tau"]  # drafts were accepted often: the rule was really exercised


def always_accept_first_child(tree, probs, uniforms, num_steps):
    """BROKEN: follow the first child at every level regardless of p (the relaxed rule at single = 0)."""
    return verify.sample_accept(tree, probs, uniforms, num_steps, verify.Thresholds(single=0.0))


def residual_keeps_children(tree, probs, uniforms, num_steps):
    """BROKEN: the children are accepted rightly, but when none holds the target's token the bonus is drawn again
    from the full p (the children not removed), which over-weights drafted tokens."""
    acc = verify.sample_accept(tree, probs, uniforms, num_steps)
    b = probs.shape[0]
    last = acc.path[jnp.arange(b), acc.accept_len]
    u = jnp.take_along_axis(uniforms[:, :, 1], acc.accept_len[:, None], axis=1)[:, 0]
    bonus = sampling.inverse_cdf(probs[jnp.arange(b), last], u)
    j = jnp.arange(num_steps + 1)
    tokens = jnp.where(j[None] == acc.accept_len[:, None], bonus[:, None], acc.tokens)
    return verify.Accepted(path=acc.path, accept_len=acc.accept_len, tokens=tokens, bonus=bonus)


@pytest.mark.parametrize("broken", [always_accept_first_child, residual_keeps_children], ids=lambda f: f.__name__)
def test_broken_verifiers_fail_the_same_check(setup, joint, broken):
    cfg, tp, heads = setup
    samples, _, _ = run(cfg, tp, heads["agreeing"], "EAGLE", sample_accept_fn=broken)
    pval, tv = chi_square(samples, joint)
    print(f"\n{broken.__name__}: chi-square p={pval:.3g} TV={tv:.3f}")
    assert pval < 1e-3, (pval, tv)


def test_relaxed_thresholds_reach_the_step_and_leave_greedy_rows_exact(setup, joint):
    """SGLang's relaxed acceptance through ``speculative_generate``: with ``--speculative-accept-threshold-single
    0`` every drafted token is accepted (p >= 0), so each sampled row takes its two tokens after prefill in one step
    (the random head is accepted for ~1.1 tokens per step losslessly), its tokens no longer follow the target's
    distribution, and the greedy rows of the same batch still give plain greedy's tokens."""
    cfg, tp, heads = setup
    samples, greedy_rows, stats = run(cfg, tp, heads["random3"], "EAGLE3", thresholds=verify.Thresholds(single=0.0))
    assert stats["verify_steps"][:N] == [1] * N
    observed = {}
    for x in samples:
        observed[x] = observed.get(x, 0.0) + 1.0 / N
    outside = sum(p for x, p in observed.items() if x not in joint)  # drafted tokens outside top-k / top-p
    tv = tv_distance(observed, joint)
    print(f"\nrelaxed single=0: TV={tv:.3f}, {outside:.3f} outside the target's support, tau={stats['tau']:.2f}")
    assert tv > 0.3 and outside > 0.05, (tv, outside)
    from specjax.generate import generate
    assert all(g == generate(tp, cfg, [PROMPT], max_new_tokens=3, stop_token_ids=())[0] for g in greedy_rows)


PENALTIES = sampling.SamplingRow(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.4,
                                 logit_bias=((4, 1.5), (9, -2.0)), min_new_tokens=2, stop_ids=(11, 23))


def test_speculative_sampling_with_penalties_matches_target(setup):
    """Penalties follow each tree path (a drafted node counts the tokens drafted above it), so the joint of the first
    three tokens is the penalised target's; the greedy rows of the batch equal plain greedy with the penalties."""
    cfg, tp, heads = setup
    joint = exact_joint(cfg, tp, PENALTIES)
    assert tv_distance(joint, exact_joint(cfg, tp)) > 0.1  # the penalties really change the distribution
    samples, greedy_rows, stats = run(cfg, tp, heads["agreeing3"], "EAGLE3", row=PENALTIES)
    pval, tv = chi_square(samples, joint)
    print(f"\npenalised agreeing3/EAGLE3: chi-square p={pval:.3g} TV={tv:.3f} tau={stats['tau']:.2f}")
    assert pval > 1e-3, (pval, tv)
    from specjax.generate import generate
    ref = generate(tp, cfg, [PROMPT], max_new_tokens=3, stop_token_ids=(),
                   rows=[sampling.dataclasses.replace(PENALTIES, temperature=0.0)])[0]
    assert all(g == ref for g in greedy_rows)
    assert stats["tau"] > 1.2, stats["tau"]


def tv_distance(p, q):
    return 0.5 * sum(abs(p.get(c, 0.0) - q.get(c, 0.0)) for c in set(p) | set(q))


def test_target_only_steps_sample_the_target(setup, joint):
    """``spec_step.target_step`` (the server's step at batch sizes where plain decoding is faster: the root alone is
    verified): tokens 2 and 3 drawn by two such steps after prefill follow the target's joint distribution."""
    import dataclasses
    from specjax.speculative import draft as draft_lib, spec_step
    from specjax.speculative.spec_generate import _prefill_prompts
    cfg, tp, heads = setup
    d = draft_lib.as_draft(heads["agreeing3"], "EAGLE3", tp)
    scfg = spec_step.SpecConfig(*CONF)
    sb = sampling.SamplingBatch.make(N, temperature=[TEMP] * N, top_k=TOP_K, top_p=TOP_P, min_p=0.0,
                                     seed=list(range(N)), vocab=cfg.vocab_size, width=scfg.tokens_per_step)
    state = dataclasses.replace(spec_step.init_state(cfg, d, scfg, N, 16, page_size=16), sampling=sb)
    state, first = _prefill_prompts(tp, cfg, d, scfg, state, [PROMPT] * N, ())
    step = jax.jit(spec_step.target_step, static_argnums=(1, 3))
    cols = [np.asarray(first)]
    for _ in range(2):
        state, toks, counts = step(tp, cfg, d, scfg, state, jnp.ones((N,), bool))
        assert np.all(np.asarray(counts) == 1)
        cols.append(np.asarray(toks)[:, 0])
    pval, tv = chi_square([tuple(int(x) for x in r) for r in zip(*cols)], joint)
    print(f"\ntarget-only steps: chi-square p={pval:.3g} TV={tv:.3f}")
    assert pval > 1e-3, (pval, tv)


@pytest.mark.parametrize("head,alg,shape", [("agreeing3", "EAGLE3", CONF), ("agreeing3", "EAGLE3", (3, 1, 4)),
                                            ("random3", "EAGLE3", (1, 2, 3)), ("agreeing", "EAGLE", (2, 2, 4))])
def test_seeded_speculative_sampling_emits_plain_samplings_tokens(setup, head, alg, shape):
    """A sampled row draws its n-th token from the uniform its seed gives token n (``sampling.token_uniforms``),
    in plain decoding and in a verified tree alike, so speculative sampling emits plain sampling's tokens with the
    same seed, token for token, whatever the tree (the server's tree shape follows its batch) and with penalties;
    the drafts were accepted (tau > 1), so the tree's rule, not only its bonus, produced them."""
    from specjax.generate import generate
    cfg, tp, heads = setup
    rows = [sampling.dataclasses.replace(PENALTIES if i % 3 == 0 else sampling.SamplingRow(), temperature=t,
                                         top_k=TOP_K if i % 2 else -1, top_p=TOP_P, seed=1000 + i)
            for i, t in enumerate([TEMP, 1.0, 0.5, 0.0] * 3)]
    prompts = [PROMPT[:3 + i % 4] for i in range(len(rows))]
    plain = generate(tp, cfg, prompts, max_new_tokens=10, stop_token_ids=(), rows=rows)
    spec, stats = speculative_generate(tp, cfg, heads[head], prompts, algorithm=alg, num_steps=shape[0],
                                       topk=shape[1], num_draft_tokens=shape[2], max_new_tokens=10,
                                       stop_token_ids=(), rows=rows, compiler_options=FAST_COMPILE)
    assert spec == plain
    assert stats["tau"] > 1.1, stats["tau"]
