"""Ahead-of-time lower + compile of the full Qwen2.5-7B EAGLE3 train step on a 4 x 4 (dp x tp) mesh of the fake CPU
devices, from abstract shapes only (nothing is allocated), as SpecJAX's recipe runs it on a TPU v4-32: global
batch 4 x T=1024 per micro-batch, grad-accum 4, TTT length 7, bf16 target and head compute, fp32 master weights.

Per-device memory comes from ``compiled.memory_analysis()`` and must fit a TPU v4 chip's 32 GiB. The CPU backend
has no bf16 matmuls and keeps f32 copies of the bf16 target weights (about 6 GiB per device here), so the CPU
figure overstates what a TPU needs. Takes about 20 s of CPU (about a minute of wall time on a busy machine).
"""

import time

import pytest

from specjax.config import ModelConfig
from specjax.models import eagle3
from specjax.preflight import abstract_train_inputs
from specjax.sharding import make_mesh
from specjax.train import train_step as S

GIB = 2 ** 30


@pytest.mark.slow
def test_qwen25_7b_train_step_compiles_and_fits_tpu_v4():
    t0 = time.time()
    tcfg = ModelConfig.from_pretrained("configs/models/qwen2.5-7b.json")
    assert (tcfg.num_layers, tcfg.hidden_size, tcfg.vocab_size) == (28, 3584, 152064)
    hcfg = eagle3.Eagle3Config.from_target(tcfg, draft_vocab_size=32000, dtype="bfloat16")
    assert hcfg.aux_layer_ids == (1, 13, 24)
    mesh = make_mesh(dp=4, tp=4)
    opt = S.make_optimizer(lr=8e-4, total_steps=9966, warmup_ratio=0.03)
    step = S.make_train_step(tcfg, hcfg, opt, mesh, ttt_length=7, decay=0.8, grad_accum=4)

    state = S.abstract_train_state(hcfg, opt, mesh)
    tparams, vmap, batch = abstract_train_inputs(tcfg, hcfg, mesh, grad_accum=4, batch_size=4, seq=1024)

    compiled = step.lower(state, tparams, vmap, batch).compile()
    ma = compiled.memory_analysis()
    per_device = (ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
                  + ma.temp_size_in_bytes)
    print(f"\nQwen2.5-7B train step, 4x4 mesh, B=4 x T=1024 x A=4, TTT 7: compiled in {time.time() - t0:.0f} s; "
          f"per device: arguments {ma.argument_size_in_bytes / GIB:.2f} GiB, temporaries "
          f"{ma.temp_size_in_bytes / GIB:.2f} GiB, total {per_device / GIB:.2f} GiB")
    # the state is donated: its buffers are reused for the new state
    assert ma.alias_size_in_bytes > 0.9 * ma.output_size_in_bytes
    assert per_device < 32 * GIB
