"""ServerArgs: the one set of options shared by the command line (``python -m specjax.serve``) and the offline
``specjax.Engine(**kwargs)``. Names, aliases and meanings follow SGLang; defaults are specjax's where SGLang's make no
sense on TPU/CPU. ``build_parser`` makes the argparse front; ``ServerArgs.validate`` gives every clear error."""

from __future__ import annotations

import argparse
import dataclasses
import logging

from specjax import kv_cache
from specjax.cli import add_options, check_field_types, option
from specjax.config import ConfigError
from specjax.head_weights import check_token_map_use
from specjax.heads import DEFAULT_ALGORITHM, DEFAULT_HEAD, default_head_available
from specjax.hub import default_smollm2_path
from specjax.speculative.tree import validate as validate_tree
from specjax.speculative.tune import TuneError, load_tune, load_tune_costs, shape_for, table_path
from specjax.speculative.verify import Thresholds

from .budget import TokenRatio

log = logging.getLogger("specjax.serve")

SPEC_ALGORITHMS = ("EAGLE", "EAGLE3")
TREE_FIELDS = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
# SGLang flags that only mean something on CUDA: accepted (so a copied SGLang command still starts), then ignored.
GPU_ONLY_FLAGS = ("cuda_graph_max_bs", "disable_cuda_graph", "disable_cuda_graph_padding", "enable_torch_compile",
                  "torch_compile_max_bs", "attention_backend")
# SGLang's admission orders (priority: --enable-priority-scheduling)
SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random")
# --help sections (argument groups), in the order of the fields.
_MEM, _SPEC, _GPU = "memory and scheduling", "speculative decoding", "CUDA-only SGLang flags (accepted, no effect)"


class ArgsError(ConfigError):
    """An invalid combination of server arguments; the message says what to change."""


@dataclasses.dataclass
class ServerArgs:
    model_path: str = option("", flags=("--model",), group="model",
                             help="HF-format model folder (config.json + *.safetensors) or hub id (none, and no "
                                  "speculative flag: the default pair, SmolLM2-135M-Instruct with the packaged "
                                  "EAGLE3 head)")
    tokenizer_path: str | None = option(None, group="model", help="tokenizer folder (default: the model folder)")
    revision: str | None = option(None, group="model", help="the hub revision (branch, tag or commit) of a model "
                                  "or tokenizer given as a hub id (default: the main branch)")
    download_dir: str | None = option(None, group="model", help="where hub models are downloaded (default: the "
                                      "Hugging Face cache)")
    load_format: str = option("auto", group="model", choices=["auto", "safetensors", "dummy"], help="the target's "
                              "weights: its safetensors (auto), or dummy: random weights of its config.json "
                              "(profiling; the output is noise)")
    served_model_name: str | None = option(None, group="model",
                                           help="name reported by /v1/models (default: model path)")
    chat_template: str | None = option(None, group="model",
                                       help="Jinja chat template file, or a built-in name (chatml, llama-3-instruct);"
                                            " default: the tokenizer's own template")
    trust_remote_code: bool = option(False, group="model", help="allow custom tokenizer code from the hub")
    skip_tokenizer_init: bool = option(False, group="model", help="load no tokenizer (SGLang's flag): requests give "
                                       "input_ids and get output_ids, no text; text prompts, chat, stop strings "
                                       "and the OpenAI routes are refused with a 400")
    dtype: str = option("auto", group="model", choices=["auto", "bfloat16", "float16", "float32"],
                        help="parameter/compute dtype; auto = the checkpoint's torch_dtype")
    context_length: int | None = option(None, group="model", help="max tokens per sequence (prompt + output); "
                                                                  "default: the model's max_position_embeddings, "
                                                                  "which it may not exceed (unless "
                                                                  "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1)")
    host: str = option("127.0.0.1", group="http", help="address to listen on (0.0.0.0 for every interface)")
    port: int = option(30000, group="http", help="HTTP port")
    api_key: str | None = option(None, group="http",
                                 help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    log_level: str = option("info", group="http", choices=["debug", "info", "warning", "error", "critical"],
                            type=str.lower, help="server and access log verbosity (any case, as SGLang takes it)")
    enable_metrics: bool = option(False, group="http", help="serve Prometheus metrics at /metrics")
    watchdog_timeout: float = option(300.0, group="http", help="end the server (exit code 1, every thread's stack "
                                     "printed) when one scheduler iteration (admission, prefill, a decode step) runs "
                                     "longer than this many seconds: a hung device, which a supervisor then "
                                     "restarts; warmup and weight loads are not timed; 0: off")
    decode_log_interval: int = option(40, group="http", help="log a \"Decode batch.\" line (running and waiting "
                                      "requests, KV tokens held, throughput) every N decode steps at --log-level "
                                      "info, as SGLang; 0: none (a \"Prefill batch.\" line follows every prefill "
                                      "round)")
    log_requests: bool = option(False, group="http", help="log every request when it finishes (SGLang's flag)")
    log_requests_level: int = option(2, group="http", choices=[0, 1, 2, 3], help="with --log-requests: 0 its "
                                     "metadata, 1 and its sampling parameters, 2 and its prompt and output text "
                                     "(2048 characters of each), 3 all of them")
    skip_server_warmup: bool = option(False, group="http", help="start without compiling the common shapes")
    incremental_streaming_output: bool = option(
        False, group="http", help="streamed /generate and Engine chunks carry only their new text and token ids "
                                  "(SGLang's flag); by default each chunk carries the whole output so far")
    stream_interval: int = option(1, group="http", help="stream a request's output every this many tokens (its first "
                                  "token at once); larger values cost the host less per token (SGLang's flag)")
    max_request_bytes: int = option(8 << 20, group="http",
                                    help="largest request body accepted; a larger one gets 413 before it is read")
    http_header_timeout: float = option(10.0, group="http", help="seconds a client has to send a request's line and "
                                                                 "headers before the connection is closed")
    http_idle_timeout: float = option(30.0, group="http", help="seconds of silence allowed on a kept-alive "
                                                               "connection between requests, and inside a request "
                                                               "body (then 408)")
    allow_auto_truncate: bool = option(False, group="http", help="a prompt longer than the server takes is cut to "
                                       "its first max_req_input_len tokens, and a max_new_tokens past the context "
                                       "or the KV pool is lowered to fit, with a warning (SGLang's flag); by "
                                       "default both are refused with a 400")
    device: str | None = option(None, group="parallelism", choices=["cpu", "cuda", "gpu", "tpu"],
                                help="the JAX platform to run on (SGLang's flag; default: JAX's own choice, an "
                                     "accelerator when one is installed, else the CPU)")
    tp_size: int = option(1, flags=("--tp",), group="parallelism", help="tensor-parallel devices")
    dp_size: int = option(1, flags=("--dp",), group="parallelism",
                          help="data-parallel devices (the running batch is split over them)")
    mem_fraction_static: float = option(0.85, group=_MEM, help="fraction of device memory for weights + KV pages "
                                                               "(host RAM on CPU); ignored when --max-total-tokens "
                                                               "is set")
    max_total_tokens: int | None = option(None, group=_MEM,
                                          help="KV pool size in tokens (overrides the fraction)")
    max_running_requests: int | None = option(None, group=_MEM, help="slots in the running batch (default: 32, "
                                                                     "fewer if the KV pool is small)")
    max_queued_requests: int | None = option(None, group=_MEM, help="most requests waiting for a slot; one more is "
                                             "refused with a 503 (with priority scheduling: the least preferred "
                                             "waiting one, when the newcomer's priority is higher) (default: no "
                                             "limit)")
    chunked_prefill_size: int = option(512, group=_MEM, help="max prompt tokens computed per scheduler iteration, "
                                                             "so long prompts interleave with decoding (-1: whole "
                                                             "prompt at once)")
    max_prefill_tokens: int | None = option(None, group=_MEM, help="most prompt tokens one prefill round spends over "
                                            "all requests: a round takes the smaller of this and "
                                            "--chunked-prefill-size, as in SGLang (default: no limit beyond "
                                            "--chunked-prefill-size)")
    page_size: int | None = option(None, group=_MEM, help="tokens per KV page (radix cache granularity; default 16, on "
                                   "a TPU the smallest page that packs the pool's small head dims into 128-lane "
                                   "rows: 32 for bf16 at head dim 64)")
    schedule_policy: str = option("fcfs", group=_MEM, choices=list(SCHEDULE_POLICIES), help="order of admission: "
                                  "first come first served, longest cached prefix first, cached prefixes shared by "
                                  "the most waiting requests first (depth first), longest output (max_new_tokens) "
                                  "first, or a random order (--random-seed)")
    schedule_conservativeness: float = option(1.0, group=_MEM, help="KV pages are handed out as requests grow, and "
                                              "admission assumes each running request still emits 0.7 x this x its "
                                              "remaining max_new_tokens (falling to 14%% of that over 600 decode "
                                              "steps); when the pool runs dry anyway, requests are retracted and "
                                              "prefilled again later: raise it if that happens often (above ~1.43 "
                                              "it changes nothing more), lower it to admit more requests at once")
    enable_priority_scheduling: bool = option(False, group=_MEM, help="admit waiting requests by their `priority` "
                                              "(larger first), then by --schedule-policy (fcfs or lof); a request "
                                              "that cannot be admitted retracts running ones of a priority lower "
                                              "by more than --priority-scheduling-preemption-threshold")
    schedule_low_priority_values_first: bool = option(False, group=_MEM, help="with priority scheduling: smaller "
                                                      "`priority` values first")
    priority_scheduling_preemption_threshold: int = option(10, group=_MEM, help="how much higher a waiting "
                                                           "request's priority must be than a running one's to "
                                                           "retract it")
    default_priority_value: int | None = option(None, group=_MEM, help="the priority of requests that give none "
                                                "(default: the lowest)")
    abort_on_priority_when_disabled: bool = option(False, group=_MEM, help="without --enable-priority-scheduling, "
                                                   "refuse a request that gives a priority (by default it is "
                                                   "ignored)")
    disable_radix_cache: bool = option(False, group=_MEM, help="turn off prefix reuse between requests")
    enable_cache_report: bool = option(False, group=_MEM, help="report the prompt tokens found in the prefix cache in "
                                       "the OpenAI responses' usage.prompt_tokens_details.cached_tokens")
    disable_overlap_schedule: bool = option(False, group=_MEM, help="collect each decode step before launching the "
                                            "next (by default the host emits step N's tokens while the device runs "
                                            "step N+1)")
    random_seed: int = option(0, group=_MEM, help="seed for requests that bring none")
    attention_impl: str = option("auto", group=_MEM, choices=["auto", "xla", "pallas"],
                                 help="attention kernel: pallas (TPU), xla (reference), auto = pallas on TPU else xla")
    speculative_algorithm: str | None = option(None, group=_SPEC, type=str.upper, choices=list(SPEC_ALGORITHMS),
                                               help="EAGLE3 (aux-feature heads) or EAGLE (EAGLE-1/2 heads); unset = "
                                                    "plain decoding")
    speculative_draft_model_path: str | None = option(None, flags=("--speculative-draft-model",), group=_SPEC,
                                                      help="draft head folder (required with an algorithm)")
    speculative_num_steps: int | None = option(None, group=_SPEC, help="draft tree depth (default 5)")
    speculative_eagle_topk: int | None = option(None, group=_SPEC, help="branching per step; 1 = chain (default 4)")
    speculative_num_draft_tokens: int | None = option(None, group=_SPEC, help="tree size incl. root (default 8; "
                                                                             "with topk 1 it must be steps + 1)")
    speculative_token_map: str | None = option(None, group=_SPEC, help="FR-Spec hot-token list for EAGLE heads")
    disable_adaptive_speculation: bool = option(False, group=_SPEC,
                                                help="keep one tree shape at every batch size; by default, when no "
                                                     "tree flag is given and the head has a speculative_tune.json, "
                                                     "each step takes the shape tuned for the running batch size, "
                                                     "or a target-only step where the head's live accept length "
                                                     "does not pay for the tree's measured step cost")
    speculative_accept_threshold_single: float = option(
        1.0, group=_SPEC, help="sampled requests (temperature > 0) also accept a draft token whose target probability "
                               "is at least this (SGLang's relaxation; 1.0 = lossless, the target's distribution)")
    speculative_accept_threshold_acc: float = option(
        1.0, group=_SPEC, help="sampled requests accept a draft token with probability min(1, p / this) instead of "
                               "its target probability p (SGLang's relaxation; 1.0 = lossless)")
    # SGLang's CUDA-only flags: accepted so that a copied SGLang command still starts, then ignored (see notices()).
    cuda_graph_max_bs: int | None = option(None, group=_GPU, hidden=True)
    disable_cuda_graph: bool = option(False, group=_GPU, hidden=True)
    disable_cuda_graph_padding: bool = option(False, group=_GPU, hidden=True)
    enable_torch_compile: bool = option(False, group=_GPU, hidden=True)
    torch_compile_max_bs: int | None = option(None, group=_GPU, hidden=True)
    attention_backend: str | None = option(None, group=_GPU, hidden=True)

    def __post_init__(self):
        self.speculation_off_reason: str | None = None  # set when the head's tuned table says plain is faster
        # {batch size: tree shape or None (plain steps)} from the head's tune file, when no tree flag is given
        self.speculative_batch_shapes: dict[int, tuple[int, int, int] | None] | None = None
        # {batch size: (best tree, its tuned tau, its tuned speedup)}: the runner re-decides the table on live traffic
        self.speculative_tree_costs: dict[int, tuple[tuple[int, int, int], float, float]] | None = None
        if self.speculative_algorithm is not None:
            self.speculative_algorithm = str(self.speculative_algorithm).upper()
            self._tree_from_tune_file()
            # SGLang's defaults apply only when speculative decoding is on.
            if self.speculative_num_steps is None:
                self.speculative_num_steps = 5
            if self.speculative_eagle_topk is None:
                self.speculative_eagle_topk = 4
            if self.speculative_num_draft_tokens is None:
                self.speculative_num_draft_tokens = (self.speculative_num_steps + 1
                                                     if self.speculative_eagle_topk == 1 else 8)

    def _tree_from_tune_file(self) -> None:
        """No tree flag given: take the batch-1 shape that ``bench tune`` measured for this head, if it did."""
        if any(v is not None for v in (self.speculative_num_steps, self.speculative_eagle_topk,
                                       self.speculative_num_draft_tokens)):
            return
        try:
            table = load_tune(self.speculative_draft_model_path, dtype=self.dtype)
        except TuneError as e:
            log.warning("%s; using the default tree", e)
            return
        if not table:
            return
        shape = shape_for(table, 1) or next((s for _, s in sorted(table.items()) if s is not None), None)
        if not self.disable_adaptive_speculation:
            try:
                self.speculative_tree_costs = load_tune_costs(self.speculative_draft_model_path, self.dtype)
            except TuneError as e:
                log.warning("%s; the tuned shapes are kept fixed", e)
            if shape is not None and len(table) > 1:
                self.speculative_batch_shapes = table
        if shape is None and self.speculative_tree_costs:
            # plain decoding measured faster everywhere, on the tuning prompts: start with target-only steps and
            # let the live accept length turn the trees on where this traffic pays for them
            shape = shape_for({b: c[0] for b, c in self.speculative_tree_costs.items()}, 1)
        elif shape is None:
            self.speculation_off_reason = (f"`bench tune` measured plain decoding faster than every tree shape at "
                                           f"every batch size for this head on its machine "
                                           f"({table_path(self.speculative_draft_model_path, self.dtype)})")
            shape = shape_for(load_tune(self.speculative_draft_model_path, "best_speculative", self.dtype), 1)
        self.speculative_num_steps, self.speculative_eagle_topk, self.speculative_num_draft_tokens = shape

    @property
    def speculative_tokens_per_step(self) -> int:
        """Most tokens one step can emit per request (the page reserve ahead of each sequence)."""
        steps = [s[0] for s in (self.speculative_batch_shapes or {}).values() if s is not None]
        steps += [c[0][0] for c in (self.speculative_tree_costs or {}).values()]
        return max([self.speculative_num_steps, *steps]) + 1

    def use_default_pair(self) -> bool:
        """No model and no speculative flags: serve the default pair (SmolLM2-135M-Instruct with the EAGLE3 head
        shipped in the package, at its tuned tree shape). Returns whether it did."""
        if self.model_path or self.speculative_algorithm or self.speculative_draft_model_path \
                or not default_head_available():
            return False
        self.model_path = default_smollm2_path()
        self.speculative_algorithm = DEFAULT_ALGORITHM
        self.speculative_draft_model_path = DEFAULT_HEAD
        self.__post_init__()
        return True

    def validate(self) -> "ServerArgs":
        if not self.model_path and not self.use_default_pair():
            raise ArgsError("--model-path is required: a local folder with config.json and *.safetensors, or a hub id"
                            " (with no model and no speculative flags, the default pair is served: SmolLM2-135M-"
                            "Instruct + the packaged EAGLE3 head)")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ArgsError(f"--dtype must be one of auto, bfloat16, float16, float32 (got {self.dtype!r})")
        if not 1 <= self.port <= 65535:
            raise ArgsError(f"--port must be in 1..65535 (got {self.port})")
        if self.max_request_bytes < 1024:
            raise ArgsError(f"--max-request-bytes must be >= 1024 (got {self.max_request_bytes})")
        for name in ("http_header_timeout", "http_idle_timeout"):
            if not getattr(self, name) > 0:
                raise ArgsError(f"--{name.replace('_', '-')} must be > 0 seconds (got {getattr(self, name)})")
        if self.random_seed < 0:
            raise ArgsError(f"--random-seed must be >= 0 (got {self.random_seed})")
        if self.tp_size < 1 or self.dp_size < 1:
            raise ArgsError("--tp-size and --dp-size must be >= 1")
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ArgsError(f"--mem-fraction-static must be in (0, 1] (got {self.mem_fraction_static})")
        if self.stream_interval < 1:
            raise ArgsError("--stream-interval must be >= 1")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ArgsError("--max-queued-requests must be >= 1")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ArgsError("--max-running-requests must be >= 1")
        if self.page_size is not None and self.page_size < 1:
            raise ArgsError("--page-size must be >= 1")
        page = self.page_size or kv_cache.DEFAULT_PAGE_SIZE
        if self.max_total_tokens is not None and self.max_total_tokens < page:
            raise ArgsError(f"--max-total-tokens must hold at least one page ({page} tokens)")
        if self.context_length is not None and self.context_length < 2:
            raise ArgsError("--context-length must be >= 2")
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < 1:
            raise ArgsError(f"--max-prefill-tokens must be >= 1 (got {self.max_prefill_tokens})")
        if not self.watchdog_timeout >= 0:  # NaN too
            raise ArgsError(f"--watchdog-timeout must be >= 0 seconds, 0 for none (got {self.watchdog_timeout})")
        if self.decode_log_interval < 0:
            raise ArgsError(f"--decode-log-interval must be >= 0 (got {self.decode_log_interval})")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size == 0:
            raise ArgsError("--chunked-prefill-size must be positive, or -1 to disable chunking")
        if not self.schedule_conservativeness > 0:  # NaN too
            raise ArgsError(f"--schedule-conservativeness must be > 0 (got {self.schedule_conservativeness})")
        try:
            TokenRatio.of(self.schedule_conservativeness)  # SGLang's environment variables too
        except ValueError as e:
            raise ArgsError(str(e)) from None
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ArgsError(f"--schedule-policy must be one of {', '.join(SCHEDULE_POLICIES)} (got "
                            f"{self.schedule_policy!r}; priority is --enable-priority-scheduling)")
        if self.enable_priority_scheduling and self.schedule_policy not in ("fcfs", "lof"):
            raise ArgsError(f"--enable-priority-scheduling orders requests by priority, then by --schedule-policy fcfs "
                            f"or lof (got {self.schedule_policy!r}), as SGLang")
        if self.attention_impl not in ("auto", "xla", "pallas"):
            raise ArgsError(f"--attention-impl must be auto, xla or pallas (got {self.attention_impl!r})")
        if self.log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
            raise ArgsError(f"--log-level must be debug, info, warning, error or critical (got {self.log_level!r})")
        self._validate_speculative()
        return self

    def _validate_speculative(self) -> None:
        """The speculative flags. Without an algorithm (plain decoding) a head or tree flag would be ignored: refused,
        as ``python -m specjax.generate`` refuses them; the acceptance thresholds are checked either way."""
        for name in ("speculative_accept_threshold_single", "speculative_accept_threshold_acc"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ArgsError(f"--{name.replace('_', '-')} must be in [0, 1] (got {v})")
        algo = self.speculative_algorithm
        try:
            check_token_map_use(algo, self.speculative_token_map)
        except ValueError as e:
            raise ArgsError(str(e)) from None
        if algo is None:
            if self.speculative_draft_model_path:
                raise ArgsError("--speculative-draft-model-path is set but --speculative-algorithm is not; "
                                "add --speculative-algorithm EAGLE3 (or EAGLE)")
            given = [f"--{name.replace('_', '-')}" for name in TREE_FIELDS if getattr(self, name) is not None]
            if given:
                raise ArgsError(f"tree flags ({', '.join(given)}) need --speculative-algorithm and "
                                f"--speculative-draft-model-path; leave them out for plain decoding")
            return
        if algo not in SPEC_ALGORITHMS:
            raise ArgsError(f"--speculative-algorithm must be EAGLE or EAGLE3 (got {algo!r}); "
                            "leave it unset for plain decoding")
        if not self.speculative_draft_model_path:
            raise ArgsError(f"--speculative-algorithm {algo} needs --speculative-draft-model-path PATH "
                            "(the draft head's folder)")
        try:
            validate_tree(self.speculative_num_steps, self.speculative_eagle_topk, self.speculative_num_draft_tokens)
        except ValueError as e:
            raise ArgsError(f"--speculative-num-steps / --speculative-eagle-topk / --speculative-num-draft-tokens: "
                            f"{e}") from None

    @property
    def accept_thresholds(self) -> Thresholds:
        """SGLang's relaxed acceptance of sampled requests (``verify.Thresholds``; (1, 1) = lossless)."""
        return Thresholds(self.speculative_accept_threshold_single, self.speculative_accept_threshold_acc)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path

    def resolve_page_size(self, head_dim: int, dtype, platform: str) -> int:
        """``--page-size``, or when it was not given the default for this model's pool on ``platform``
        (``kv_cache.default_page_size``), which it becomes."""
        if self.page_size is None:
            self.page_size = kv_cache.default_page_size(head_dim, dtype, platform)
        return self.page_size

    def notices(self) -> list[str]:
        """One line per GPU-only flag that was set (it has no effect here), and for a token map that EAGLE3
        ignores."""
        ignored_map = check_token_map_use(self.speculative_algorithm, self.speculative_token_map)
        out = [ignored_map] if ignored_map else []
        for name in GPU_ONLY_FLAGS:
            v = getattr(self, name)
            if v is not None and v is not False:  # a value of 0 was given too (0 == False)
                out.append(f"--{name.replace('_', '-')} is a CUDA-only SGLang flag and has no effect in specjax")
        return out

    @classmethod
    def from_kwargs(cls, **kwargs) -> "ServerArgs":
        """Build from SGLang-style keyword names (``specjax.Engine(model_path=..., tp_size=...)``)."""
        aliases = {"model": "model_path", "speculative_draft_model": "speculative_draft_model_path",
                   "tokenizer": "tokenizer_path"}
        names = {f.name for f in dataclasses.fields(cls)}
        clean = {}
        for k, v in kwargs.items():
            k = aliases.get(k, k)
            if k not in names:
                raise ArgsError(f"unknown engine argument {k!r}; see `python -m specjax.serve --help` for the names")
            clean[k] = v
        try:
            return cls(**check_field_types(cls, clean))
        except ValueError as e:
            raise ArgsError(f"engine argument {e}") from None


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the examples' line breaks; shows a default only when there is one worth showing."""

    def _get_help_string(self, action):
        h = action.help or ""
        shown = not (action.default is None or action.default is False or action.default == argparse.SUPPRESS)
        if action.option_strings and "default" not in h and shown:
            h += f" (default: {action.default})"
        return h


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m specjax.serve",
        description="Serve a model over HTTP (SGLang-compatible native /generate and OpenAI /v1 endpoints), "
                    "optionally with EAGLE3 / EAGLE speculative decoding.",
        formatter_class=_HelpFormatter,
        epilog="examples:\n"
               "  python -m specjax.serve --model-path ~/models/SmolLM2-135M-Instruct --port 30000\n"
               "  python -m specjax.serve --model-path meta-llama/Llama-3.1-8B-Instruct --tp-size 8 \\\n"
               "      --speculative-algorithm EAGLE3 --speculative-draft-model-path ./eagle3-head \\\n"
               "      --speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 8\n"
               "then: curl localhost:30000/generate -d '{\"text\": \"Hello\", \"sampling_params\": "
               "{\"max_new_tokens\": 16}}'")
    add_options(p, ServerArgs, group_descriptions={_GPU: ", ".join(f"--{n.replace('_', '-')}"
                                                                    for n in GPU_ONLY_FLAGS)})
    for a in p._actions:  # short metavars keep --help readable
        if a.option_strings and a.nargs is None and a.choices is None and not isinstance(a.const, bool):
            a.metavar = "N" if a.type is int else "F" if a.type is float else (
                "PATH" if a.dest.endswith("path") or a.dest in ("chat_template", "speculative_token_map") else None)
    return p


def parse_args(argv=None) -> ServerArgs:
    ns = build_parser().parse_args(argv)
    return ServerArgs(**vars(ns)).validate()
