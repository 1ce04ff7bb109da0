"""TPU preflight on any machine: compile the training step, or every program the server runs, for a real TPU
topology and report whether it fits.

    python -m specjax.preflight train --config qwen2.5-7b.yaml --topology v4-32 [--section.key VALUE ...]
    python -m specjax.preflight serve --model-path llama-3.1-8b --tp-size 4 --speculative-algorithm EAGLE3 \
        --topology v5e-4 [any server flag]

With libtpu installed (``pip install "specjax[tpu]"``, the same jax version), JAX compiles for TPU chips that are
not there: the devices come from ``jax.experimental.topologies``, the program is built through the code the
training CLI runs (``train.__main__.head_config`` / ``make_optimizer``, ``train.train_step.make_train_step``) from
abstract shapes only (the model's config.json, no weights), and the real TPU compiler (XLA:TPU, Mosaic for Pallas
kernels) compiles it. Works under ``JAX_PLATFORMS=cpu``.

What it guarantees: the program compiles for that chip generation and mesh, and its per-chip footprint
(``memory_analysis``) fits the chip's HBM. What it cannot tell: speed, numerics, host memory, input pipelines.
Exit status 1 (with the reason) when a program does not compile or does not fit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time

from specjax import configs
from specjax.cli import add_options, option, options_parser

GIB = 2 ** 30

# Cloud accelerator type -> (topology, chip config, chips per host bounds, HBM bytes per chip). v4 / v5p types
# count TensorCores (2 per chip, one megacore device); v5e / v6e types count chips.
_GENERATIONS = {
    "v4": ("v4", "megacore", 2, 32 * GIB),
    "v5p": ("v5p", "megacore", 2, 95 * GIB),
    "v5e": ("v5e", None, 1, 16 * GIB),
    "v5litepod": ("v5e", None, 1, 16 * GIB),
    "v6e": ("v6e", None, 1, 32 * GIB),
}
_SHAPES_3D = {1: (1, 1, 1), 2: (1, 2, 1), 4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4),
              128: (4, 4, 8), 256: (4, 8, 8), 512: (8, 8, 8)}
_SHAPES_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}


class PreflightError(RuntimeError):
    """A topology, config or program that cannot be checked or does not pass."""


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str  # the accelerator type as given (v4-32)
    generation: str  # v4, v5e, v5p, v6e
    chips: int
    hbm_bytes: int
    devices: tuple

    def __str__(self):
        return f"{self.name} ({self.chips} x {self.devices[0].device_kind}, {self.hbm_bytes / GIB:.0f} GiB HBM each)"


def topology_names() -> list[str]:
    return ["v4-8", "v4-16", "v4-32", "v4-64", "v4-128", "v5e-1", "v5e-4", "v5e-8", "v5litepod-4", "v5p-8",
            "v5p-32", "v6e-1", "v6e-4", "v6e-8"]


def get_topology(name: str) -> Topology:
    """Abstract TPU devices for a cloud accelerator type (v4-32, v5litepod-4, v5e-4, v5p-8, v6e-8, ...)."""
    m = re.fullmatch(r"(v4|v5p|v5e|v5litepod|v6e)-(\d+)", name.strip().lower())
    if not m:
        raise PreflightError(f"unknown topology {name!r}; use a TPU accelerator type such as "
                             f"{', '.join(topology_names())}")
    gen, cores_per_chip = m.group(1), _GENERATIONS[m.group(1)][2]
    count = int(m.group(2))
    if count % cores_per_chip:
        raise PreflightError(f"{name}: {gen} accelerator types count TensorCores ({cores_per_chip} per chip)")
    chips = count // cores_per_chip
    topo_gen, chip_config, _, hbm = _GENERATIONS[gen]
    shapes = _SHAPES_3D if topo_gen in ("v4", "v5p") else _SHAPES_2D
    if chips not in shapes:
        raise PreflightError(f"{name}: no slice shape known for {chips} chips ({', '.join(topology_names())})")
    shape = shapes[chips]
    per_host = tuple(min(s, b) for s, b in zip(shape, (2, 2, 1)))
    try:
        from jax.experimental.topologies import get_topology_desc
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compiling only: other libtpu users may run
        kw = dict(platform="tpu", topology_name=f"{topo_gen}:{'x'.join(map(str, shape))}", num_slices=1,
                  chips_per_host_bounds=per_host + (1,) * (3 - len(per_host)))
        if chip_config:
            kw["chip_config_name"] = chip_config
        devices = tuple(get_topology_desc(**kw).devices)
    except Exception as e:  # noqa: BLE001 - no libtpu, or libtpu refuses the topology
        raise PreflightError(f"cannot describe a {name} topology: {type(e).__name__}: {str(e).splitlines()[0]}. "
                             f"Install the TPU compiler for this jax: pip install \"jax[tpu]==<your jax version>\" "
                             f"(pip install \"specjax[tpu]\")") from None
    return Topology(name, topo_gen, len(devices), hbm, devices)


@dataclasses.dataclass
class Report:
    program: str
    compile_s: float
    arguments: int
    temporaries: int
    total: int
    hbm: int
    collectives: dict
    note: str = ""
    error: str = ""  # the compiler's refusal, when the program does not compile

    @property
    def fits(self) -> bool:
        return not self.error and self.total <= self.hbm


_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def count_collectives(hlo_text: str) -> dict:
    """Collective ops in an optimized HLO module, by kind (async start/done pairs counted once)."""
    op = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.-]+ = .*?\s(" + "|".join(_COLLECTIVES) + r")(?:-start)?\(", re.M)
    out: dict = {}
    for kind in op.findall(hlo_text):
        out[kind] = out.get(kind, 0) + 1
    return out


def compile_report(program: str, lowered, hbm: int, note: str = "", describe=None) -> Report:
    """Compile a lowered program for the topology and read its per-chip footprint. ``describe(hlo_text)``, when
    given, adds to the note what the compiled program holds (e.g. which attention it runs)."""
    t0 = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 - the compiler's message is the report
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        raise PreflightError(f"{program} does not compile: {type(e).__name__}: {' '.join(lines[:4])[:800]}") from None
    dt = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    total = ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
    text = compiled.as_text()
    if describe is not None:
        note = "; ".join(n for n in (note, describe(text)) if n)
    return Report(program, dt, ma.argument_size_in_bytes, ma.temp_size_in_bytes, total, hbm,
                  count_collectives(text), note)


def print_table(title: str, reports: list[Report], file=None) -> None:
    file = file or sys.stdout
    print(title, file=file)
    head = f"{'program':<44} {'compile s':>9} {'args GiB':>9} {'temp GiB':>9} {'total GiB':>10} {'HBM GiB':>8}  " \
           f"{'fits':<4}  collectives"
    print(head, file=file)
    print("-" * len(head), file=file)
    for r in reports:
        if r.error:
            print(f"{r.program:<44} {r.compile_s:>9.1f} {'-':>9} {'-':>9} {'-':>10} {r.hbm / GIB:>8.0f}  NO    "
                  f"does not compile", file=file)
            print(f"  {r.error}", file=file)
            continue
        coll = ", ".join(f"{k} x{v}" for k, v in r.collectives.items()) or "none"
        print(f"{r.program:<44} {r.compile_s:>9.1f} {r.arguments / GIB:>9.2f} {r.temporaries / GIB:>9.2f} "
              f"{r.total / GIB:>10.2f} {r.hbm / GIB:>8.0f}  {'yes' if r.fits else 'NO':<4}  {coll}", file=file)
        if r.note:
            print(f"  {r.note}", file=file)


# ---- train ---------------------------------------------------------------------------------------------------------
def abstract_train_inputs(tcfg, hcfg, mesh, grad_accum: int, batch_size: int, seq: int):
    """(target params, vocab map, batch) of the train step as sharded abstract shapes (nothing allocated): the
    target sharded as ``weights.load_model`` places it, the batch [A, B, T] split over dp."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from specjax import weights
    from specjax.models import eagle3, target
    tparams = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                           target.param_shapes(tcfg), weights.param_shardings(tcfg, mesh))
    rep = NamedSharding(mesh, P())
    vmap = eagle3.VocabMap(d2t=jax.ShapeDtypeStruct((hcfg.draft_vocab_size,), jnp.int32, sharding=rep),
                           t2d=jax.ShapeDtypeStruct((tcfg.vocab_size,), jnp.bool_, sharding=rep))
    bsh = NamedSharding(mesh, P(None, "dp"))
    batch = {k: jax.ShapeDtypeStruct((grad_accum, batch_size, seq), jnp.int32, sharding=bsh)
             for k in ("input_ids", "loss_mask", "attention_mask")}
    return tparams, vmap, batch


def train_programs(cfg, topo: Topology, recipe: str | None = None, *, all_buckets: bool = False,
                   model_config: str | None = None, num_layers: int | None = None) -> list[Report]:
    """Compile the run config's train step (the largest length bucket, or every bucket) for the topology."""
    from specjax.config import ModelConfig
    from specjax.platforms import lowering_for
    from specjax.sharding import ShardingError, make_mesh
    from specjax.train import train_step as step_lib
    from specjax.train.__main__ import head_config, make_optimizer

    shape_json = model_config or configs.model_config_json(cfg.model.path, recipe)
    if shape_json is None:
        raise PreflightError(f"no model shape for model.path={cfg.model.path!r}: pass --model-config CONFIG_JSON (an "
                             f"HF config.json) or one of the shipped shapes ({', '.join(configs.model_shapes())})")
    tcfg = ModelConfig.from_pretrained(shape_json, dtype=cfg.model.dtype)
    if num_layers is not None:  # CI: the same program with fewer target layers
        tcfg = dataclasses.replace(tcfg, num_layers=num_layers)
    hcfg = head_config(cfg, tcfg)
    tp = cfg.mesh.tp
    dp = cfg.mesh.dp if cfg.mesh.dp > 0 else topo.chips // tp
    try:
        mesh = make_mesh(dp=dp, tp=tp, devices=topo.devices)
    except ShardingError as e:
        raise PreflightError(f"mesh.dp={dp} x mesh.tp={tp} on {topo.name} ({topo.chips} chips): {e}") from None
    if cfg.training.batch_size % dp:
        raise PreflightError(f"training.batch_size={cfg.training.batch_size} must be divisible by mesh.dp={dp}")
    opt = make_optimizer(cfg, cfg.training.max_steps or 10_000)
    step = step_lib.make_train_step(tcfg, hcfg, opt, mesh, ttt_length=cfg.training.ttt_length,
                                    decay=cfg.training.decay, grad_accum=cfg.training.grad_accum)
    state = step_lib.abstract_train_state(hcfg, opt, mesh)
    buckets = sorted({min(b, cfg.data.max_length) for b in cfg.data.buckets})
    reports = []
    for seq in (buckets if all_buckets else buckets[-1:]):
        a, b = cfg.training.grad_accum, cfg.training.batch_size
        with lowering_for("tpu"):
            lowered = step.lower(state, *abstract_train_inputs(tcfg, hcfg, mesh, a, b, seq))
        name = f"train step A={a} x B={b} x T={seq}, TTT {cfg.training.ttt_length}"
        reports.append(compile_report(name, lowered, topo.hbm_bytes,
                                      note=f"{tcfg.architecture} {tcfg.num_layers} layers {tcfg.dtype}, head "
                                           f"{hcfg.dtype}, mesh dp={dp} x tp={tp}"))
    return reports


@dataclasses.dataclass
class TrainPreflightOptions:
    """``python -m specjax.preflight train``'s own flags; the rest are the run config's ``--section.key``."""
    config: str = option(required=True, help="run config: a path or a shipped name (qwen2.5-7b.yaml)")
    topology: str = option(required=True, help="TPU accelerator type, e.g. v4-32")
    model_config: str | None = option(None, help="HF config.json giving the model shape (default: model.path's own, "
                                                  "else the shipped shape named like the config)")
    all_buckets: bool = option(False, help="compile every length bucket, not only the largest")
    num_layers: int | None = option(None, hidden=True)  # tests: fewer target layers


def _train_main(argv) -> int:
    from specjax.train.config import ConfigError, load_config
    p = options_parser(TrainPreflightOptions, "python -m specjax.preflight train",
                       "Compile the training step of a run config for a TPU topology.",
                       configs.help_text() + "; topologies: " + ", ".join(topology_names()),
                       formatter_class=argparse.HelpFormatter)
    args, overrides = p.parse_known_args(argv)
    try:
        cfg = load_config(args.config, overrides)
        topo = get_topology(args.topology)
        reports = train_programs(cfg, topo, args.config, all_buckets=args.all_buckets,
                                 model_config=args.model_config, num_layers=args.num_layers)
    except (ConfigError, PreflightError) as e:
        print(f"preflight: error: {e}", file=sys.stderr)
        return 1
    print_table(f"preflight train: {os.path.basename(args.config)} on {topo}", reports)
    bad = [r for r in reports if not r.fits]
    for r in bad:
        print(f"preflight: error: {r.program} needs {r.total / GIB:.2f} GiB per chip, {topo.name} chips have "
              f"{r.hbm / GIB:.0f} GiB", file=sys.stderr)
    return 1 if bad else 0


# ---- serve ---------------------------------------------------------------------------------------------------------
SERVE_PROGRAMS = ("plain", "EAGLE3", "EAGLE")


@dataclasses.dataclass
class ServeSetup:
    """The server's model on the topology, as abstract shapes (nothing is allocated)."""
    args: object  # serve.args.ServerArgs
    tcfg: object
    mesh: object  # the server's mesh (None on one chip, as the server runs it)
    shard_mesh: object  # the mesh the abstract arrays are placed on (one chip when ``mesh`` is None)
    params: object  # the target's unstacked params (the decode layout), ShapeDtypeStructs
    param_bytes: int  # weights per chip, as the server counts them for its KV budget
    topo: Topology


def _sds(shape, dtype, sharding):
    import jax
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def _unstacked_shapes(cfg, mesh):
    """``target.unstack_layers`` of the server's sharded params, abstractly: one set of per-layer shapes per layer,
    each keeping its stacked sharding without the layer axis (fused projections on one chip)."""
    import jax
    from jax.sharding import NamedSharding

    from specjax import weights
    from specjax.models import target
    stacked = jax.tree.map(lambda s, sh: _sds(s.shape, s.dtype, sh), target.param_shapes(cfg),
                           weights.param_shardings(cfg, mesh))
    layer = jax.tree.map(lambda a: _sds(a.shape[1:], a.dtype, NamedSharding(mesh, type(a.sharding.spec)(
        *tuple(a.sharding.spec)[1:]))), stacked.layers)
    if mesh.size == 1:  # on one chip the server fuses q/k/v (target.unstack_layers)
        layer = jax.tree.map(lambda a: _sds(a.shape, a.dtype, NamedSharding(mesh, jax.sharding.PartitionSpec())),
                             jax.eval_shape(target.fuse_layer, layer))
    return dataclasses.replace(stacked, layers=tuple(layer for _ in range(cfg.num_layers)))


def serve_setup(args, topo: Topology, *, model_config: str | None = None, num_layers: int | None = None) -> ServeSetup:
    """Target config, mesh and abstract params for the server's flags (``--model-path`` a folder, a config.json or a
    shipped shape name; ``--tp-size`` x ``--dp-size`` chips of the topology)."""
    import jax

    from specjax.config import ConfigError, ModelConfig
    from specjax.sharding import ShardingError, make_mesh

    shape_json = model_config or configs.model_config_json(args.model_path)
    if shape_json is None:
        raise PreflightError(f"no model shape for --model-path {args.model_path!r}: give a folder or config.json, or "
                             f"one of the shipped shapes ({', '.join(configs.model_shapes())})")
    try:
        tcfg = ModelConfig.from_pretrained(shape_json, dtype=None if args.dtype == "auto" else args.dtype)
    except ConfigError as e:
        raise PreflightError(str(e)) from None
    if num_layers is not None:  # tests: the same programs with fewer target layers
        tcfg = dataclasses.replace(tcfg, num_layers=num_layers)
    n = args.tp_size * args.dp_size
    if n > topo.chips:
        raise PreflightError(f"--tp-size {args.tp_size} x --dp-size {args.dp_size} needs {n} chips; {topo.name} has "
                             f"{topo.chips}")
    try:
        shard_mesh = make_mesh(dp=args.dp_size, tp=args.tp_size, devices=topo.devices[:n])
    except ShardingError as e:
        raise PreflightError(f"--tp-size {args.tp_size} x --dp-size {args.dp_size} on {topo.name}: {e}") from None
    args.resolve_page_size(tcfg.head_dim, tcfg.dtype, "tpu")
    params = _unstacked_shapes(tcfg, shard_mesh)
    param_bytes = sum(a.dtype.itemsize * math.prod(a.shape) for a in jax.tree.leaves(params)) // args.tp_size
    return ServeSetup(args, tcfg, shard_mesh if n > 1 else None, shard_mesh, params, param_bytes, topo)


def _draft_config(setup: ServeSetup, algorithm: str):
    """(head config, where it came from): the head folder's config.json when ``--speculative-draft-model-path``
    belongs to this algorithm, else the one-layer head ``specjax.train`` makes for this target."""
    from specjax.head_weights import HeadFormatError, check_head_matches_target, resolve_head_path
    from specjax.models import eagle, eagle3
    args, tcfg = setup.args, setup.tcfg
    path = args.speculative_draft_model_path if args.speculative_algorithm == algorithm else None
    if path:
        try:
            with open(os.path.join(resolve_head_path(path), "config.json")) as f:  # a folder, or a hub id
                hf = json.load(f)
            if algorithm == "EAGLE3":
                dcfg = eagle3.config_from_hf(hf, tcfg.num_layers, dtype=tcfg.dtype)
                check_head_matches_target(dcfg, tcfg)
            else:
                dcfg = eagle.config_from_hf(hf, dtype=tcfg.dtype)
        except (OSError, KeyError, ValueError, HeadFormatError) as e:
            raise PreflightError(f"--speculative-draft-model-path {path}: {type(e).__name__}: {e}") from None
        return dcfg, f"head {path}"
    if algorithm == "EAGLE3":
        from specjax.train.config import HeadConfig
        # the trainer's default draft vocabulary (32000), capped at the target's as the trainer caps it
        dcfg = eagle3.Eagle3Config.from_target(tcfg, draft_vocab_size=HeadConfig().draft_vocab_size, dtype=tcfg.dtype)
        return dcfg, f"1-layer head shaped from the target, draft vocab {dcfg.draft_vocab_size}"
    return eagle.EagleConfig.from_target(tcfg, dtype=tcfg.dtype), "1-layer head shaped from the target"


def _abstract_draft(setup: ServeSetup, algorithm: str, dcfg):
    """``speculative.draft.make_draft`` on abstract params, replicated over the mesh as ``SpecRunner`` places it."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from specjax.models import eagle, eagle3
    from specjax.speculative import draft as draft_lib
    token_map = setup.args.speculative_token_map if algorithm == "EAGLE" else None
    ids = eagle.load_token_map(token_map, setup.tcfg.vocab_size) if token_map else None
    if algorithm == "EAGLE3":
        vocab = eagle3.VocabMap(d2t=jax.ShapeDtypeStruct((dcfg.draft_vocab_size,), jnp.int32),
                                t2d=jax.ShapeDtypeStruct((setup.tcfg.vocab_size,), jnp.bool_))
        make = lambda p, t, v: draft_lib.make_draft(algorithm, dcfg, p, t, v)
        draft = jax.eval_shape(make, eagle3.param_shapes(dcfg), setup.params, vocab)
    else:
        make = lambda p, t: draft_lib.make_draft(algorithm, dcfg, p, t, ids)
        draft = jax.eval_shape(make, eagle.param_shapes(dcfg), setup.params)
    rep = NamedSharding(setup.shard_mesh, P())
    return jax.tree.map(lambda a: _sds(a.shape, a.dtype, rep), draft)


def _abstract_state(setup: ServeSetup, init_state, kv_fields):
    """The runner's ``init_state`` as abstract shapes: KV pools (``kv_fields``) split over kv heads on tp where they
    divide, as the runners place them; everything else replicated."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = setup.shard_mesh
    tp = mesh.shape["tp"]

    def place(path, a):
        kv = jax.tree_util.keystr(path) in kv_fields and a.shape[2] % tp == 0
        return _sds(a.shape, a.dtype, NamedSharding(mesh, P(None, None, "tp", None, None) if kv else P()))
    return jax.tree_util.tree_map_with_path(place, jax.eval_shape(init_state))


def _attention_used(setup: ServeSetup, tokens: int):
    """describe(): which attention the compiled program runs — the Pallas kernel (a Mosaic custom call in the HLO)
    or the XLA path, with the kernel's reason (for one chip's heads, ``tokens`` queries per sequence)."""
    import jax.numpy as jnp

    from specjax.kernels.tree_attention import head_split, tpu_unsupported_reason
    cfg = setup.tcfg
    split = head_split(setup.mesh, cfg.num_heads, cfg.num_kv_heads)

    def describe(hlo_text: str) -> str:
        if "tpu_custom_call" in hlo_text:
            return "attention: Pallas kernel"
        why = tpu_unsupported_reason(cfg.num_heads // split, cfg.num_kv_heads // split, cfg.head_dim,
                                     setup.args.page_size, jnp.dtype(cfg.dtype), tree_tokens=tokens)
        return f"attention: XLA fallback ({why})" if why else "attention: XLA"
    return describe


def _compile(setup: ServeSetup, name: str, describe, fn, *args, **kwargs) -> Report:
    """Lower ``fn`` as the runner calls it (under its mesh) and compile it for the topology; a program the compiler
    refuses becomes a report row with the reason (the other programs are still checked)."""
    from specjax.platforms import lowering_for
    from specjax.sharding import use_mesh
    t0 = time.perf_counter()
    try:
        with use_mesh(setup.mesh), lowering_for("tpu"):
            lowered = fn.lower(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - e.g. a Mosaic call XLA cannot partition: its message is the report
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        return Report(name, time.perf_counter() - t0, 0, 0, 0, setup.topo.hbm_bytes, {},
                      error=f"lowering fails: {type(e).__name__}: {' '.join(lines[:2])[:500]}")
    try:
        report = compile_report(name, lowered, setup.topo.hbm_bytes, describe=describe)
    except PreflightError as e:
        report = Report(name, time.perf_counter() - t0, 0, 0, 0, setup.topo.hbm_bytes, {},
                        error=str(e).removeprefix(f"{name} does not compile: "))
    print(f"preflight: {name}: {'does not compile' if report.error else 'compiled'} in "
          f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)  # progress: 8B programs take minutes
    return report


def _pool_note(setup: ServeSetup, plan) -> str:
    z = setup.args.page_size
    pool = (plan.num_pages - 1) * z
    return (f"KV pool {plan.num_pages - 1} pages x {z} tokens = {pool} tokens ({plan.kv_layers} layers, "
            f"{(plan.num_pages * plan.page_bytes) / GIB:.2f} GiB per chip), {plan.max_running} slots, context "
            f"{plan.context_length}, weights {setup.param_bytes / GIB:.2f} GiB per chip")


def plain_programs(setup: ServeSetup, plan, *, all_buckets: bool = True) -> list[Report]:
    """The plain runner's programs (``serve.runners.plain.PlainRunner``): every prefill bucket and the decode step, at
    the largest page bucket and batch bucket (the most memory)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from specjax import sampling
    from specjax.batching import serving_prefill_buckets
    from specjax.kernels.tree_attention import make_cache_attention
    from specjax.serve.runners.plain import PlainRunner
    args, cfg = setup.args, setup.tcfg
    runner = PlainRunner(cfg, setup.params, max_batch=plan.max_running, pages_per_seq=plan.pages_per_seq,
                         page_size=args.page_size, num_pages=plan.num_pages, max_prefill_tokens=plan.prefill_chunk,
                         attention_impl=args.attention_impl, mesh=setup.mesh)
    runner.cache_attention = make_cache_attention(args.attention_impl, cfg.sliding_window, "tpu")  # as on a TPU
    runner.prefill_buckets = serving_prefill_buckets(runner.prefill_buckets[-1], few_rows=False)  # no CPU kernels
    state = _abstract_state(setup, runner.init_state, (".cache.k", ".cache.v"))
    rep = NamedSharding(setup.shard_mesh, P())
    s = lambda shape, dt=jnp.int32: _sds(shape, dt, rep)
    npages, nb = runner.page_buckets[-1], runner.batch_buckets[-1]
    reports = []
    # one request's sampling row, as ``PlainRunner.prefill`` batches it (only its shapes matter)
    row = sampling.SamplingBatch.from_rows([sampling.SamplingRow()], cfg.vocab_size, [np.zeros((1,), np.int32)],
                                           seeds=[0])
    row = jax.tree.map(lambda a: s(np.shape(a), np.asarray(a).dtype), row)
    for t in (runner.prefill_buckets if all_buckets else runner.prefill_buckets[-1:]):
        reports.append(_compile(setup, f"plain prefill T={t}", _attention_used(setup, t), runner._prefill_jit,
                                runner.params, state, s(()), s((t,)), s(()), s(()), s((plan.pages_per_seq,)), row,
                                npages=npages))
    reports.append(_compile(setup, f"plain decode step B={nb}", _attention_used(setup, 1), runner._step_jit,
                            runner.params, state, s((plan.max_running,), jnp.bool_), nb=nb, npages=npages))
    reports.append(_score_program(setup, "plain", runner, state, s))
    return reports


def _score_program(setup: ServeSetup, name: str, runner, state, s) -> Report:
    """The prompt-logprob scoring chunk (``prompt_logprobs._score_chunk``) at the runner's largest prefill bucket,
    the one holding the most logits ([T, V] f32), against the runner's pool."""
    import jax.numpy as jnp

    from specjax import prompt_logprobs, sampling
    t, npages = runner.prefill_buckets[-1], runner.page_buckets[-1]
    return _compile(setup, f"{name} prompt scoring T={t}", _attention_used(setup, t), prompt_logprobs._score_chunk,
                    runner.target_params, setup.tcfg, state.cache.k, state.cache.v, s((runner.pages_per_seq,)),
                    s((t,)), s((t,)), s(()), s(()), s((), jnp.float32), s((sampling.MAX_TOKEN_IDS_LOGPROB,)),
                    npages=npages, cache_attention=runner.cache_attention)


def spec_programs(setup: ServeSetup, plan, algorithm: str, dcfg, *, all_buckets: bool = True) -> list[Report]:
    """``serve.runners.spec.SpecRunner``'s programs for ``algorithm``: every prefill bucket (target + draft caches) and
    the fused speculative step (draft rollout, tree verify, commit) at the largest batch and page buckets."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from specjax.batching import serving_prefill_buckets
    from specjax.kernels.tree_attention import make_cache_attention
    from specjax.serve.runners import spec as spec_runner
    args, cfg = setup.args, setup.tcfg
    runner = spec_runner.SpecRunner(
        cfg, setup.params, algorithm, _abstract_draft(setup, algorithm, dcfg), None, None,
        num_steps=args.speculative_num_steps, topk=args.speculative_eagle_topk,
        num_draft_tokens=args.speculative_num_draft_tokens, max_batch=plan.max_running,
        pages_per_seq=plan.pages_per_seq, page_size=args.page_size, num_pages=plan.num_pages,
        attention_impl=args.attention_impl, prefill_chunk=plan.prefill_chunk, mesh=setup.mesh,
        thresholds=args.accept_thresholds)
    runner.scfg = dataclasses.replace(runner.scfg, cache_attention=make_cache_attention(
        args.attention_impl, cfg.sliding_window, "tpu"))  # as on a TPU
    runner.cache_attention = runner.scfg.cache_attention
    runner.prefill_buckets = serving_prefill_buckets(runner.prefill_buckets[-1], few_rows=False)  # no CPU kernels
    state = _abstract_state(setup, runner.init_state, (".cache.k", ".cache.v", ".draft_k", ".draft_v"))
    rep = NamedSharding(setup.shard_mesh, P())
    s = lambda shape, dt=jnp.int32: _sds(shape, dt, rep)
    buckets = runner.prefill_buckets
    reports = []
    for t in (buckets if all_buckets else buckets[-1:]):
        reports.append(_compile(setup, f"{algorithm} prefill T={t}", _attention_used(setup, t),
                                spec_runner._prefill_slot, runner.target_params, cfg, runner.prefill_draft,
                                runner.scfg.for_prefill(), state, s(()), s((1, t)), s((1, t)), s((1, t), jnp.bool_),
                                s((1,), jnp.bool_), s((1,))))
    sc = runner.scfg
    reports.append(_compile(setup, f"{algorithm} step B={plan.max_running} S={sc.num_steps} k={sc.topk} "
                                   f"M={sc.num_draft_tokens}", _attention_used(setup, sc.num_draft_tokens),
                            spec_runner._step_rows, runner.target_params,
                            cfg, runner.draft, sc, state, s((plan.max_running,), jnp.bool_), nb=plan.max_running,
                            npages=plan.pages_per_seq))
    reports.append(_score_program(setup, algorithm, runner, state, s))
    return reports


def serve_programs(setup: ServeSetup, programs, *, all_buckets: bool = True):
    """[(title, pool note, reports)] for each program set (``plain``, ``EAGLE3``, ``EAGLE``), each with the KV pool
    the server would allocate for it on the topology's HBM (``serve.launch.plan_pool``)."""
    from specjax.serve.launch import plan_pool
    # every head's config read and checked now: a wrong --speculative-draft-model-path was said only after the plain
    # programs had compiled (minutes)
    heads = {name: _draft_config(setup, name) if name != "plain" else (None, "") for name in programs}
    out = []
    for name in programs:
        dcfg, origin = heads[name]
        try:
            plan = plan_pool(setup.args, setup.tcfg, None if dcfg is None else dcfg.num_layers, setup.param_bytes,
                             setup.topo.hbm_bytes)
        except MemoryError as e:
            raise PreflightError(f"{name}: {e}") from None
        reports = plain_programs(setup, plan, all_buckets=all_buckets) if dcfg is None else \
            spec_programs(setup, plan, name, dcfg, all_buckets=all_buckets)
        title = "plain decoding" if dcfg is None else f"{name} ({origin})"
        out.append((title, _pool_note(setup, plan), reports))
    return out


@dataclasses.dataclass
class ServePreflightOptions:
    """``python -m specjax.preflight serve``'s own flags, beside the server's (``serve.args.ServerArgs``)."""
    topology: str = option(required=True, group="preflight",
                           help="TPU accelerator type: " + ", ".join(topology_names()))
    programs: str | None = option(None, group="preflight",
                                  help="comma-separated program sets among plain, EAGLE3, EAGLE (default: plain, plus "
                                       "--speculative-algorithm's)")
    largest_bucket_only: bool = option(False, group="preflight",
                                       help="compile only the largest prefill bucket (it needs the most memory)")
    model_config: str | None = option(None, group="preflight",
                                      help="HF config.json giving the model shape (default: --model-path's own, or "
                                           "the shipped shape of that name)")
    num_layers: int | None = option(None, hidden=True, group="preflight")  # tests: fewer target layers


def _serve_parser():
    from specjax.serve.args import build_parser
    p = build_parser()
    p.prog = "python -m specjax.preflight serve"
    p.description = ("Compile every program the server runs with these flags (the server's own) for a TPU "
                     "topology: each prefill bucket, the decode step, the speculative step; no weights needed.")
    p.epilog = ("examples:\n"
                "  python -m specjax.preflight serve --model-path llama-3.1-8b --tp-size 4 --topology v5e-4 \\\n"
                "      --speculative-algorithm EAGLE3 --programs plain,EAGLE3\n"
                "  python -m specjax.preflight serve --model-path ~/.cache/specjax/SmolLM2-135M-Instruct "
                "--topology v5e-1")
    return add_options(p, ServePreflightOptions)


_PREFLIGHT_ONLY = tuple(f.name for f in dataclasses.fields(ServePreflightOptions))


def _serve_args(ns):
    """(ServerArgs validated by the server's own rules, program sets). A speculative algorithm without a head folder
    is allowed here: the head's shape then comes from the target."""
    from specjax.serve.args import ArgsError, ServerArgs
    kw = {k: v for k, v in vars(ns).items() if k not in _PREFLIGHT_ONLY}
    programs = [p.strip() for p in (ns.programs or "").split(",") if p.strip()]
    canon = {p.lower(): p for p in SERVE_PROGRAMS}
    bad = [p for p in programs if p.lower() not in canon]
    if bad:
        raise PreflightError(f"--programs: unknown {bad}; choose among {', '.join(SERVE_PROGRAMS)}")
    programs = [canon[p.lower()] for p in programs] or ["plain"] + (
        [kw["speculative_algorithm"]] if kw.get("speculative_algorithm") else [])
    spec = next((p for p in programs if p != "plain"), None)
    if kw.get("speculative_algorithm") is None and spec:
        kw["speculative_algorithm"] = spec  # the tree flags' defaults apply
    args = ServerArgs(**kw)
    try:
        placeholder = "(shape from the target)" if args.speculative_algorithm else None
        dataclasses.replace(args, speculative_draft_model_path=args.speculative_draft_model_path or
                            placeholder).validate()
    except ArgsError as e:
        raise PreflightError(str(e)) from None
    return args, programs


def _serve_main(argv) -> int:
    ns = _serve_parser().parse_args(argv)
    try:
        args, programs = _serve_args(ns)
        topo = get_topology(ns.topology)
        setup = serve_setup(args, topo, model_config=ns.model_config, num_layers=ns.num_layers)
        results = serve_programs(setup, programs, all_buckets=not ns.largest_bucket_only)
    except PreflightError as e:
        print(f"preflight: error: {e}", file=sys.stderr)
        return 1
    c = setup.tcfg
    print(f"preflight serve: {args.model_path} ({c.architecture}, {c.num_layers} layers, {c.dtype}, "
          f"{c.num_heads}/{c.num_kv_heads} heads x {c.head_dim}) on {topo}, tp={args.tp_size} x dp={args.dp_size}")
    bad = []
    for title, pool, reports in results:
        print()
        print_table(f"{title}: {pool}", reports)
        bad += [r for r in reports if not r.fits]
    for r in bad:
        why = f"does not compile ({r.error})" if r.error else \
            f"needs {r.total / GIB:.2f} GiB per chip, {topo.name} chips have {r.hbm / GIB:.0f} GiB"
        if not r.error or "on HBM" in r.error:
            hint = "; lower --mem-fraction-static or --max-total-tokens, or raise --tp-size"
        elif "smem" in r.error.lower():  # the kernel's scalar-prefetched page table [slots, pages per sequence]
            hint = "; lower --context-length or --max-running-requests"
        else:
            hint = ""
        print(f"preflight: error: {r.program} {why}{hint}", file=sys.stderr)
    return 1 if bad else 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("train", "serve"):
        print("usage: python -m specjax.preflight train --config CONFIG --topology TPU_TYPE [--section.key VALUE]\n"
              "       python -m specjax.preflight serve --model-path DIR_OR_SHAPE --topology TPU_TYPE [server flags]"
              f"\n  {configs.help_text()}\n  topologies: {', '.join(topology_names())}",
              file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return _train_main(argv[1:]) if argv[0] == "train" else _serve_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
