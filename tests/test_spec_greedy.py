"""THE oracle: speculative greedy decoding == plain greedy decoding (specjax.generate), token for token.

Two model sets of identical shapes (so they share compiles): random target + random heads (acceptance is rare but
not zero), and the closed-form "bigram" target + heads of tests/spec_models.py, built so the draft usually agrees with
the target (acceptance is non-trivial: tau > 1 is asserted). Both heads use a 48-of-64-token draft vocab (EAGLE3 d2t
map, EAGLE FR-Spec hot ids), so the vocab mapping is on the tested path.
"""

import jax
import numpy as np
import pytest
from spec_models import bigram_models, random_models, tiny_config

from specjax.generate import generate
from specjax.speculative.spec_generate import speculative_generate

CONFIGS = [(3, 4, 16), (5, 8, 64), (5, 8, 32), (1, 1, 2), (3, 1, 4)]
MAX_NEW = 24
FAST_COMPILE = {"xla_backend_optimization_level": 0}  # halves XLA:CPU compile time; tiny models run fast anyway


@pytest.fixture(scope="module")
def models():
    cfg = tiny_config()
    rtp, r_e3, r_e1 = random_models(cfg, seed=0, draft_vocab=48)
    btp, perm, b_e3, b_e1 = bigram_models(cfg, seed=0, draft_vocab=48)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in (5, 17, 3, 30)]
    return dict(cfg=cfg, random=(rtp, {"EAGLE3": r_e3, "EAGLE": r_e1}), bigram=(btp, {"EAGLE3": b_e3, "EAGLE": b_e1}),
                prompts=prompts, plain={})


def plain(models, which, prompts, stop=()):
    key = (which, tuple(map(tuple, prompts)), stop)
    if key not in models["plain"]:
        tp = models[which][0]
        models["plain"][key] = generate(tp, models["cfg"], prompts, max_new_tokens=MAX_NEW, stop_token_ids=stop)
    return models["plain"][key]


def spec(models, which, alg, conf, prompts, stop=(), max_new=MAX_NEW):
    tp, heads = models[which]
    s, k, m = conf
    return speculative_generate(tp, models["cfg"], heads[alg], prompts, algorithm=alg, num_steps=s, topk=k,
                                num_draft_tokens=m, max_new_tokens=max_new, stop_token_ids=stop,
                                compiler_options=FAST_COMPILE)


def check_stats(out, stats, conf):
    assert stats["completion_tokens"] == [len(o) for o in out]
    for steps, acc, n in zip(stats["verify_steps"], stats["accept_lengths"], stats["completion_tokens"]):
        assert len(acc) == steps
        assert sum(acc) + 1 == n  # the first token comes from prefill, every other one from a verify step
        assert all(1 <= a <= conf[0] + 1 for a in acc)
    assert stats["tau"] == pytest.approx(sum(stats["completion_tokens"]) / sum(stats["verify_steps"]))


@pytest.mark.parametrize("alg", ["EAGLE3", "EAGLE"])
@pytest.mark.parametrize("conf", CONFIGS, ids=lambda c: "%d-%d-%d" % c)
def test_random_models_batch4(models, alg, conf):
    ref = plain(models, "random", models["prompts"])
    out, stats = spec(models, "random", alg, conf, models["prompts"])
    assert out == ref
    check_stats(out, stats, conf)


@pytest.mark.parametrize("alg,conf", [("EAGLE3", (3, 4, 16)), ("EAGLE", (3, 1, 4))])
def test_random_models_batch1(models, alg, conf):
    prompts = [models["prompts"][1]]
    out, stats = spec(models, "random", alg, conf, prompts)
    assert out == plain(models, "random", prompts)
    check_stats(out, stats, conf)


@pytest.mark.parametrize("alg", ["EAGLE3", "EAGLE"])
@pytest.mark.parametrize("conf", [(3, 1, 4), (5, 8, 32)], ids=lambda c: "%d-%d-%d" % c)
def test_agreeing_heads_accept_and_stay_exact(models, alg, conf):
    ref = plain(models, "bigram", models["prompts"])
    out, stats = spec(models, "bigram", alg, conf, models["prompts"])
    assert out == ref
    check_stats(out, stats, conf)
    assert stats["tau"] > 1.3, stats
    assert max(max(a) for a in stats["accept_lengths"]) >= 3  # some step accepted 2+ draft tokens


def test_rows_stop_on_their_own_stop_token_and_budget(models):
    ref_free = plain(models, "bigram", models["prompts"])
    stop = (ref_free[0][9],)  # row 0 stops at its 10th token at the latest; other rows whenever they emit it
    ref = plain(models, "bigram", models["prompts"], stop)
    assert len({len(r) for r in ref}) > 1  # rows really finish at different times
    out, stats = spec(models, "bigram", "EAGLE3", (3, 1, 4), models["prompts"], stop)
    assert out == ref
    check_stats(out, stats, (3, 1, 4))
    # Per-row token budgets (greedy output is prefix-closed, so plain output truncated is the reference).
    budget = [MAX_NEW, 7, 1, 13]
    out, stats = spec(models, "bigram", "EAGLE", (5, 8, 32), models["prompts"], max_new=budget)
    assert out == [r[:n] for r, n in zip(ref_free, budget)]
    assert stats["verify_steps"][2] == 0
    check_stats(out, stats, (5, 8, 32))


def prefilled_bigram(models, alg):
    """The bigram target and ``alg`` head with the four prompts prefilled at (3, 1, 4), greedy:
    (cfg, target params, Draft, SpecConfig, state, first token per row)."""
    from specjax.speculative import draft as draft_lib, spec_step
    from specjax.speculative.spec_generate import _prefill_prompts
    cfg = models["cfg"]
    tp, heads = models["bigram"]
    d = draft_lib.as_draft(heads[alg], alg, tp)
    scfg = spec_step.SpecConfig(3, 1, 4, sampling=False)
    state = spec_step.init_state(cfg, d, scfg, len(models["prompts"]), 64, page_size=16)
    state, first = _prefill_prompts(tp, cfg, d, scfg, state, models["prompts"], ())
    return cfg, tp, d, scfg, state, first


@pytest.mark.parametrize("alg", ["EAGLE3", "EAGLE"])
def test_target_only_steps_extend_the_draft_cache_as_full_commits_do(models, alg):
    """``target_step`` writes only each new pair's draft K/V (no attention or MLP in the head's last layer) and leaves
    the root stale; ``refresh_root`` then recomputes it. Both equal what a full draft commit of every step gives."""
    import dataclasses
    import jax
    import jax.numpy as jnp
    from specjax.speculative import spec_step, verify
    cfg, tp, d, scfg, state, _ = prefilled_bigram(models, alg)
    refresh = jax.jit(spec_step.refresh_root, static_argnums=(2,))
    state = refresh(tp, d, scfg, state)  # a prefill leaves every root stale
    active = jnp.array([True, True, False, True])

    def full_commit(state):
        tree = spec_step.root_tree(state)
        out = spec_step.verify_phase(tp, cfg, d, scfg, state, tree, active)
        state = dataclasses.replace(state, cache=out.cache)
        acc, sb = verify.accept(tree, out.logits, state.sampling, 0, may_sample=False, active=active)
        return spec_step.commit_phase(tp, d, scfg, state, acc, out, active, sb), acc.tokens

    lean, full = jax.jit(spec_step.target_step, static_argnums=(1, 3)), jax.jit(full_commit)
    a, b = state, jax.tree.map(jnp.copy, state)
    for _ in range(3):
        a, ta, _ = lean(tp, cfg, d, scfg, a, active)
        b, tb = full(b)
        np.testing.assert_array_equal(np.asarray(ta), np.asarray(tb))
    assert np.asarray(a.root_stale).tolist() == [True, True, False, True]
    a = refresh(tp, d, scfg, a)
    assert not np.asarray(a.root_stale).any()
    for x, y in [(a.draft_k, b.draft_k), (a.draft_v, b.draft_v), (a.root_h, b.root_h)]:
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(a.cache.lengths), np.asarray(b.cache.lengths))


@pytest.mark.parametrize("alg", ["EAGLE3", "EAGLE"])
def test_a_prefill_leaves_the_root_that_the_head_over_the_whole_prompt_gives(models, alg):
    """``prefill`` only writes the head's K/V over the prompt and leaves the root stale; refreshed, the root is the
    head's output at the last position of an uncached causal forward over the prompt (features at each position,
    the next token's embedding, the first generated token after the last)."""
    import jax.numpy as jnp
    from specjax import layers
    from specjax.models import target
    from specjax.speculative import draft as draft_lib, spec_step
    cfg, tp, d, scfg, state, first = prefilled_bigram(models, alg)
    prompts = models["prompts"]
    assert np.asarray(state.root_stale).all()
    state = jax.jit(spec_step.refresh_root, static_argnums=(2,))(tp, d, scfg, state)
    for row, p in enumerate(prompts):
        toks = jnp.asarray([p], jnp.int32)
        pos = jnp.arange(len(p), dtype=jnp.int32)[None]
        out = target.forward(tp, cfg, toks, pos, **draft_lib.target_kwargs(d))
        nxt = jnp.asarray([p[1:] + [int(first[row])]], jnp.int32)
        attend = layers.CacheAttend(layers.causal_mask(jnp.ones((1, len(p)), bool)))
        h, _, _ = draft_lib.forward(d, target.embed_tokens(tp, nxt), draft_lib.target_features(d, out), pos, attend)
        np.testing.assert_allclose(np.asarray(state.root_h[row]), np.asarray(h[0, -1]), rtol=1e-5, atol=1e-5)
    assert np.asarray(state.last_token).tolist() == np.asarray(first).tolist()


@pytest.mark.parametrize("tree", [(3, 1, 4), None], ids=["spec_step", "target_step"])
def test_a_step_leaves_inactive_rows_sampling_state_and_counts_the_active_ones(models, tree):
    """The per-row sampling state (token counts for penalties, generated, logprobs, random key) of a row outside
    ``active`` is the same after a speculative or target-only step; an active row's counts grow by what it emitted."""
    import jax
    import jax.numpy as jnp
    from specjax.speculative import draft as draft_lib, spec_step
    from specjax.speculative.spec_generate import _prefill_prompts
    cfg = models["cfg"]
    tp, heads = models["bigram"]
    d = draft_lib.as_draft(heads["EAGLE3"], "EAGLE3", tp)
    scfg = spec_step.SpecConfig(3, 1, 4, sampling=True)
    prompts = models["prompts"]
    state = spec_step.init_state(cfg, d, scfg, len(prompts), 64, page_size=16)
    state, _ = _prefill_prompts(tp, cfg, d, scfg, state, prompts, ())
    active = jnp.array([True, False, True, True])
    step = jax.jit(spec_step.spec_step if tree else spec_step.target_step, static_argnums=(1, 3))
    before = jax.tree.map(np.asarray, state.sampling)
    state, toks, counts = step(tp, cfg, d, scfg, state, active)
    after = jax.tree.map(np.asarray, state.sampling)
    for name, old, new in zip(before.__dataclass_fields__, jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(old[1], new[1], err_msg=name)
    toks, counts = np.asarray(toks), np.asarray(counts)
    assert counts[1] == 0 and (counts[[0, 2, 3]] >= 1).all()
    for r in (0, 2, 3):
        grown = after.counts[r] - before.counts[r]
        assert grown.sum() == counts[r]
        np.testing.assert_array_equal(grown, np.bincount(toks[r, :counts[r]], minlength=cfg.vocab_size))
    assert (after.generated[[0, 2, 3]] - before.generated[[0, 2, 3]] == counts[[0, 2, 3]]).all()
    np.testing.assert_array_equal(after.key, before.key)  # a request's key is fixed; its n-th token draws at n


def test_a_short_call_given_a_capacity_compiles_the_programs_of_the_long_call(models, caplog):
    """``capacity`` sizes the buffers for a longer budget: a 2-token call with the 32-token call's capacity (how
    ``python -m specjax.generate`` warms up before timing) leaves nothing to compile for the long call, in both
    engines, and changes no output."""
    tp, heads = models["bigram"]
    cfg, prompts, new = models["cfg"], models["prompts"], MAX_NEW + 8

    def both(n, **kw):
        return (generate(tp, cfg, prompts, max_new_tokens=n, stop_token_ids=(), **kw),
                speculative_generate(tp, cfg, heads["EAGLE3"], prompts, num_steps=3, topk=1, num_draft_tokens=4,
                                     max_new_tokens=n, stop_token_ids=(), compiler_options=FAST_COMPILE, **kw)[0])

    short = both(2, capacity=new)
    with caplog.at_level("WARNING"), jax.log_compiles(True):
        long = both(new, capacity=new)
    compiles = [r.getMessage() for r in caplog.records if "Finished XLA compilation" in r.getMessage()]
    assert compiles == []
    reference = generate(tp, cfg, prompts, max_new_tokens=new, stop_token_ids=())
    assert long == (reference, reference)
    assert short == ([r[:2] for r in reference],) * 2
    for fn in (generate, lambda *a, **kw: speculative_generate(tp, cfg, heads["EAGLE3"], prompts, **kw)):
        with pytest.raises(ValueError, match=r"capacity must be an int >= the largest max_new_tokens \(5\), got 4"):
            fn(tp, cfg, prompts, max_new_tokens=5, capacity=4)


@pytest.mark.parametrize("commit", [False, True], ids=["as-built", "committed"])
def test_prompt_chunks_share_one_compiled_prefill(commit, caplog):
    """A prompt of two 512-token chunks runs both chunks through one compiled prefill program, in ``generate`` and
    in ``speculative_generate``, with bf16 params (whose decode layout adds a device array of embedding bits) as
    built and committed to a device: the cache threaded from chunk to chunk starts out as committed as the chunks'
    outputs. (A committed cache after an uncommitted one compiled the 512-token program twice: 2 x 6 s for
    SmolLM2's plain prefill, 2 x 9.5 s for the speculative one.) Both give the same first token."""
    cfg = tiny_config(dtype="bfloat16")
    tp, (e3cfg, e3params, vmap), _ = random_models(cfg, seed=3, draft_vocab=48)
    if commit:
        tp, e3params = jax.device_put((tp, e3params), jax.devices()[0])
    e3 = (e3cfg, e3params, vmap)
    prompt = np.random.default_rng(5).integers(0, cfg.vocab_size, size=600).tolist()
    with caplog.at_level("WARNING"), jax.log_compiles(True):
        first = generate(tp, cfg, [prompt], max_new_tokens=1, stop_token_ids=())
        spec_first, _ = speculative_generate(tp, cfg, e3, [prompt], num_steps=3, topk=1, num_draft_tokens=4,
                                             max_new_tokens=1, stop_token_ids=(), compiler_options=FAST_COMPILE)
    compiles = [r.getMessage().split(" in ")[0] for r in caplog.records if "Finished XLA compilation" in r.getMessage()]
    assert compiles.count("Finished XLA compilation of jit(_prefill_chunk)") == 1, compiles
    assert compiles.count("Finished XLA compilation of jit(prefill)") == 1, compiles
    assert spec_first == first
