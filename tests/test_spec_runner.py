"""SpecRunner (the server's slot runner): requests join free slots between steps, pages come from a shuffled free
list (not contiguous), prompts longer than the prefill chunk are chunked, a prefix is reused from another slot's
pages (``cached``), and every request's greedy output equals plain greedy decoding. Also: the Pallas tree-attention
hook in the speculative step."""

import numpy as np
import pytest
from spec_models import bigram_models, tiny_config

from specjax.generate import generate
from specjax.serve.runners.plain import PlainRunner
from specjax.serve.runners.spec import SpecRunner
from specjax.speculative.tune import TreeChoice

PAGE, PPS, PAGES = 8, 8, 40
MAX_NEW = 16


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config()
    tp, _, e3, _ = bigram_models(cfg, seed=3)
    runner = SpecRunner(cfg, tp, "EAGLE3", *e3, num_steps=3, topk=2, num_draft_tokens=5, max_batch=3,
                        pages_per_seq=PPS, page_size=PAGE, num_pages=PAGES, attention_impl="xla", prefill_chunk=16)
    return cfg, tp, runner


def test_slots_join_between_steps_and_match_plain(setup):
    cfg, tp, runner = setup
    rng = np.random.default_rng(0)
    a = rng.integers(0, 64, 20).tolist()
    b = rng.integers(0, 64, 5).tolist()
    c = a[:16] + rng.integers(0, 64, 21).tolist()  # shares A's first two pages
    free = list(rng.permutation(PAGES))
    pages = {s: [int(free.pop()) for _ in range(PPS)] for s in ("a", "b")}
    pages["c"] = pages["a"][:2] + [int(free.pop()) for _ in range(PPS - 2)]
    assert runner.tokens_per_step == 4

    state = runner.init_state()
    out = {k: [] for k in "abc"}
    slot = {"a": 0, "b": 2, "c": 1}
    steps = {k: 0 for k in "abc"}
    greedy = {"temperature": 0.0}

    def step(active_names):
        nonlocal state
        active = np.zeros(3, bool)
        for n in active_names:
            active[slot[n]] = True
        state, toks, counts = runner.step(state, active)
        for n in active_names:
            out[n] += toks[slot[n], :counts[slot[n]]].tolist()
            steps[n] += 1
        for i in range(3):
            if not active[i]:
                assert counts[i] == 0

    state, first = runner.prefill(state, slot["a"], np.asarray(a), np.asarray(pages["a"]), greedy)
    out["a"].append(first)
    step("a")
    step("a")
    state, first = runner.prefill(state, slot["b"], np.asarray(b), np.asarray(pages["b"]), greedy)
    out["b"].append(first)
    step("ab")
    state, first = runner.prefill(state, slot["c"], np.asarray(c), np.asarray(pages["c"]), greedy, cached=16)
    out["c"].append(first)
    while min(len(out[n]) for n in "abc") < MAX_NEW:
        step([n for n in "abc" if len(out[n]) < MAX_NEW])
    state = runner.release(state, slot["b"])

    ref = generate(tp, cfg, [a, b, c], max_new_tokens=MAX_NEW, stop_token_ids=())
    for n, r in zip("abc", ref):
        assert out[n][:MAX_NEW] == r, n
    assert sum(len(out[n]) - 1 for n in "abc") > 1.3 * sum(steps.values())  # several tokens per step


def test_steps_in_flight_match_plain_and_a_released_slot_gets_nothing(setup):
    """The overlap schedule's pattern: each step launched before the previous one is collected; a slot released while
    its step is in flight gets nothing from that step, and the next request in that slot starts clean. Every output
    equals plain greedy."""
    cfg, tp, runner = setup
    rng = np.random.default_rng(7)
    a, b, c = (rng.integers(0, 64, n).tolist() for n in (13, 7, 10))
    greedy = {"temperature": 0.0}
    state = runner.init_state()
    state, fa = runner.prefill(state, 0, np.asarray(a), np.arange(PPS), greedy)
    state, fb = runner.prefill(state, 1, np.asarray(b), np.arange(PPS, 2 * PPS), greedy)
    out = [[fa], [fb], []]
    both = np.array([True, True, False])
    state, pending = runner.launch(state, both)
    while min(len(out[0]), len(out[1])) < MAX_NEW:
        state, launched = runner.launch(state, both)  # step N+1 on its way before step N is read
        toks, counts = runner.collect(pending)
        for r in (0, 1):
            out[r] += toks[r, :counts[r]].tolist()
        pending = launched
    state = runner.release(state, 1)  # slot 1 leaves with a step in flight
    toks, counts = runner.collect(pending, keep=np.array([True, False, False]))
    assert counts[1] == 0 and counts[0] > 0
    state, fc = runner.prefill(state, 1, np.asarray(c), np.arange(2 * PPS, 3 * PPS), greedy)
    out[2].append(fc)
    while len(out[2]) < MAX_NEW:
        state, toks, counts = runner.step(state, np.array([False, True, False]))
        out[2] += toks[1, :counts[1]].tolist()
    ref = generate(tp, cfg, [a, b, c], max_new_tokens=MAX_NEW, stop_token_ids=())
    assert [o[:MAX_NEW] for o in out] == ref


def test_pallas_tree_attention_hook_is_exact(setup):
    """attention_impl='pallas' routes the verify forward (tree mask) and the draft extends through the tree-attention
    kernel (interpreted on CPU); output still equals plain greedy."""
    from specjax.speculative.spec_generate import speculative_generate
    cfg, tp, runner = setup
    _, _, e3, _ = bigram_models(cfg, seed=3)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]]
    ref = generate(tp, cfg, prompts, max_new_tokens=12, stop_token_ids=())
    out, stats = speculative_generate(tp, cfg, e3, prompts, algorithm="EAGLE3", num_steps=3, topk=2,
                                      num_draft_tokens=5, max_new_tokens=12, stop_token_ids=(),
                                      attention_impl="pallas",
                                      compiler_options={"xla_backend_optimization_level": 0})
    assert out == ref
    assert stats["tau"] > 1.0


def test_runner_on_a_tp_dp_mesh_matches_one_device(setup):
    """--tp-size 2 --dp-size 2 with EAGLE3: target sharded over tp, KV pools over kv heads, same greedy tokens."""
    from specjax.sharding import make_mesh
    from specjax.weights import shard_params
    cfg, tp, _ = setup
    _, _, e3, _ = bigram_models(cfg, seed=3)
    mesh = make_mesh(2, 2, devices=__import__("jax").devices()[:4])
    runner = SpecRunner(cfg, shard_params(tp, cfg, mesh), "EAGLE3", *e3, num_steps=3, topk=2, num_draft_tokens=5,
                        max_batch=2, pages_per_seq=PPS, page_size=PAGE, num_pages=PAGES, attention_impl="xla",
                        prefill_chunk=16, mesh=mesh)
    prompt = np.random.default_rng(1).integers(0, 64, 11).tolist()
    state = runner.init_state()
    assert state.cache.k.sharding.mesh.shape == {"dp": 2, "tp": 2}
    state, first = runner.prefill(state, 1, np.asarray(prompt), np.arange(PPS), {"temperature": 0.0})
    out = [first]
    while len(out) < MAX_NEW:
        state, toks, counts = runner.step(state, np.array([False, True]))
        out += toks[1, :counts[1]].tolist()
    assert out[:MAX_NEW] == generate(tp, cfg, [prompt], max_new_tokens=MAX_NEW, stop_token_ids=())[0]


def test_tree_shape_follows_the_running_batch(setup):
    """batch_shapes (bench tune's table), by the step's batch bucket (here the number of running slots, packed at
    the front): 1 -> (3,2,5), 2 -> a (2,1,3) chain, 3 -> target-only steps (one token each, the draft kept in
    step); the draft drafts again once the batch shrinks, and every request's output is still plain greedy."""
    cfg, tp, _ = setup
    _, _, e3, _ = bigram_models(cfg, seed=3)
    runner = SpecRunner(cfg, tp, "EAGLE3", *e3, num_steps=3, topk=2, num_draft_tokens=5, max_batch=3,
                        pages_per_seq=PPS, page_size=PAGE, num_pages=PAGES, attention_impl="xla", prefill_chunk=16,
                        batch_shapes={1: (3, 2, 5), 2: (2, 1, 3), 3: None})
    assert runner.tokens_per_step == 4
    assert [runner.shape_for(n) and runner.shape_for(n).num_draft_tokens for n in (1, 2, 3, 9)] == [5, 3, None, None]
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 64, n).tolist() for n in (9, 14, 6)]
    state = runner.init_state()
    out, per_step = [[], [], []], {1: [], 2: [], 3: []}

    def step(rows):
        nonlocal state
        active = np.isin(np.arange(3), rows)
        state, toks, counts = runner.step(state, active)
        for r in rows:
            out[r] += toks[r, :counts[r]].tolist()
        per_step[len(rows)].append(int(counts[rows].max()))

    for r, p in enumerate(prompts):
        state, first = runner.prefill(state, r, np.asarray(p), np.arange(r * PPS, (r + 1) * PPS), {"temperature": 0})
        out[r].append(first)
        for _ in range(3):
            step(list(range(r + 1)))
    state = runner.release(state, 2)
    for _ in range(6):
        step([0, 1])
    ref = generate(tp, cfg, prompts, max_new_tokens=40, stop_token_ids=())
    for r in range(3):
        assert out[r] == ref[r][:len(out[r])], r
    assert per_step[3] == [1, 1, 1]  # target-only steps emit one token per row
    assert max(per_step[2][3:]) > 1  # after them the chain drafts again from a draft cache kept in step


def test_plain_warmup_compiles_each_bucket_and_leaves_the_slots_empty(setup):
    """PlainRunner.warmup (the runners' shared prefill warmup, then each batch bucket's step): no slot stays in use,
    and a request served after it is plain greedy."""
    cfg, tp, _ = setup
    runner = PlainRunner(cfg, tp, max_batch=3, pages_per_seq=PPS, page_size=PAGE, num_pages=PAGES,
                         attention_impl="xla")
    lines = []
    state = runner.warmup(runner.init_state(), log_fn=lines.append)
    assert f"compiled {len(runner.prefill_buckets)} prefill and {len(runner.batch_buckets)} decode shapes" in lines[0]
    assert np.asarray(state.cache.lengths).tolist() == [0, 0, 0] and not runner._lengths.any()
    prompt = [5, 9, 2, 7]
    state, first = runner.prefill(state, 2, np.asarray(prompt), np.arange(PPS, 2 * PPS), {"temperature": 0.0})
    out = [first]
    while len(out) < 8:
        state, toks, counts = runner.step(state, np.array([False, False, True]))
        out += toks[2, :counts[2]].tolist()
    assert out[:8] == generate(tp, cfg, [prompt], max_new_tokens=8, stop_token_ids=())[0]

def test_warmup_compiles_each_bucket_in_each_of_its_shapes(setup):
    """warmup: every prefill bucket, and each batch bucket's step in its tree shape (nb=1: (3,2,5); nb=2: (2,1,3);
    nb=3: target-only), leaving no slot in use."""
    cfg, tp, _ = setup
    _, _, e3, _ = bigram_models(cfg, seed=3)
    runner = SpecRunner(cfg, tp, "EAGLE3", *e3, num_steps=3, topk=2, num_draft_tokens=5, max_batch=3,
                        pages_per_seq=PPS, page_size=PAGE, num_pages=PAGES, attention_impl="xla", prefill_chunk=16,
                        batch_shapes={1: (3, 2, 5), 2: (2, 1, 3), 3: None})
    lines = []
    state = runner.warmup(runner.init_state(), log_fn=lines.append)
    assert f"compiled {len(runner.prefill_buckets)} prefill and 3 step shapes" in lines[0]
    assert np.asarray(state.cache.lengths).tolist() == [0, 0, 0] and not runner._lengths.any()
    prompt = [5, 9, 2, 7]
    state, first = runner.prefill(state, 1, np.asarray(prompt), np.arange(PPS, 2 * PPS), {"temperature": 0.0})
    out = [first]
    while len(out) < 8:
        state, toks, counts = runner.step(state, np.array([False, True, False]))
        out += toks[1, :counts[1]].tolist()
    assert out[:8] == generate(tp, cfg, [prompt], max_new_tokens=8, stop_token_ids=())[0]


def test_live_tree_choice_turns_a_losing_tree_off_and_keeps_probing(setup):
    """A TreeChoice whose tuned (3,2,5) tree would need 20 tokens per step to pay: the runner runs target-only
    steps (one token per row) except every 3rd step, a probe with the tree whose tokens feed the live accept length;
    warmup compiles both for each bucket; the output is plain greedy throughout."""
    cfg, tp, _ = setup
    _, _, e3, _ = bigram_models(cfg, seed=3)
    trees = TreeChoice.measured({1: ((3, 2, 5), 2.0, 0.1)}, probe_every=3, max_probe_every=3, prior=1.0)
    runner = SpecRunner(cfg, tp, "EAGLE3", *e3, num_steps=3, topk=2, num_draft_tokens=5, max_batch=2,
                        pages_per_seq=PPS, page_size=PAGE, num_pages=PAGES, attention_impl="xla", prefill_chunk=16,
                        batch_shapes=trees)
    lines = []
    state = runner.warmup(runner.init_state(), log_fn=lines.append)
    # buckets 1, 2 x (tree, target-only)
    assert f"compiled {len(runner.prefill_buckets)} prefill and 4 step shapes" in lines[0]
    prompt = np.random.default_rng(5).integers(0, 64, 9).tolist()
    state, first = runner.prefill(state, 0, np.asarray(prompt), np.arange(PPS), {"temperature": 0.0})
    out, counts_seen = [first], []
    for _ in range(12):
        state, toks, counts = runner.step(state, np.array([True, False]))
        out += toks[0, :counts[0]].tolist()
        counts_seen.append(int(counts[0]))
    assert out == generate(tp, cfg, [prompt], max_new_tokens=len(out), stop_token_ids=())[0]
    assert [c for i, c in enumerate(counts_seen) if i % 3 != 2] == [1] * 8  # target-only steps
    probes = [c for i, c in enumerate(counts_seen) if i % 3 == 2]
    assert max(probes) > 1  # the probes draft with the tree (and this head is accepted there)
    live = trees._live[(3, 2, 5)]
    assert live[0] / live[1] > 1.0 and live[1] > 4  # the 4 probes' tokens were recorded


def test_target_only_steps_with_penalties_equal_plain_runner_steps(setup):
    """Greedy rows with repetition, frequency and presence penalties: a SpecRunner that runs only target-only steps
    (``batch_shapes={1: None}``, the root-only tree's logits penalised as a plain step's) emits the PlainRunner's
    tokens, the penalties counting the same tokens."""
    cfg, tp, _ = setup
    _, _, e3, _ = bigram_models(cfg, seed=3)
    kw = dict(max_batch=2, pages_per_seq=PPS, page_size=PAGE, num_pages=PAGES)
    spec = SpecRunner(cfg, tp, "EAGLE3", *e3, num_steps=3, topk=2, num_draft_tokens=5, batch_shapes={1: None},
                      attention_impl="xla", prefill_chunk=16, **kw)
    plain = PlainRunner(cfg, tp, **kw)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 64, n).tolist() for n in (11, 6)]
    params = [{"temperature": 0.0, "repetition_penalty": 2.0, "frequency_penalty": 3.0},
              {"temperature": 0.0, "repetition_penalty": 3.0, "presence_penalty": 5.0}]
    outs = []
    for runner, rows in ((spec, params), (plain, params), (plain, [{"temperature": 0.0}] * 2)):
        state, out = runner.init_state(), [[], []]
        for r, p in enumerate(prompts):
            state, first = runner.prefill(state, r, np.asarray(p), np.arange(r * PPS, (r + 1) * PPS), rows[r])
            out[r].append(first)
        for _ in range(MAX_NEW):
            state, toks, counts = runner.step(state, np.ones(2, bool))
            assert (counts == 1).all()
            for r in range(2):
                out[r] += toks[r, :1].tolist()
        outs.append(out)
    assert outs[0] == outs[1]
    assert all(a != b for a, b in zip(outs[1], outs[2]))  # the penalties change both rows' greedy output


def test_bf16_matrix_head_prefills_widened_and_decodes_plain_greedy(setup):
    """A head whose matrices are stored in bf16 under an fp32 target (as the shipped head loads): the runner's steps
    read the bf16 matrices, its prefill the same matrices widened once (``draft.for_prefill``), and every request's
    greedy output is still plain greedy decoding's (prompt chunked across prefill calls included)."""
    import jax
    import jax.numpy as jnp
    cfg, tp, _ = setup
    _, _, (dcfg, dparams, vmap), _ = bigram_models(cfg, seed=3)
    narrow = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.ndim >= 2 else a, dparams)
    runner = SpecRunner(cfg, tp, "EAGLE3", dcfg, narrow, vmap, num_steps=3, topk=2, num_draft_tokens=5, max_batch=2,
                        pages_per_seq=PPS, page_size=PAGE, num_pages=PAGES, attention_impl="xla", prefill_chunk=16)
    assert runner.draft.params.layers[0].wk.dtype == jnp.bfloat16
    assert runner.prefill_draft.params.layers[0].wk.dtype == jnp.float32
    assert runner.prefill_draft.params.layers[0].w_up is runner.draft.params.layers[0].w_up  # a prefill reads K/V only
    assert runner.prefill_draft.params.lm_head is runner.draft.params.lm_head
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 64, n).tolist() for n in (21, 7)]  # 21 tokens: two prefill chunks of at most 16
    state, out = runner.init_state(), [[], []]
    for r, p in enumerate(prompts):
        state, first = runner.prefill(state, r, np.asarray(p), np.arange(r * PPS, (r + 1) * PPS), {"temperature": 0.0})
        out[r].append(first)
    while min(len(o) for o in out) < MAX_NEW:
        state, toks, counts = runner.step(state, np.ones(2, bool))
        for r in range(2):
            out[r] += toks[r, :counts[r]].tolist()
    ref = generate(tp, cfg, prompts, max_new_tokens=MAX_NEW, stop_token_ids=())
    assert [o[:MAX_NEW] for o in out] == ref


def test_weights_released_and_resumed_as_they_were(setup):
    """release_memory_occupation's weights: every device array of the target, the head and its prefill form
    freed, then back with the same values and shardings, arrays the two forms share shared again."""
    import jax
    cfg, _, _ = setup
    tp, _, e3, _ = bigram_models(cfg, seed=3)
    runner = SpecRunner(cfg, tp, "EAGLE3", *e3, num_steps=3, topk=2, num_draft_tokens=5, max_batch=3,
                        pages_per_seq=PPS, page_size=PAGE, num_pages=PAGES, attention_impl="xla", prefill_chunk=16)

    def arrays():
        return [x for f in SpecRunner.WEIGHT_FIELDS for x in jax.tree.leaves(vars(runner).get(f))
                if isinstance(x, jax.Array)]
    old = arrays()
    values = [np.asarray(x).copy() for x in old]
    committed = [x.committed for x in old]
    firsts = [next(j for j, y in enumerate(old) if y is x) for x in old]  # where each array appears first
    assert len(set(firsts)) < len(old)  # the head's prefill form shares arrays with the head
    runner.release_weights()
    assert all(x.is_deleted() for x in old)
    runner.resume_weights()
    new = arrays()
    assert all(np.array_equal(np.asarray(x), v) for x, v in zip(new, values))
    assert [next(j for j, y in enumerate(new) if y is x) for x in new] == firsts
    assert [x.sharding for x in new] == [x.sharding for x in old]
    assert [x.committed for x in new] == committed  # else every program would compile again
