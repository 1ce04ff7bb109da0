"""SGLang's ``/start_profile`` and ``/stop_profile`` (and ``Engine.start_profile`` / ``stop_profile``) on JAX: a
``jax.profiler`` trace of what the server runs, every device's work and the host's, written where XProf / TensorBoard
(``*.xplane.pb``) and Perfetto (``perfetto_trace.json.gz``) read it.

As SGLang: the trace starts at once, or at the server's forward step ``start_step`` (a scheduler iteration that ran a
prefill round or a decode step counts one); with ``num_steps`` it stops by itself after that many steps, else at
``stop_profile``. ``output_dir`` defaults to ``SGLANG_TORCH_PROFILER_DIR``, else ``/tmp``. ``activities``: CPU (the
host's events; without it only the devices' are traced), GPU / TPU (the devices', always traced), MEM (a device
memory profile, ``memory_profile-{id}.prof`` for pprof, saved when the trace stops); ``with_stack`` false leaves out
the Python call stacks. One process holds every rank here, so ``merge_profiles`` has nothing to merge; SGLang's
``profile_by_stage`` (prefill and decode in separate traces) and ROCm's RPD are refused.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import jax
import jax._src.profiler  # noqa: F401 - its state is reset after a failed write

from .request import RequestError

log = logging.getLogger("specjax.serve")
ACTIVITIES = ("CPU", "GPU", "TPU", "MEM")


class Profiler:
    """One trace at a time; ``start`` / ``stop`` from any thread, ``on_step`` from the scheduler's."""

    def __init__(self):
        self._lock = threading.Lock()
        self.steps = 0  # forward steps the server has run
        self._armed: dict | None = None  # a trace asked for, waiting for its start step
        self._running: dict | None = None  # the trace being recorded: its folder, steps left, memory profile
        self._done: str | Exception | None = None  # how a trace that stopped by itself ended, until stop() asks

    def start(self, output_dir: str | None = None, start_step: int | None = None, num_steps: int | None = None,
              activities: list[str] | None = None, with_stack: bool | None = None, record_shapes: bool | None = None,
              profile_by_stage: bool = False, merge_profiles: bool = False, profile_prefix: str | None = None) -> str:
        """Start (or arm) a trace; the answer's message. A RequestError for a bad argument or a trace in progress.
        ``record_shapes``: XLA's events carry their shapes anyway."""
        acts = [str(a).upper() for a in (activities or ["CPU", "GPU"])]
        bad = [a for a in acts if a not in ACTIVITIES]
        if bad:
            raise RequestError(f"activity {bad[0]!r} is not recorded here; choose from {', '.join(ACTIVITIES)}",
                               "activities")
        if profile_by_stage:
            raise RequestError("profile_by_stage (separate prefill and decode traces) is not supported: one trace "
                               "holds both", "profile_by_stage")
        for name, v in (("start_step", start_step), ("num_steps", num_steps)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < (0 if name[0] == "s" else 1)):
                raise RequestError(f"{name} must be an integer >= {0 if name[0] == 's' else 1}", name)
        folder = output_dir or os.environ.get("SGLANG_TORCH_PROFILER_DIR", "/tmp")
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise RequestError(f"cannot write a trace into {folder}: {e}", "output_dir") from None
        trace = {"dir": folder, "left": num_steps, "mem": "MEM" in acts, "host": "CPU" in acts,
                 "stack": with_stack is not False, "id": f"{profile_prefix + '-' if profile_prefix else ''}"
                                                         f"{time.time():.0f}"}
        with self._lock:
            if self._armed is not None or self._running is not None:
                raise RequestError("Profiling is already in progress. Call /stop_profile first.", "output_dir")
            self._done = None
            if start_step is not None and start_step > self.steps:
                self._armed = dict(trace, at=start_step)
                return f"Profiling armed: it starts at forward step {start_step} (now {self.steps}), into {folder}.\n"
            self._begin(trace)
        return f"Start profiling into {folder}.\n"

    def _begin(self, trace: dict) -> None:
        options = jax.profiler.ProfileOptions()
        options.host_tracer_level = 2 if trace["host"] else 0
        options.python_tracer_level = 1 if trace["stack"] and trace["host"] else 0
        try:
            jax.profiler.start_trace(trace["dir"], create_perfetto_trace=True, profiler_options=options)
        except Exception as e:  # noqa: BLE001 - e.g. a trace this process started elsewhere
            raise RequestError(f"the profiler did not start: {type(e).__name__}: {e}", "output_dir") from None
        self._running = trace
        log.info("profiling into %s%s", trace["dir"],
                 f" for {trace['left']} forward steps" if trace["left"] is not None else " until /stop_profile")

    def stop(self) -> str:
        """Stop the trace (or disarm one waiting for its step) and write it; the answer's message. A stop that
        comes just after a trace's ``num_steps`` stopped it (the two race) reports that trace, once."""
        with self._lock:
            if self._armed is not None:
                self._armed = None
                return "Profiling disarmed before its start step.\n"
            if self._running is None:
                done, self._done = self._done, None
                if isinstance(done, Exception):
                    raise done
                if done is None:
                    raise RequestError("Profiling is not in progress. Call /start_profile first.", None)
                return f"The trace had already stopped after its num_steps; it is under {done}/plugins/profile.\n"
            folder = self._end()
        return f"Stop profiling. The trace is under {folder}/plugins/profile.\n"

    def _end(self) -> str:
        """Stop the trace and write it (and the memory profile); a RequestError saying what failed, the profiler
        left free for the next trace."""
        trace, self._running = self._running, None
        try:
            jax.profiler.stop_trace()
            if trace["mem"]:
                jax.profiler.save_device_memory_profile(
                    os.path.join(trace["dir"], f"memory_profile-{trace['id']}.prof"))
        except Exception as e:  # noqa: BLE001 - a full disk, a folder removed meanwhile
            state = getattr(jax._src.profiler, "_profile_state", None)  # JAX leaves it started when writing fails
            if state is not None and hasattr(state, "reset"):
                state.reset()
            raise RequestError(f"the trace could not be written under {trace['dir']}: {type(e).__name__}: {e}",
                               "output_dir") from None
        log.info("profile written under %s", trace["dir"])
        return trace["dir"]

    def on_step(self) -> None:
        """The scheduler ran a forward step: start an armed trace at its step, stop a trace whose steps are done.
        Never raises (a profiler failure is logged; serving goes on)."""
        if self._armed is None and self._running is None:
            self.steps += 1
            return
        with self._lock:
            self.steps += 1
            try:
                if self._running is not None and self._running["left"] is not None:
                    self._running["left"] -= 1
                    if self._running["left"] <= 0:
                        try:
                            self._done = self._end()
                        except RequestError as e:
                            self._done = e
                            raise
                if self._armed is not None and self.steps >= self._armed["at"]:
                    trace, self._armed = self._armed, None
                    self._begin(trace)
            except Exception:  # noqa: BLE001 - the profiler never stops the server
                log.exception("profiling failed")
