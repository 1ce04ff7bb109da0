"""From ServerArgs to a running scheduler: tokenizer, model, mesh, KV budget, runner, warmup. Shared by the HTTP
server (``python -m specjax.serve``) and the offline ``specjax.Engine``.

KV budget (pages of ``--page-size`` tokens; one extra scratch page):
- ``--max-total-tokens N``: exactly N tokens of pages.
- otherwise ``--mem-fraction-static f``: on TPU/GPU, ``f * bytes_limit`` of each device minus that device's share of
  the weights, divided by the bytes of one page on one device (K/V of every layer, sharded over tp when the kv
  heads divide). On CPU there is no device limit: ``f`` of host RAM minus the weights, capped at
  ``max_running_requests * context_length`` and at CPU_MAX_POOL_TOKENS (CPU serving is for development).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import threading
import time
from importlib.metadata import PackageNotFoundError, version as package_version

import jax
import numpy as np

from specjax.config import ModelConfig
from specjax.head_weights import load_draft
from specjax.hub import default_smollm2_path, fetch_smollm2
from specjax.models import target
from specjax.platforms import use_device
from specjax.serve.runners.plain import PlainRunner
from specjax.serve.runners.spec import SpecRunner
from specjax.serve.scheduler import WEIGHTS_RELEASED, PriorityPolicy, Scheduler
from specjax.sharding import make_mesh
from specjax.host import device_bytes_limit
from specjax.speculative.tune import TreeChoice, this_machine, tuned_elsewhere
from specjax.weights import (WeightsError, hf_tensor, load_model, load_tokenizer, param_shardings,
                             resolve_model_path, stop_token_ids, with_hf_tensors)

from .args import ServerArgs
from .budget import TokenRatio
from .metrics import Metrics
from .request import RequestError, SamplingParams
from .sessions import SessionParams, Sessions
from .scoring import ScoreJob
from .watchdog import Watchdog

CONFIG_FILES = ("*.json", "tokenizer*", "*.model", "*.txt", "*.jinja")  # a hub model's files but its weights

log = logging.getLogger("specjax.serve")

CPU_MAX_POOL_TOKENS = 1 << 16
DEFAULT_MAX_RUNNING = 32
LONGER_CONTEXT_ENV = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"  # SGLang's name for the same override

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + "
          "m['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
BUILTIN_CHAT_TEMPLATES = {"chatml": CHATML, "qwen": CHATML, "llama-3-instruct": LLAMA3, "llama3": LLAMA3}


def warn_if_tuned_elsewhere(head: str, dtype: str | None) -> None:
    """Say so when the head's tree table was measured on another kind of machine: the trees it chose follow that
    machine's step costs, so the smallest tree that paid there runs instead (``tune._smallest_paying``; the live
    accept length re-decides it, the costs stay the table's)."""
    found = tuned_elsewhere(head, dtype)
    if found is None:
        return
    cpu, vector, accelerator = this_machine()
    here = accelerator or f"a CPU ({cpu}, {vector or 'neither AVX-512 nor AVX2'})"
    log.warning("the tree table %s was measured on %s, and this is %s: its step costs may not hold here, so the "
                "smallest tree that paid there runs per batch size; `python -m specjax.bench tune --draft %s` "
                "measures this machine's", found[0], found[1], here, head)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="[%(asctime)s %(name)s] %(message)s", datefmt="%H:%M:%S")
    log.setLevel(getattr(logging, level.upper(), logging.INFO))


def _given_chat_template(args: ServerArgs) -> str | None:
    """The template ``--chat-template`` names (a file's text or a built-in), None without the flag; read before the
    model loads, so that a wrong name is said at once."""
    if not args.chat_template:
        return None
    if os.path.isfile(args.chat_template):
        with open(args.chat_template) as f:
            text = f.read()
        if args.chat_template.endswith(".json"):  # an HF tokenizer_config.json-style file
            text = json.loads(text).get("chat_template", text)
        return text
    if args.chat_template in BUILTIN_CHAT_TEMPLATES:
        return BUILTIN_CHAT_TEMPLATES[args.chat_template]
    raise ValueError(f"--chat-template {args.chat_template!r} is neither a file nor a built-in name "
                     f"({', '.join(sorted(BUILTIN_CHAT_TEMPLATES))})")


def _resolve_chat_template(given: str | None, tokenizer) -> str:
    if given is not None:
        return given
    tmpl = getattr(tokenizer, "chat_template", None)
    if tmpl:
        return tmpl
    log.warning("the tokenizer has no chat template and --chat-template is not set; /v1/chat/completions uses ChatML")
    return CHATML


def _kv_budget_tokens(args: ServerArgs, param_bytes: int, page_bytes_per_device: int, max_running: int,
                      context_length: int, bytes_limit: int | None) -> int:
    if args.max_total_tokens:
        return args.max_total_tokens
    if bytes_limit:
        avail = args.mem_fraction_static * bytes_limit - param_bytes
        tokens = int(max(avail, 0) // page_bytes_per_device) * args.page_size
    else:
        try:
            host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            host = 8 << 30
        avail = args.mem_fraction_static * host - param_bytes
        tokens = int(max(avail, 0) // page_bytes_per_device) * args.page_size
        tokens = min(tokens, max_running * context_length, CPU_MAX_POOL_TOKENS)
    if tokens < args.page_size * 2:
        raise MemoryError(f"no room for KV pages: --mem-fraction-static {args.mem_fraction_static} leaves "
                          f"{tokens} tokens after the weights; raise it or set --max-total-tokens")
    return tokens


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """The KV pool and slot shapes the server allocates (``build``; ``specjax.preflight serve`` checks them)."""
    context_length: int
    pages_per_seq: int
    max_running: int
    num_pages: int  # incl. the scratch page
    prefill_chunk: int  # largest prompt chunk per prefill call
    page_bytes: int  # one page of K and V over every layer, on one device
    kv_layers: int


def check_context_length(args: ServerArgs, cfg) -> int:
    """The context length served: ``--context-length``, else the model's max_position_embeddings; longer than that
    is refused (positions past it were never trained) unless SGLang's override variable is set."""
    context_length = args.context_length or cfg.max_position_embeddings
    allow_longer = os.environ.get(LONGER_CONTEXT_ENV, "0") not in ("", "0", "false", "False")
    if context_length > cfg.max_position_embeddings and not allow_longer:
        raise ValueError(f"--context-length {context_length} is longer than the model's max_position_embeddings "
                         f"({cfg.max_position_embeddings}): positions past it were never trained and give wrong "
                         f"outputs; set {LONGER_CONTEXT_ENV}=1 to allow it anyway (as SGLang)")
    return context_length


def plan_pool(args: ServerArgs, cfg, draft_layers: int | None, param_bytes: int, bytes_limit: int | None) -> PoolPlan:
    """Size the KV pool: ``draft_layers`` is the draft's cache layers when speculating (None: plain decoding),
    ``param_bytes`` the weights on one device, ``bytes_limit`` one device's memory (None: CPU, host RAM)."""
    context_length = check_context_length(args, cfg)
    w = args.speculative_tokens_per_step if draft_layers is not None else 1
    z = args.page_size
    pages_per_seq = -(-(context_length + w) // z)
    max_running = args.max_running_requests or DEFAULT_MAX_RUNNING
    kv_layers = cfg.num_layers + (draft_layers or 0)
    kv_shard = args.tp_size if cfg.num_kv_heads % args.tp_size == 0 else 1
    page_bytes = 2 * kv_layers * z * cfg.num_kv_heads * cfg.head_dim * np.dtype(cfg.dtype).itemsize // kv_shard
    tokens = _kv_budget_tokens(args, param_bytes, page_bytes, max_running, context_length, bytes_limit)
    num_pages = tokens // z + 1  # + the scratch page
    if args.max_running_requests is None:
        max_running = max(1, min(max_running, num_pages - 1))
    chunk = args.chunked_prefill_size if args.chunked_prefill_size and args.chunked_prefill_size > 0 else \
        context_length
    return PoolPlan(context_length, pages_per_seq, max_running, num_pages, chunk, page_bytes, kv_layers)


def version() -> str:
    try:
        return package_version("specjax")
    except PackageNotFoundError:
        return "0.0.0"


@dataclasses.dataclass
class Backend:
    """Everything the HTTP layer and the offline engine share."""
    args: ServerArgs
    model_folder: str
    tokenizer_folder: str
    tokenizer: object
    cfg: object
    scheduler: Scheduler
    chat_template: str
    context_length: int
    spec: bool
    metrics: Metrics
    startup_s: float = 0.0
    weight_version: str = "default"  # SGLang's label of the weights served (``update_weights_from_disk``)
    _update_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)
    sessions: Sessions = dataclasses.field(default_factory=Sessions)  # SGLang's open sessions (``serve.sessions``)

    def server_info(self) -> dict:
        """/get_server_info and ``Engine.get_server_info``: the effective arguments (no api key), the version and
        the scheduler's state."""
        info = {k: v for k, v in dataclasses.asdict(self.args).items() if k != "api_key"}
        pool_tokens = self.scheduler.pool.capacity * self.scheduler.page_size
        info.update(version=version(), context_length=self.context_length,
                    max_total_num_tokens=pool_tokens,  # SGLang's two limits: the KV pool, the longest prompt
                    max_req_input_len=self.scheduler.max_prompt_len(),
                    internal_states=[self.scheduler.stats()], startup_seconds=round(self.startup_s, 2))
        return info

    def text_tokenizer(self, param: str | None = "text"):
        """The tokenizer, or a RequestError (400) for a request that needs text on a server without one
        (``--skip-tokenizer-init``, as SGLang refuses it)."""
        if self.tokenizer is None:
            raise RequestError("this server was started with --skip-tokenizer-init: it has no tokenizer, so it takes "
                               "token ids (input_ids) and answers with output_ids, never text; start it without the "
                               "flag to send text", param=param)
        return self.tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.text_tokenizer()(text, add_special_tokens=add_special_tokens)["input_ids"])

    def render_chat(self, messages: list[dict], template_kwargs: dict | None = None) -> str:
        tokenizer = self.text_tokenizer("messages")
        try:
            return tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                 add_generation_prompt=True, **(template_kwargs or {}))
        except Exception as e:  # noqa: BLE001 - a template error is the request's fault (bad roles, etc.)
            raise RequestError(f"the chat template could not render these messages: {type(e).__name__}: {e}",
                               param="messages") from None

    def session_prompt(self, session_params, ids: list[int]):
        """(the prompt, a function recording each submitted request in its session, where ``replace`` takes effect)
        of a request with SGLang's ``session_params`` (``serve.sessions``); (``ids``, a no-op) without. A request
        appended to a session starts without the BOS its tokenizer puts before every text (SGLang trims it too),
        and only then."""
        if session_params is None:
            return ids, lambda req: None
        sp = SessionParams.of(session_params)
        session = self.sessions.get(sp.id)
        full, parent = session.prompt(sp, ids, self._leading_bos)
        return full, session.recorder(sp, parent, self.scheduler.abort)

    @functools.cached_property
    def _leading_bos(self) -> int | None:
        """The BOS id the tokenizer puts before every text, else None (the tokenizer never changes)."""
        tok = self.tokenizer
        return tok.bos_token_id if tok is not None and tok("")["input_ids"][:1] == [tok.bos_token_id] else None

    def prepare_prompts(self, prompts: list[list[int]], session_params=None) -> tuple[list[list[int]], list]:
        """The prompts of a generate call as served: each continued in its session (``session_params``: one mapping
        for every prompt, or a list of one per prompt; ``session_prompt``) and cut to fit (``fit_prompt``); and per
        prompt the function that records its submitted request in the session (a no-op without one)."""
        per = session_params if isinstance(session_params, list) else [session_params] * len(prompts)
        if len(per) != len(prompts):
            raise RequestError(f"{len(per)} session_params for {len(prompts)} prompts", "session_params")
        served, recorders = [], []
        for s, ids in zip(per, prompts):
            full, record = self.session_prompt(s, ids)
            served.append(self.fit_prompt(full))
            recorders.append(record)
        return served, recorders

    def fit_prompt(self, ids: list[int]) -> list[int]:
        """``ids``, or with ``--allow-auto-truncate`` their first ``max_req_input_len`` when longer (SGLang keeps the
        start too, with a warning); a longer prompt without the flag is the scheduler's error."""
        limit = self.scheduler.max_prompt_len()
        if not self.args.allow_auto_truncate or len(ids) <= limit:
            return ids
        log.warning("the prompt (%d tokens) is longer than the server takes (%d tokens: context %d, KV pool %d); "
                    "keeping its first %d tokens (--allow-auto-truncate)", len(ids), limit, self.context_length,
                    self.scheduler.pool.capacity * self.scheduler.page_size, limit)
        return list(ids[:limit])

    def check_output_budget(self, prompt_tokens: int, max_new_tokens: int, param: str) -> None:
        """An explicit output limit that cannot fit the context is a 400 naming the limit (as SGLang, vLLM and the
        OpenAI API answer), not silently clamped; with ``--allow-auto-truncate`` it is lowered to fit (by the
        scheduler), as SGLang does. A prompt that alone fills the context is the scheduler's error."""
        if prompt_tokens < self.context_length < prompt_tokens + max_new_tokens:
            if self.args.allow_auto_truncate:
                log.warning("max_new_tokens %d lowered to %d: the context is %d tokens (--allow-auto-truncate)",
                            max_new_tokens, self.context_length - prompt_tokens, self.context_length)
                return
            raise RequestError(f"this model's maximum context length is {self.context_length} tokens, but "
                               f"{prompt_tokens + max_new_tokens} were requested ({prompt_tokens} in the prompt, "
                               f"{max_new_tokens} for the output); lower {param} to at most "
                               f"{self.context_length - prompt_tokens}", param=param,
                               code="context_length_exceeded")

    def check_request(self, ids: list[int], sp: SamplingParams, max_new_given: bool,
                      param: str = "max_new_tokens") -> None:
        """What a prompt and its parameters must satisfy beyond their own ranges, for every front end: an explicit
        output limit that fits the context, a logprob_start_len inside the prompt (SGLang refuses it too), and
        token_ids_logprob only with return_logprob (SGLang ignores it otherwise)."""
        if max_new_given:
            self.check_output_budget(len(ids), sp.max_new_tokens, param)
        if sp.stop:  # SGLang refuses stop strings without a tokenizer too
            self.text_tokenizer("stop")
        if sp.token_ids_logprob and not sp.return_logprob:  # here: the request's fields may set either
            raise RequestError("token_ids_logprob needs return_logprob: true", param="token_ids_logprob")
        if sp.return_logprob and sp.logprob_start_len >= len(ids):
            raise RequestError(f"logprob_start_len {sp.logprob_start_len} must be smaller than the prompt's "
                               f"{len(ids)} tokens", param="logprob_start_len")

    def submit(self, ids, params: SamplingParams, sink, rid=None, seed=None, group=None, priority=None):
        return self.scheduler.submit(ids, params, sink, rid=rid, seed=seed, group=group, priority=priority)

    def warmup(self) -> float:
        """Compile the common shapes, then run one request end to end. Returns seconds."""
        t0 = time.perf_counter()
        runner = self.scheduler.runner
        if hasattr(runner, "warmup"):
            self.scheduler.call(lambda: setattr(self.scheduler, "state", runner.warmup(self.scheduler.state)),
                                timeout=3600)
        done = threading.Event()
        sp = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
        ids = self.encode("Hello, warm up.")[:8] if self.tokenizer is not None else [0]
        self.submit(ids or [0], sp,
                    lambda ev: done.set() if ev["finished"] else None, rid="warmup")
        done.wait(3600)
        self.scheduler.flush_cache()
        return time.perf_counter() - t0

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 abort_all_requests: bool = False, weight_version: str | None = None,
                                 flush_cache: bool = True) -> tuple[bool, str, int]:
        """SGLang's weight update: the target's weights from ``model_path`` (a folder or a hub id of the same
        architecture and shapes), loaded while serving goes on; then admission pauses, the running requests finish
        (or are aborted first, ``abort_all_requests``), the weights are swapped and the prefix cache dropped
        (``flush_cache``), and admission resumes. The draft head and the tokenizer are kept; the served name
        becomes ``model_path``, as SGLang's does. Returns (success, message, requests paused: 0, as nothing is
        retracted); on failure the old weights keep serving."""
        if self.scheduler.weights_released:
            return False, WEIGHTS_RELEASED, 0
        if load_format not in (None, "auto", "safetensors"):
            return False, f"load_format {load_format!r} is not supported (auto / safetensors)", 0
        if not self._update_lock.acquire(blocking=False):
            return False, "another weight update is in progress", 0
        try:
            folder = resolve_model_path(model_path, cache_dir=self.args.download_dir)
            why = self._shape_mismatch(ModelConfig.from_pretrained(folder, dtype=self.cfg.dtype))
            if why:  # said before the weights load
                return False, f"{model_path} is not the served model's shape: {why}", 0
            _, params = load_model(folder, dtype=self.cfg.dtype, mesh=self.scheduler.runner.mesh, layout="decode")
            self._swap_when_drained(params, abort_all_requests, flush_cache)
        except Exception as e:  # noqa: BLE001 - a failed update is the answer's message; the old weights serve on
            return False, f"failed to update the weights from {model_path}: {type(e).__name__}: {e}", 0
        else:
            args = self.args  # the tokenizer stays; SGLang names the served model after the new path
            args.tokenizer_path = args.tokenizer_path or args.model_path
            args.model_path, args.served_model_name, self.model_folder = model_path, model_path, folder
            message = "Succeeded to update model weights."
            if weight_version is not None:
                self.weight_version = weight_version
                message += f" Weight version updated to {weight_version}."
        finally:
            self._update_lock.release()
        log.info("weights updated from %s (weight version %s)", folder, self.weight_version)
        return True, message, 0

    def update_weights_from_tensor(self, named_tensors, load_format: str | None = None,
                                   flush_cache: bool = True) -> tuple[bool, str]:
        """SGLang's in-process weight update (RL trainers hand their tensors over): (name, tensor) pairs in the
        checkpoint's names (any subset; numpy, jax or torch tensors) replace what they name in the served target
        (``weights.with_hf_tensors``), then swap as ``update_weights_from_disk`` does. Returns (success, message);
        on failure the old weights keep serving."""
        if self.scheduler.weights_released:
            return False, WEIGHTS_RELEASED
        if load_format not in (None, "direct"):
            return False, f"load_format {load_format!r} is not supported (None or 'direct': (name, tensor) pairs)"
        if not self._update_lock.acquire(blocking=False):
            return False, "another weight update is in progress"
        try:
            params = with_hf_tensors(self.scheduler.runner.target_params, self.cfg, list(named_tensors))
            self._swap_when_drained(params, False, flush_cache)
        except Exception as e:  # noqa: BLE001 - a failed update is the answer's message; the old weights serve on
            return False, f"failed to update the weights from tensors: {type(e).__name__}: {e}"
        finally:
            self._update_lock.release()
        log.info("weights updated from tensors")
        return True, "Succeeded to update model weights."

    def score_job(self, query, items, label_token_ids, apply_softmax: bool = False,
                  item_first: bool = False) -> ScoreJob:
        """SGLang's scoring arguments as a ``scoring.ScoreJob`` of this model and scheduler."""
        sched = self.scheduler
        return ScoreJob.make(self.encode, self.cfg.vocab_size, sched.page_size, sched.radix.enabled, query, items,
                             label_token_ids, apply_softmax, item_first)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """SGLang's: the served target's tensor of checkpoint name ``name`` as float32 nested lists, its first
        ``truncate_size`` entries along the first axis (to check a weight update); a RequestError for a name the
        model does not use."""
        if self.scheduler.weights_released:
            raise RequestError(WEIGHTS_RELEASED, param="name")
        if truncate_size < 0:
            raise RequestError(f"truncate_size must be >= 0, got {truncate_size}", param="truncate_size")
        try:
            return hf_tensor(self.scheduler.runner.target_params, self.cfg, name, rows=truncate_size).tolist()
        except WeightsError as e:
            raise RequestError(str(e), param="name") from None

    def _shape_mismatch(self, cfg: ModelConfig) -> str:
        """What differs between a checkpoint's config and the served one's that the compiled programs depend on
        ('' when nothing: stop ids may differ, and the position limit where it still covers the served context)."""
        served = self.cfg
        same = dataclasses.replace(cfg, bos_token_id=served.bos_token_id, eos_token_ids=served.eos_token_ids,
                                   max_position_embeddings=served.max_position_embeddings)
        diff = [f"{f.name} {getattr(cfg, f.name)!r} (serving {getattr(served, f.name)!r})"
                for f in dataclasses.fields(cfg) if getattr(same, f.name) != getattr(served, f.name)]
        if cfg.max_position_embeddings < self.context_length:
            diff.append(f"max_position_embeddings {cfg.max_position_embeddings} (the served context is "
                        f"{self.context_length})")
        return ", ".join(diff)

    def _swap_when_drained(self, params, abort: bool, flush_cache: bool) -> None:
        """Pause admission, let the running requests finish (abort them first with ``abort``), swap the target's
        weights on the scheduler thread, drop the cached prefixes, resume. While generation is paused
        (``pause_generation``) the swap is at once: requests paused in place go on with the new weights when
        generation continues (their earlier K/V the old weights', as in SGLang)."""
        sched, wait = self.scheduler, 3600.0  # an iteration may compile or prefill a long chunk

        def pause():
            sched.admission_paused = True
            return [r.rid for r in sched.slots if r is not None] + ([r.rid for r in sched.waiting] if abort else [])
        try:
            rids = sched.call(pause, timeout=wait)
            for rid in rids if abort else ():
                sched.abort(rid)
            while not sched.call(lambda: sched.drained() or sched.generation_paused, timeout=wait):
                time.sleep(0.02)
            sched.call(lambda: sched.set_target_params(params, flush_cache), timeout=wait)
        finally:
            sched.call(lambda: setattr(sched, "admission_paused", False), timeout=wait)

    def pause_generation(self, mode: str = "abort") -> None:
        """SGLang's (``Scheduler.pause_generation``): stop generating until ``continue_generation``."""
        self.scheduler.pause_generation(mode)

    def continue_generation(self) -> None:
        self.scheduler.continue_generation()

    def shutdown(self) -> None:
        self.scheduler.shutdown()


def load_target(args: ServerArgs, folder: str, mesh):
    """The served target's (config, decode-layout params): the folder's checkpoint, or with ``--load-format dummy``
    random weights of its config (SGLang's: profiling and benchmarks without downloading weights)."""
    dtype = None if args.dtype == "auto" else args.dtype
    if args.load_format != "dummy":
        return load_model(folder, dtype=dtype, mesh=mesh, layout="decode")
    cfg = ModelConfig.from_pretrained(folder, dtype=dtype)
    init = jax.jit(lambda key: target.init_params(cfg, key),  # drawn where they live: no whole copy on one device
                   out_shardings=param_shardings(cfg, mesh) if mesh is not None else None)
    return cfg, target.unstack_layers(init(jax.random.PRNGKey(args.random_seed)))


def _scheduler_options(args: ServerArgs) -> dict:
    """The Scheduler's options that come straight from the server arguments."""
    return dict(chunked_prefill_size=args.chunked_prefill_size, enable_radix_cache=not args.disable_radix_cache,
                schedule_policy=args.schedule_policy, random_seed=args.random_seed,
                overlap_schedule=not args.disable_overlap_schedule, priority=PriorityPolicy.of(args),
                refuse_priority=args.abort_on_priority_when_disabled, max_queued=args.max_queued_requests,
                stream_interval=args.stream_interval,
                log_requests=args.log_requests_level if args.log_requests else None,
                token_ratio=TokenRatio.of(args.schedule_conservativeness), max_prefill_tokens=args.max_prefill_tokens,
                auto_truncate=args.allow_auto_truncate,
                decode_log_interval=args.decode_log_interval,
                watchdog=Watchdog(args.watchdog_timeout) if args.watchdog_timeout > 0 else None)


def make_mesh_for(args: ServerArgs):
    if args.tp_size * args.dp_size == 1:
        return None
    devs = jax.devices()
    n = args.tp_size * args.dp_size
    if len(devs) < n:
        raise ValueError(f"--tp-size {args.tp_size} x --dp-size {args.dp_size} needs {n} devices; "
                         f"{len(devs)} available ({devs[0].platform})")
    return make_mesh(dp=args.dp_size, tp=args.tp_size, devices=devs[:n])


def build(args: ServerArgs, *, model=None, draft=None) -> Backend:
    """Load everything and start the scheduler thread (no warmup). ``model`` = (cfg, params) and ``draft`` =
    (draft_cfg, draft_params, vocab map) skip loading from the paths (tests, in-memory heads)."""
    t0 = time.perf_counter()
    use_device(args.device)
    chat_template = _given_chat_template(args)
    for line in args.notices():
        log.warning(line)
    if args.speculative_algorithm and not args.accept_thresholds.lossless:
        log.warning("relaxed acceptance (--speculative-accept-threshold-single %g, -acc %g): sampled requests accept "
                    "more draft tokens and no longer follow the target's distribution exactly; greedy ones are exact",
                    args.speculative_accept_threshold_single, args.speculative_accept_threshold_acc)
    if args.model_path == default_smollm2_path() and not os.path.isdir(args.model_path):
        log.info("first use of the default model: fetching and converting SmolLM2-135M-Instruct into %s",
                 args.model_path)
        fetch_smollm2(args.model_path)
    hub = dict(revision=args.revision, cache_dir=args.download_dir)
    folder = resolve_model_path(args.model_path, **hub, **({"allow_patterns": CONFIG_FILES}
                                                            if args.load_format == "dummy" else {}))
    if model is None:  # a folder that is no supported model (a draft head, say) is said so before its tokenizer
        check_context_length(args, ModelConfig.from_pretrained(folder))
    tok_folder = resolve_model_path(args.tokenizer_path, **hub) \
        if args.tokenizer_path and not args.skip_tokenizer_init else folder
    tokenizer = None if args.skip_tokenizer_init else \
        load_tokenizer(tok_folder, trust_remote_code=args.trust_remote_code)
    mesh = make_mesh_for(args)
    cfg, params = model if model is not None else load_target(args, folder, mesh)
    spec = args.speculative_algorithm is not None and not args.speculation_off_reason
    if args.speculative_algorithm and not spec:
        log.warning("serving plain decoding: %s; give --speculative-num-steps/-eagle-topk/-num-draft-tokens to "
                    "speculate anyway", args.speculation_off_reason)
    if spec and draft is None:
        draft = load_draft(args.speculative_draft_model_path, args.speculative_algorithm, cfg,
                           token_map=args.speculative_token_map)
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params)) // max(1, args.tp_size)
    args.resolve_page_size(cfg.head_dim, cfg.dtype, jax.default_backend())
    plan = plan_pool(args, cfg, getattr(draft[0], "num_layers", 1) if spec else None, param_bytes,
                     device_bytes_limit())
    context_length, pages_per_seq, max_running, num_pages, chunk = (
        plan.context_length, plan.pages_per_seq, plan.max_running, plan.num_pages, plan.prefill_chunk)
    z = args.page_size
    if spec:
        draft_cfg, draft_params, vmap = draft
        runner = SpecRunner(cfg, params, args.speculative_algorithm, draft_cfg, draft_params, vmap,
                            num_steps=args.speculative_num_steps, topk=args.speculative_eagle_topk,
                            num_draft_tokens=args.speculative_num_draft_tokens, max_batch=max_running,
                            pages_per_seq=pages_per_seq, page_size=z, num_pages=num_pages,
                            attention_impl=args.attention_impl, prefill_chunk=chunk, mesh=mesh,
                            batch_shapes=TreeChoice.measured(args.speculative_tree_costs)
                            if args.speculative_tree_costs else args.speculative_batch_shapes,
                            thresholds=args.accept_thresholds)
        if args.speculative_tree_costs:
            log.info("tree per running batch size, re-decided from the live accept length (from %s/"
                     "speculative_tune.json): %s", args.speculative_draft_model_path,
                     ", ".join(f">={b}: {s} (step cost {tau / sp:.2f} plain steps, tuned accept length {tau:.2f})"
                               for b, (s, tau, sp) in sorted(args.speculative_tree_costs.items())))
        elif args.speculative_batch_shapes:
            log.info("tree shape per running batch size (from %s/speculative_tune.json; plain = target-only steps): "
                     "%s", args.speculative_draft_model_path,
                     ", ".join(f">={b}: {'plain' if s is None else s}"
                               for b, s in sorted(args.speculative_batch_shapes.items())))
        if args.speculative_tree_costs or args.speculative_batch_shapes:
            warn_if_tuned_elsewhere(args.speculative_draft_model_path, args.dtype)
    else:
        runner = PlainRunner(cfg, params, max_batch=max_running, pages_per_seq=pages_per_seq, page_size=z,
                             num_pages=num_pages, max_prefill_tokens=chunk, attention_impl=args.attention_impl,
                             mesh=mesh)
    eos = stop_token_ids(folder, cfg, tokenizer)
    metrics = Metrics(enabled=args.enable_metrics, model_name=args.model_name)
    scheduler = Scheduler(runner, tokenizer, context_length=context_length, vocab_size=cfg.vocab_size, eos_ids=eos,
                          spec=spec, metrics=metrics, **_scheduler_options(args))
    scheduler.start()
    log.info("loaded %s (%s, %d layers, dtype %s) in %.1fs; KV pool %d pages x %d tokens, %d slots, context %d%s",
             folder, cfg.architecture, cfg.num_layers, cfg.dtype, time.perf_counter() - t0, num_pages - 1, z,
             max_running, context_length, f", {args.speculative_algorithm}" if spec else "")
    return Backend(args=args, model_folder=folder, tokenizer_folder=tok_folder, tokenizer=tokenizer, cfg=cfg,
                   scheduler=scheduler,
                   chat_template="" if tokenizer is None else _resolve_chat_template(chat_template, tokenizer),
                   context_length=context_length, spec=spec, metrics=metrics,
                   startup_s=time.perf_counter() - t0)
