"""TPU preflight on any machine: compile the training step for a real TPU topology and report whether it fits.

    python -m specjax.preflight train --config qwen2.5-7b.yaml --topology v4-32 [--section.key VALUE ...]

With libtpu installed (``pip install "specjax[tpu]"``, the same jax version), JAX compiles for TPU chips that are
not there: the devices come from ``jax.experimental.topologies``, the program is built through the code the
training CLI runs (``train.__main__.head_config`` / ``make_optimizer``, ``train.step.make_train_step``) from
abstract shapes only (the model's config.json, no weights), and the real TPU compiler (XLA:TPU, Mosaic for Pallas
kernels) compiles it. Works under ``JAX_PLATFORMS=cpu``.

What it guarantees: the program compiles for that chip generation and mesh, and its per-chip footprint
(``memory_analysis``) fits the chip's HBM. What it cannot tell: speed, numerics, host memory, input pipelines.
Exit status 1 (with the reason) when a program does not compile or does not fit.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time

from specjax import configs

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

    @property
    def fits(self) -> bool:
        return self.total <= self.hbm


_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def count_collectives(hlo_text: str) -> dict:
    """Collective ops in an optimized HLO module, by kind (async start/done pairs counted once)."""
    op = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.-]+ = .*?\s(" + "|".join(_COLLECTIVES) + r")(?:-start)?\(", re.M)
    out: dict = {}
    for kind in op.findall(hlo_text):
        out[kind] = out.get(kind, 0) + 1
    return out


def compile_report(program: str, lowered, hbm: int, note: str = "") -> Report:
    """Compile a lowered program for the topology and read its per-chip footprint."""
    t0 = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 - the compiler's message is the report
        raise PreflightError(f"{program} does not compile: {type(e).__name__}: {str(e).splitlines()[0][:500]}") from None
    dt = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    total = ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
    return Report(program, dt, ma.argument_size_in_bytes, ma.temp_size_in_bytes, total, hbm,
                  count_collectives(compiled.as_text()), note)


def print_table(title: str, reports: list[Report], file=None) -> None:
    file = file or sys.stdout
    print(title, file=file)
    head = f"{'program':<44} {'compile s':>9} {'args GiB':>9} {'temp GiB':>9} {'total GiB':>10} {'HBM GiB':>8}  " \
           f"{'fits':<4}  collectives"
    print(head, file=file)
    print("-" * len(head), file=file)
    for r in reports:
        coll = ", ".join(f"{k} x{v}" for k, v in r.collectives.items()) or "none"
        print(f"{r.program:<44} {r.compile_s:>9.1f} {r.arguments / GIB:>9.2f} {r.temporaries / GIB:>9.2f} "
              f"{r.total / GIB:>10.2f} {r.hbm / GIB:>8.0f}  {'yes' if r.fits else 'NO':<4}  {coll}", file=file)
        if r.note:
            print(f"  {r.note}", file=file)


# ---- train ---------------------------------------------------------------------------------------------------------
def train_programs(cfg, topo: Topology, recipe: str | None = None, *, all_buckets: bool = False,
                   model_config: str | None = None, num_layers: int | None = None) -> list[Report]:
    """Compile the run config's train step (the largest length bucket, or every bucket) for the topology."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from specjax import weights
    from specjax.config import ModelConfig
    from specjax.models import eagle3, target
    from specjax.sharding import ShardingError, make_mesh
    from specjax.train import step as step_lib
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
    tparams = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                           target.param_shapes(tcfg), weights.param_shardings(tcfg, mesh))
    rep = NamedSharding(mesh, P())
    vmap = eagle3.VocabMap(d2t=jax.ShapeDtypeStruct((hcfg.draft_vocab_size,), jnp.int32, sharding=rep),
                           t2d=jax.ShapeDtypeStruct((tcfg.vocab_size,), jnp.bool_, sharding=rep))
    bsh = NamedSharding(mesh, P(None, "dp"))
    buckets = sorted({min(b, cfg.data.max_length) for b in cfg.data.buckets})
    reports = []
    for seq in (buckets if all_buckets else buckets[-1:]):
        a, b = cfg.training.grad_accum, cfg.training.batch_size
        batch = {k: jax.ShapeDtypeStruct((a, b, seq), jnp.int32, sharding=bsh)
                 for k in ("input_ids", "loss_mask", "attention_mask")}
        lowered = step.lower(state, tparams, vmap, batch)
        name = f"train step A={a} x B={b} x T={seq}, TTT {cfg.training.ttt_length}"
        reports.append(compile_report(name, lowered, topo.hbm_bytes,
                                      note=f"{tcfg.architecture} {tcfg.num_layers} layers {tcfg.dtype}, head "
                                           f"{hcfg.dtype}, mesh dp={dp} x tp={tp}"))
    return reports


def _train_main(argv) -> int:
    from specjax.train.config import ConfigError, load_config
    p = argparse.ArgumentParser(prog="python -m specjax.preflight train",
                                description="Compile the training step of a run config for a TPU topology.",
                                epilog=configs.help_text() + "; topologies: " + ", ".join(topology_names()))
    p.add_argument("--config", required=True, help="run config: a path or a shipped name (qwen2.5-7b.yaml)")
    p.add_argument("--topology", required=True, help="TPU accelerator type, e.g. v4-32")
    p.add_argument("--model-config", help="HF config.json giving the model shape (default: model.path's own, else "
                                          "the shipped shape named like the config)")
    p.add_argument("--all-buckets", action="store_true", help="compile every length bucket, not only the largest")
    p.add_argument("--num-layers", type=int, help=argparse.SUPPRESS)  # tests: fewer target layers
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


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("train",):
        print("usage: python -m specjax.preflight train --config CONFIG --topology TPU_TYPE [--section.key VALUE]\n"
              f"  {configs.help_text()}\n  topologies: {', '.join(topology_names())}",
              file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return _train_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
