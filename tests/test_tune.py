"""The tuned tree shape per batch size: ``python -m specjax.bench tune`` measures and writes
``speculative_tune.json`` next to a head; the server's arguments and ``python -m specjax.generate`` read it when no
tree flag is given; explicit flags win; a damaged file is a clear error."""

import json
import logging
import os
import types

import pytest
from hf_tiny_models import build
from spec_models import random_models

from specjax.serve import launch
from specjax.speculative import tune as tune_lib


def test_shape_for_picks_the_largest_tuned_size_not_above():
    table = {1: (7, 1, 8), 4: (5, 1, 6), 16: None}
    assert tune_lib.shape_for(table, 1) == (7, 1, 8)
    assert tune_lib.shape_for(table, 3) == (7, 1, 8)
    assert tune_lib.shape_for(table, 4) == (5, 1, 6)
    assert tune_lib.shape_for(table, 64) is None
    assert tune_lib.shape_for({2: (3, 1, 4)}, 1) == (3, 1, 4)


def test_load_tune_roundtrip_and_errors(tmp_path):
    assert tune_lib.load_tune(str(tmp_path)) is None  # no file: nothing tuned
    tune_lib.save_tune(str(tmp_path / tune_lib.FILENAME),
                       {"format": 1, "batch_sizes": {"1": {"num_steps": 7, "eagle_topk": 1, "num_draft_tokens": 8},
                                                     "8": None}})
    assert tune_lib.load_tune(str(tmp_path)) == {1: (7, 1, 8), 8: None}
    (tmp_path / tune_lib.FILENAME).write_text('{"format": 1, "batch_sizes": {"1": {"num_steps": 7}}}')
    with pytest.raises(tune_lib.TuneError, match="not a valid speculative_tune.json"):
        tune_lib.load_tune(str(tmp_path))
    (tmp_path / tune_lib.FILENAME).write_text('{"format": 2, "batch_sizes": {}}')
    with pytest.raises(tune_lib.TuneError, match="format 2"):
        tune_lib.load_tune(str(tmp_path))



def test_table_per_dtype(tmp_path):
    """A head folder may hold a table tuned in bf16 beside the generic one: a bf16 run reads its own, fp32 and
    'auto' runs the generic one, and a dtype without its own table falls back to the generic one."""
    shape = lambda s: {"format": 1, "batch_sizes": {"1": None if s is None else dict(
        zip(tune_lib.SHAPE_KEYS, s))}}
    assert tune_lib.filename("bfloat16") == "speculative_tune.bfloat16.json"
    assert tune_lib.filename("auto") == tune_lib.filename("float32") == tune_lib.filename(None) == tune_lib.FILENAME
    tune_lib.save_tune(str(tmp_path / tune_lib.FILENAME), shape(None))
    assert tune_lib.load_tune(str(tmp_path), dtype="bfloat16") == {1: None}  # no bf16 table yet: the generic one
    tune_lib.save_tune(str(tmp_path / tune_lib.filename("bfloat16")), shape((2, 1, 3)))
    assert tune_lib.load_tune(str(tmp_path), dtype="bfloat16") == {1: (2, 1, 3)}
    for dtype in (None, "auto", "float32", "float16"):
        assert tune_lib.load_tune(str(tmp_path), dtype=dtype) == {1: None}

def _measured_table():
    rows = [{"batch_size": 1, "shape": None, "tok_s": 50.0, "speedup": 1.0, "tau": 1.0},
            {"batch_size": 1, "shape": [1, 2, 3], "tok_s": 60.0, "speedup": 1.2, "tau": 1.5},
            {"batch_size": 1, "shape": [3, 1, 4], "tok_s": 55.0, "speedup": 1.1, "tau": 1.6},
            {"batch_size": 16, "shape": None, "tok_s": 100.0, "speedup": 1.0, "tau": 1.0},
            {"batch_size": 16, "shape": [1, 2, 3], "tok_s": 90.0, "speedup": 0.9, "tau": 1.5}]
    shape = {"num_steps": 1, "eagle_topk": 2, "num_draft_tokens": 3}
    return {"format": 1, "batch_sizes": {"1": shape, "16": None}, "best_speculative": {"1": shape, "16": shape},
            "rows": rows}


def test_load_tune_costs_reads_the_best_trees_measured_rows(tmp_path):
    assert tune_lib.load_tune_costs(str(tmp_path)) is None
    tune_lib.save_tune(str(tmp_path / tune_lib.FILENAME), _measured_table())
    assert tune_lib.load_tune_costs(str(tmp_path)) == {1: ((1, 2, 3), 1.5, 1.2), 16: ((1, 2, 3), 1.5, 0.9)}
    bad = _measured_table()
    bad["rows"] = bad["rows"][:2]  # no row measured the batch-16 tree
    tune_lib.save_tune(str(tmp_path / tune_lib.FILENAME), bad)
    with pytest.raises(tune_lib.TuneError, match="not a valid"):
        tune_lib.load_tune_costs(str(tmp_path))


def test_a_table_tuned_on_another_machine_is_named(tmp_path, monkeypatch, caplog):
    """The server says when the head's tree table was measured on another kind of machine (its step costs chose
    the tree per batch size), and how to measure this one's; not when it was measured here."""
    intel = "2-core CPU (Intel(R) Xeon(R) Processor, x86_64), no accelerator, JAX 0.10.2 CPU"
    assert tune_lib.same_machine(intel, "Intel(R) Xeon(R) Processor", "AVX-512", None)
    assert not tune_lib.same_machine(intel, "AMD EPYC", "AVX-512", None)
    assert not tune_lib.same_machine(intel, "Intel(R) Xeon(R) Processor", "AVX-512", "NVIDIA H200")
    assert tune_lib.same_machine("16-core CPU (AMD EPYC 9654, x86_64), 1 x NVIDIA H200, JAX 0.10.2 GPU", "x", None,
                                 "NVIDIA H200")
    # one model name, two kinds of CPU (a Zen 1 "AMD EPYC" with AVX2, a Zen 4 one with AVX-512); a description from
    # before the vector extension was recorded matches on the model alone
    zen1 = "2-core CPU (AMD EPYC, x86_64, AVX2), no accelerator, JAX 0.10.2 CPU"
    assert tune_lib.same_machine(zen1, "AMD EPYC", "AVX2", None)
    assert not tune_lib.same_machine(zen1, "AMD EPYC", "AVX-512", None)
    assert not tune_lib.same_machine(zen1, "AMD EPYC", None, None)
    assert tune_lib.tuned_elsewhere(str(tmp_path)) is None
    tune_lib.save_tune(str(tmp_path / tune_lib.FILENAME), {"format": 1, "machine": intel, "batch_sizes": {"1": None}})
    with caplog.at_level(logging.WARNING, logger="specjax.serve"):
        monkeypatch.setattr(tune_lib, "cpu_model", lambda: "Intel(R) Xeon(R) Processor")
        assert tune_lib.tuned_elsewhere(str(tmp_path)) is None
        launch.warn_if_tuned_elsewhere(str(tmp_path), None)
        assert not caplog.records
        monkeypatch.setattr(tune_lib, "cpu_model", lambda: "AMD EPYC")
        assert tune_lib.tuned_elsewhere(str(tmp_path)) == (str(tmp_path / tune_lib.FILENAME), intel)
        launch.warn_if_tuned_elsewhere(str(tmp_path), None)
    assert "measured on 2-core CPU (Intel(R) Xeon(R) Processor" in caplog.text and "bench tune --draft" in caplog.text


def test_a_table_tuned_elsewhere_runs_its_smallest_paying_tree(tmp_path, monkeypatch):
    """On another kind of machine than the table's, a batch size where the table chose a tree runs the smallest
    tree (fewest draft tokens, then steps) that was faster than plain there; where it chose plain, plain; the best
    speculative shape is the smallest paying one, else the smallest measured. On the table's machine: as written."""
    intel = "2-core CPU (Intel(R) Xeon(R) Processor, x86_64), no accelerator, JAX 0.10.2 CPU"
    tree = lambda s: dict(zip(tune_lib.SHAPE_KEYS, s))
    row = lambda b, s, speedup: {"batch_size": b, "shape": s, "tok_s": 1.0, "speedup": speedup, "tau": 2.0}
    table = {"format": 1, "machine": intel,
             "batch_sizes": {"1": tree((5, 4, 8)), "4": None},
             "best_speculative": {"1": tree((5, 4, 8)), "4": tree((2, 2, 4))},
             "rows": [row(1, None, 1.0), row(1, [5, 4, 8], 1.8), row(1, [3, 1, 4], 1.6), row(1, [1, 2, 3], 1.5),
                      row(1, [2, 1, 3], 1.4), row(1, [1, 1, 2], 0.9), row(4, None, 1.0), row(4, [2, 2, 4], 0.95),
                      row(4, [1, 2, 3], 0.97)]}
    tune_lib.save_tune(str(tmp_path / tune_lib.FILENAME), table)
    monkeypatch.setattr(tune_lib, "cpu_model", lambda: "Intel(R) Xeon(R) Processor")
    assert tune_lib.load_tune(str(tmp_path)) == {1: (5, 4, 8), 4: None}
    assert tune_lib.load_tune(str(tmp_path), "best_speculative") == {1: (5, 4, 8), 4: (2, 2, 4)}
    monkeypatch.setattr(tune_lib, "cpu_model", lambda: "AMD EPYC")
    assert tune_lib.load_tune(str(tmp_path)) == {1: (1, 2, 3), 4: None}  # (1,1,2) lost, (2,1,3) has more steps
    assert tune_lib.load_tune(str(tmp_path), "best_speculative") == {1: (1, 2, 3), 4: (1, 2, 3)}
    assert tune_lib.load_tune_costs(str(tmp_path))[1] == ((1, 2, 3), 2.0, 1.5)


def test_tree_choice_follows_the_live_accept_length():
    """Batch 1: the (1,2,3) tree costs 1.5 / 1.2 = 1.25 plain steps; batch 16: 1.5 / 0.9 = 1.67. It starts as
    tuned (tree at 1, target-only at 16), turns the tree off at 1 when the live accept length falls below 1.25,
    keeps probing it (every probe_every-th step, then at doubling intervals up to max_probe_every while it still
    does not pay), and turns it on again (at 16 too) once acceptance climbs."""
    logs = []
    tc = tune_lib.TreeChoice.measured({1: ((1, 2, 3), 1.5, 1.2), 16: ((1, 2, 3), 1.5, 0.9)},
                                      horizon=64, prior=8, probe_every=4, max_probe_every=8,
                                      probe_budget=0, log=logs.append)
    assert tc.shapes() == [(1, 2, 3)] and tc.options(1) == [(1, 2, 3), None]
    assert tc.choose(1) == (1, 2, 3) and tc.choose(4) == (1, 2, 3)
    assert [tc.choose(16) for _ in range(4)] == [None, None, None, (1, 2, 3)]  # the 4th is a probe
    for _ in range(40):  # the head is rejected on this traffic: one token per step
        tc.record((1, 2, 3), tokens=4, rows=4)
    assert tc.accept_length((1, 2, 3)) < 1.05
    probe = [(1, 2, 3)]
    assert [tc.choose(1) for _ in range(20)] == [None] * 3 + probe + ([None] * 7 + probe) * 2
    assert any("speculation off at batch size >= 1" in m for m in logs)
    for _ in range(40):  # now accepted for 2 tokens per step
        tc.record((1, 2, 3), tokens=8, rows=4)
    assert tc.accept_length((1, 2, 3)) > 1.9
    assert tc.choose(1) == (1, 2, 3) and tc.choose(16) == (1, 2, 3)
    assert any("speculation on at batch size >= 16" in m for m in logs)
    tc.record(None, tokens=4, rows=4)  # target-only steps say nothing about acceptance
    # probes take at most probe_budget of the time: the (1,2,3) tree at 16 costs 0.67 plain steps more than a
    # target-only step, so at a 5% budget the first probe comes after 14 target-only steps, not 4
    budgeted = tune_lib.TreeChoice.measured({16: ((1, 2, 3), 1.5, 0.9)}, probe_every=4, probe_budget=0.05)
    assert [budgeted.choose(16) for _ in range(14)] == [None] * 13 + [(1, 2, 3)]
    fixed = tune_lib.TreeChoice.fixed({1: (3, 1, 4), 8: None})
    assert [fixed.choose(n) for n in (1, 8, 8, 8, 8)] == [(3, 1, 4), None, None, None, None]  # never probes
    assert fixed.options(8) == [None] and fixed.options(2) == [(3, 1, 4)]


def test_server_args_use_the_tuned_shape_unless_flags_are_given(tmp_path):
    from specjax.serve.args import ServerArgs
    tune_lib.save_tune(str(tmp_path / tune_lib.FILENAME),
                       {"format": 1, "batch_sizes": {"1": {"num_steps": 7, "eagle_topk": 1, "num_draft_tokens": 8}}})
    a = ServerArgs(model_path="m", speculative_algorithm="eagle3", speculative_draft_model_path=str(tmp_path))
    assert (a.speculative_num_steps, a.speculative_eagle_topk, a.speculative_num_draft_tokens) == (7, 1, 8)
    b = ServerArgs(model_path="m", speculative_algorithm="EAGLE3", speculative_draft_model_path=str(tmp_path),
                   speculative_num_steps=3)
    assert (b.speculative_num_steps, b.speculative_eagle_topk, b.speculative_num_draft_tokens) == (3, 4, 8)
    c = ServerArgs(model_path="m", speculative_algorithm="EAGLE3", speculative_draft_model_path=str(tmp_path / "x"))
    assert (c.speculative_num_steps, c.speculative_eagle_topk) == (5, 4)  # SGLang's defaults without a tune file
    assert a.speculation_off_reason is None and c.speculation_off_reason is None
    # plain measured faster at every batch size: speculation is switched off (the shape kept is the fastest tree)
    tune_lib.save_tune(str(tmp_path / tune_lib.FILENAME),
                       {"format": 1, "batch_sizes": {"1": None, "4": None},
                        "best_speculative": {"1": {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4},
                                             "4": {"num_steps": 2, "eagle_topk": 1, "num_draft_tokens": 3}}})
    d = ServerArgs(model_path="m", speculative_algorithm="EAGLE3", speculative_draft_model_path=str(tmp_path))
    assert "plain decoding faster" in d.speculation_off_reason
    assert (d.speculative_num_steps, d.speculative_eagle_topk, d.speculative_num_draft_tokens) == (3, 1, 4)
    e = ServerArgs(model_path="m", speculative_algorithm="EAGLE3", speculative_draft_model_path=str(tmp_path),
                   speculative_num_steps=2, speculative_eagle_topk=1, speculative_num_draft_tokens=3)
    assert e.speculation_off_reason is None  # explicit tree flags: speculate as asked
    assert a.speculative_batch_shapes is None and e.speculative_batch_shapes is None  # one batch size / flags given
    # a tree at batch 1, plain from batch 4 on: the shape follows the running batch (plain steps at 4+)
    tune_lib.save_tune(str(tmp_path / tune_lib.FILENAME),
                       {"format": 1, "batch_sizes": {"1": {"num_steps": 5, "eagle_topk": 4, "num_draft_tokens": 8},
                                                     "2": {"num_steps": 7, "eagle_topk": 1, "num_draft_tokens": 8},
                                                     "4": None}})
    f = ServerArgs(model_path="m", speculative_algorithm="EAGLE3", speculative_draft_model_path=str(tmp_path))
    assert f.speculation_off_reason is None and (f.speculative_num_steps, f.speculative_eagle_topk) == (5, 4)
    assert f.speculative_batch_shapes == {1: (5, 4, 8), 2: (7, 1, 8), 4: None}
    assert f.speculative_tokens_per_step == 8  # the page reserve covers the deepest tree
    g = ServerArgs(model_path="m", speculative_algorithm="EAGLE3", speculative_draft_model_path=str(tmp_path),
                   disable_adaptive_speculation=True)
    assert g.speculative_batch_shapes is None and g.speculative_tokens_per_step == 6
    assert f.speculative_tree_costs is None  # no measured rows in this file: the table stays fixed
    # bench tune's file (rows measured): the runner gets the measured costs and re-decides them live
    tune_lib.save_tune(str(tmp_path / tune_lib.FILENAME), _measured_table())
    h = ServerArgs(model_path="m", speculative_algorithm="EAGLE3", speculative_draft_model_path=str(tmp_path))
    assert h.speculative_tree_costs == {1: ((1, 2, 3), 1.5, 1.2), 16: ((1, 2, 3), 1.5, 0.9)}
    assert h.speculative_batch_shapes == {1: (1, 2, 3), 16: None} and h.speculative_tokens_per_step == 2
    k = ServerArgs(model_path="m", speculative_algorithm="EAGLE3", speculative_draft_model_path=str(tmp_path),
                   disable_adaptive_speculation=True)
    assert k.speculative_tree_costs is None and k.speculative_batch_shapes is None
    # plain measured faster at every size on the tuning prompts, but the rows say what each tree costs: the server
    # still speculates adaptively (target-only steps first, probes turn the trees on where the traffic pays)
    table = _measured_table()
    table["batch_sizes"]["1"] = None
    tune_lib.save_tune(str(tmp_path / tune_lib.FILENAME), table)
    m = ServerArgs(model_path="m", speculative_algorithm="EAGLE3", speculative_draft_model_path=str(tmp_path))
    assert m.speculation_off_reason is None and m.speculative_tree_costs == h.speculative_tree_costs
    assert (m.speculative_num_steps, m.speculative_eagle_topk, m.speculative_num_draft_tokens) == (1, 2, 3)
    n = ServerArgs(model_path="m", speculative_algorithm="EAGLE3", speculative_draft_model_path=str(tmp_path),
                   disable_adaptive_speculation=True)
    assert "plain decoding faster" in n.speculation_off_reason  # the table alone: serve plain


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A saved tiny HF target and a random EAGLE3 head exported for it."""
    from specjax.convert.head import export_head
    from specjax.weights import load_model
    root = tmp_path_factory.mktemp("pair")
    build("llama", root / "target")
    cfg, _ = load_model(str(root / "target"))
    _, (hcfg, hparams, vmap), _ = random_models(cfg, seed=3)
    export_head(hparams, hcfg, vmap, str(root / "head"), cfg)
    return str(root / "target"), str(root / "head")


def test_bench_tune_writes_a_table_the_server_reads(tiny_pair, capsys):
    from specjax.bench import tune as bench_tune
    from specjax.serve.args import ServerArgs
    model, head = tiny_pair
    assert bench_tune.main(["--model", model, "--draft", head, "--prompts", "random", "--num-prompts", "2",
                            "--batch-sizes", "1", "2", "--shapes", "2,2,4", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "steps,topk,draft" in out and "chosen: B=1" in out
    raw = json.loads(open(os.path.join(head, tune_lib.FILENAME)).read())
    assert raw["format"] == 1 and set(raw["batch_sizes"]) == set(raw["best_speculative"]) == {"1", "2"}
    rows = raw["rows"]
    assert [(r["batch_size"], r["shape"]) for r in rows] == [(1, None), (1, [2, 2, 4]), (2, None), (2, [2, 2, 4])]
    # greedy: every speculative output equals plain greedy (the same prompts, token for token)
    assert all(r["identical"] == 2 for r in rows if r["shape"] is not None)
    for b, shape in raw["batch_sizes"].items():  # the chosen entry: the tree where it beat plain by 3%
        plain_row, tree_row = (r for r in rows if r["batch_size"] == int(b))
        won = tree_row["tok_s"] > plain_row["tok_s"] * 1.03
        assert shape == (dict(zip(tune_lib.SHAPE_KEYS, tree_row["shape"])) if won else None)
    costs = tune_lib.load_tune_costs(head)  # what the server's live TreeChoice reads from the same file
    assert {b: c[0] for b, c in costs.items()} == {1: (2, 2, 4), 2: (2, 2, 4)}
    before = open(os.path.join(head, tune_lib.FILENAME)).read()
    assert bench_tune.main(["--model", model, "--draft", head, "--prompts", "random", "--num-prompts", "2",
                            "--batch-sizes", "1", "--shapes", "2,2,4", "--max-new-tokens", "6",
                            "--outputs-only"]) == 0
    out = capsys.readouterr().out
    assert "--outputs-only" in out and " 2/2" in out  # outputs compared, nothing written
    assert open(os.path.join(head, tune_lib.FILENAME)).read() == before
    a = ServerArgs(model_path=model, speculative_algorithm="EAGLE3", speculative_draft_model_path=head)
    # the batch-1 shape the table chose, or (plain measured faster there) its measured tree, which the live
    # accept length turns on where it pays; either way the only tree tuned here, with the file's costs
    assert tune_lib.shape_for(tune_lib.load_tune(head), 1) in ((2, 2, 4), None)
    assert (a.speculative_num_steps, a.speculative_eagle_topk, a.speculative_num_draft_tokens) == (2, 2, 4)
    assert a.speculative_tree_costs == costs


def test_bench_tune_never_chooses_a_shape_whose_greedy_outputs_differ(tiny_pair, monkeypatch, capsys):
    """Greedy speculative output is plain greedy output by construction; a shape that answered otherwise (a numerical
    bug) is reported and never chosen, however fast it ran."""
    from specjax.bench import tune as bench_tune
    from specjax.speculative import spec_generate
    model, head = tiny_pair
    real = spec_generate.speculative_generate

    def fast_but_wrong(*args, **kw):
        out, info = real(*args, **kw)
        if kw["topk"] == 2:  # the tree shape answers with more tokens than plain, in no more time
            out = [o + [1, 2, 3] for o in out]
        return out, info
    real_time = bench_tune._time_groups
    monkeypatch.setattr(spec_generate, "speculative_generate", fast_but_wrong)
    monkeypatch.setattr(bench_tune, "_time_groups", lambda *a, **k: (1.0,) + real_time(*a, **k)[1:])  # all 1 s
    assert bench_tune.main(["--model", model, "--draft", head, "--prompts", "random", "--num-prompts", "2",
                            "--batch-sizes", "1", "--shapes", "2,2,4", "--max-new-tokens", "4", "--outputs-only",
                            "--json", str(os.path.join(head, "full.json"))]) == 0
    err = capsys.readouterr().err
    assert "(2, 2, 4)" in err and "NOT CHOSEN: 2/2 outputs differ from plain greedy" in err
    raw = json.loads(open(os.path.join(head, "full.json")).read())
    assert raw["rows"][1]["speedup"] > 1 and raw["rows"][1]["identical"] == 0  # the faster row, not chosen
    assert raw["batch_sizes"]["1"] is None and raw["best_speculative"] == {}


@pytest.mark.parametrize("gain, chosen", [(1.02, None), (1.05, [2, 2, 4])])
def test_bench_tune_wants_a_gain_beyond_the_noise(tiny_pair, monkeypatch, capsys, gain, chosen):
    """One timed pass per configuration: a tree 2% faster than plain is within a machine's noise and plain stays
    the choice (--min-gain 0.03); 5% faster turns it on."""
    from specjax.bench import tune as bench_tune
    model, head = tiny_pair
    real_time, calls = bench_tune._time_groups, []

    def timed(*a, **k):
        calls.append(1)
        return (1.0 if len(calls) == 1 else 1.0 / gain,) + real_time(*a, **k)[1:]
    monkeypatch.setattr(bench_tune, "_time_groups", timed)
    full = os.path.join(head, f"full{gain}.json")
    assert bench_tune.main(["--model", model, "--draft", head, "--prompts", "random", "--num-prompts", "1",
                            "--batch-sizes", "1", "--shapes", "2,2,4", "--max-new-tokens", "4", "--outputs-only",
                            "--json", full]) == 0
    raw = json.loads(open(full).read())
    assert raw["rows"][1]["speedup"] == pytest.approx(gain)
    got = raw["batch_sizes"]["1"]
    assert (None if got is None else [got[k] for k in tune_lib.SHAPE_KEYS]) == chosen
    with pytest.raises(SystemExit):
        bench_tune.main(["--model", model, "--draft", head, "--min-gain", "-0.1"])
    assert "--min-gain must be in [0, 1)" in capsys.readouterr().err


def test_bench_tune_rejects_a_bad_shape(tiny_pair, capsys):
    from specjax.bench import tune as bench_tune
    model, head = tiny_pair
    with pytest.raises(SystemExit):
        bench_tune.main(["--model", model, "--draft", head, "--shapes", "3,1"])
    assert "STEPS,TOPK,DRAFT_TOKENS" in capsys.readouterr().err


def test_bench_tune_refuses_too_few_prompts_up_front(capsys):
    """A batch size larger than --num-prompts is refused before any model is loaded or measured."""
    from specjax.bench import tune as bench_tune
    with pytest.raises(SystemExit):
        bench_tune.main(["--draft", "no-such-head", "--num-prompts", "8", "--batch-sizes", "1", "16"])
    assert "--num-prompts 8 is smaller than batch size 16" in capsys.readouterr().err


def test_bench_tune_without_shapes_measures_the_backends_candidates(tiny_pair, monkeypatch):
    from specjax.bench import tune as bench_tune
    model, head = tiny_pair
    seen = {}

    def fake_tune(args):
        seen["shapes"], seen["max_new_tokens"] = args.shapes, args.max_new_tokens
        raise SystemExit(0)
    monkeypatch.setattr(bench_tune, "tune", fake_tune)
    with pytest.raises(SystemExit):
        bench_tune.main(["--model", model, "--draft", head, "--no-write"])
    # on a CPU: small trees, branching at 2 (a CPU verifies a few tokens for about one step, 32 for several)
    assert seen["shapes"] == bench_tune.default_shapes("cpu") and max(s[2] for s in seen["shapes"]) <= 8
    assert (3, 2, 5) in seen["shapes"] and seen["max_new_tokens"] == 256
    assert (6, 10, 60) in bench_tune.default_shapes("tpu") and bench_tune.default_shapes("gpu") == \
        bench_tune.default_shapes("tpu")
    with pytest.raises(SystemExit):  # given shapes are measured as given
        bench_tune.main(["--model", model, "--draft", head, "--no-write", "--shapes", "2,1,3"])
    assert seen["shapes"] == ((2, 1, 3),)


def test_a_table_per_kind_of_machine(tmp_path, monkeypatch):
    """A head folder holds the plain table and one per kind of machine beside it (``speculative_tune[.dtype].on-
    MACHINE.json``): a run reads this machine's where there is one (its own dtype's first), else the plain one;
    ``bench tune`` keeps a plain table measured on another kind of machine and writes this machine's beside it,
    and rewrites the plain one where it was measured here (or names no machine)."""
    intel = "2-core CPU (Intel(R) Xeon(R) Processor, x86_64), no accelerator, JAX 0.10.2 CPU"
    zen1 = "2-core CPU (AMD EPYC, x86_64, AVX2), no accelerator, JAX 0.10.2 CPU"
    table = lambda machine, s: {"format": 1, "machine": machine,
                                "batch_sizes": {"1": dict(zip(tune_lib.SHAPE_KEYS, s))}}
    monkeypatch.setattr(tune_lib, "this_machine", lambda: ("AMD EPYC", "AVX2", None))
    assert tune_lib.machine_tag() == "amd-epyc-avx2"
    assert tune_lib.filename("bfloat16", "amd-epyc-avx2") == "speculative_tune.bfloat16.on-amd-epyc-avx2.json"
    head = str(tmp_path)
    assert tune_lib.output_path(head) == str(tmp_path / tune_lib.FILENAME)  # an empty folder: the plain name
    tune_lib.save_tune(str(tmp_path / tune_lib.FILENAME), table(intel, (5, 4, 8)))
    assert tune_lib.tuned_elsewhere(head) is not None
    here = str(tmp_path / "speculative_tune.on-amd-epyc-avx2.json")
    assert tune_lib.output_path(head) == here  # the Xeon's table is kept
    assert tune_lib.output_path(head, "bfloat16") == str(tmp_path / "speculative_tune.bfloat16.json")
    tune_lib.save_tune(here, table(zen1, (2, 1, 3)))
    assert tune_lib.table_path(head) == here and tune_lib.tuned_elsewhere(head) is None
    assert tune_lib.load_tune(head) == {1: (2, 1, 3)}
    assert tune_lib.load_tune(head, dtype="bfloat16") == {1: (2, 1, 3)}  # no bf16 table: fp32's, this machine's
    tune_lib.save_tune(str(tmp_path / "speculative_tune.bfloat16.json"), table(intel, (3, 1, 4)))
    assert tune_lib.table_path(head, "bfloat16") == str(tmp_path / "speculative_tune.bfloat16.json")
    assert tune_lib.output_path(head) == here  # this machine's table is rewritten
    monkeypatch.setattr(tune_lib, "this_machine", lambda: ("Intel(R) Xeon(R) Processor", "AVX-512", None))
    assert tune_lib.machine_tag() == "intel-xeon-processor-avx-512"
    assert tune_lib.load_tune(head) == {1: (5, 4, 8)} and tune_lib.tuned_elsewhere(head) is None
    assert tune_lib.output_path(head) == str(tmp_path / tune_lib.FILENAME)  # measured here: rewritten
    monkeypatch.setattr(tune_lib, "this_machine", lambda: ("x", None, "NVIDIA H100 80GB HBM3"))
    assert tune_lib.machine_tag() == "nvidia-h100-80gb-hbm3"


@pytest.fixture
def hub_tables_cleared():
    tune_lib._hub_tables.cache_clear()
    yield
    tune_lib._hub_tables.cache_clear()  # no test's fake hub answer outlives it


def test_a_hub_heads_table_is_read_from_the_hub(tmp_path, monkeypatch, caplog, hub_tables_cleared):
    """A head given as a hub id (`--speculative-draft-model-path owner/name`) has its tree table read from the hub
    cache: only the tables are fetched for it, once per process; a hub that cannot provide them gives the defaults
    with a warning, never an error."""
    table = {"format": 1, "machine": "elsewhere", "batch_sizes": {"1": dict(zip(tune_lib.SHAPE_KEYS, (3, 1, 4)))}}
    tune_lib.save_tune(str(tmp_path / tune_lib.FILENAME), table)
    asked = []
    monkeypatch.setattr(tune_lib, "hub_snapshot",
                        lambda repo, patterns: asked.append((repo, patterns)) or str(tmp_path))
    assert tune_lib.load_tune("someone/head-eagle3") == {1: (3, 1, 4)}
    assert tune_lib.table_path("someone/head-eagle3") == str(tmp_path / tune_lib.FILENAME)
    assert asked == [("someone/head-eagle3", ("speculative_tune*.json",))]
    assert tune_lib.load_tune(str(tmp_path / "not-here")) is None and len(asked) == 1  # a local path stays local
    from specjax import head_weights
    from specjax.bench import tune as bench_tune
    monkeypatch.setattr(head_weights, "hub_snapshot", lambda repo, patterns: str(tmp_path / "snapshot"))
    args = types.SimpleNamespace(no_write=False, outputs_only=False, out=None, draft="someone/head", dtype=None)
    assert bench_tune.table_output(args) == str(tmp_path / "snapshot" / tune_lib.FILENAME)  # bench tune's table

    def offline(repo, patterns):
        raise tune_lib.WeightsError("LocalEntryNotFoundError: offline")
    monkeypatch.setattr(tune_lib, "hub_snapshot", offline)
    tune_lib._hub_tables.cache_clear()
    with caplog.at_level(logging.WARNING, logger="specjax.tune"):
        assert tune_lib.load_tune("someone/other-head") is None
    assert "no tree table for hub head someone/other-head" in caplog.text
