"""How much KV a running request is expected to need: SGLang's ``new_token_ratio``.

A request's pages are handed out as it grows (the scheduler tops each running request up before a step), so
admission cannot see what the running requests will still take. As SGLang does, it assumes each will emit a fraction
``ratio`` of the tokens it may still emit (at most ``clip`` of them counted), and admits a waiting request when its
prompt and its whole output (at most ``clip`` tokens) fit beside them. The ratio starts at ``init`` (0.7 x
``--schedule-conservativeness``), falls by ``decay`` every decode step to ``floor`` (0.14 of ``init``, over 600
steps; back to ``init`` whenever the server is idle), and when the pool runs dry anyway (requests retracted to make
room) jumps to what the remaining requests have shown: their emitted tokens plus ``retract_steps`` more each, over
their token budgets. SGLang's environment variables set the constants.
"""

from __future__ import annotations

import dataclasses
import os

ENV = {  # SGLang's names and defaults
    "init": ("SGLANG_INIT_NEW_TOKEN_RATIO", 0.7),
    "floor_factor": ("SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR", 0.14),
    "decay_steps": ("SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS", 600),
    "retract_steps": ("SGLANG_RETRACT_DECODE_STEPS", 20),
    "clip": ("SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION", 4096),
}


def _env(key: str, env) -> float:
    name, default = ENV[key]
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if value < 0 or (key in ("decay_steps", "clip") and value < 1) or (key == "floor_factor" and value > 1):
        bound = {"decay_steps": ">= 1", "clip": ">= 1", "floor_factor": "in [0, 1]"}.get(key, ">= 0")
        raise ValueError(f"{name}={raw!r} must be {bound}")
    return value


@dataclasses.dataclass
class TokenRatio:
    init: float  # the ratio at start
    floor: float  # the lowest it decays to
    decay: float  # per decode step
    retract_steps: int  # the steps of room a retraction leaves each remaining request
    clip: int  # the most tokens of a budget counted
    value: float  # the ratio now

    @classmethod
    def of(cls, conservativeness: float = 1.0, env=None) -> "TokenRatio":
        """SGLang's constants for ``--schedule-conservativeness`` (and its environment variables, ``env``: default
        ``os.environ``)."""
        env = os.environ if env is None else env
        init = min(_env("init", env) * conservativeness, 1.0)
        floor = min(init * _env("floor_factor", env), 1.0)
        return cls(init=init, floor=floor, decay=(init - floor) / _env("decay_steps", env),
                   retract_steps=int(_env("retract_steps", env)), clip=int(_env("clip", env)), value=init)

    def counted(self, left: int) -> int:
        """The part of a remaining budget of ``left`` tokens that admission counts."""
        return min(max(left, 0), self.clip)

    def expected(self, left: int) -> float:
        """The tokens a request with ``left`` tokens of budget is expected to still emit."""
        return self.value * self.counted(left)

    def reset(self) -> None:
        """Nothing runs or waits: the next requests start from the initial ratio."""
        self.value = self.init

    def step(self) -> None:
        """A decode step went by without running out of pages."""
        self.value = max(self.value - self.decay, self.floor)

    def after_retraction(self, emitted: int, budgets: int, running: int) -> None:
        """The pool ran dry and requests were retracted: ``running`` requests remain, that have emitted ``emitted``
        tokens of their ``budgets`` (max_new_tokens summed)."""
        if running and budgets > 0:
            self.value = min(1.0, (emitted + self.retract_steps * running) / budgets)
