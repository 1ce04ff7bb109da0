"""Load generator for a running specjax (or SGLang) server: request throughput, output tokens/s, TTFT, time per output
token and inter-chunk latency percentiles per concurrency level.

    python -m specjax.bench serve --url http://127.0.0.1:30000 --concurrency 1 4 16 --num-prompts 32 --max-tokens 128
    python -m specjax.bench serve --launch plain,eagle3 --model-path MODEL --draft HEAD [--server-args "..."]

Requests go to /v1/chat/completions with streaming (each prompt is one user turn), so any OpenAI-compatible server
works. TTFT = time to the first chunk with text; TPOT = (last chunk - first chunk) / (completion tokens - 1) per
request; ITL = gaps between text chunks (a speculative step may deliver several tokens in one chunk). With
``--launch`` each configuration gets its own server in turn, and the tables are printed side by side; with
``--interleave`` too, all the servers start at once and every concurrency level runs them back to back. On a noisy
machine ``--rounds N`` runs every level N times (interleaved: the servers back to back in each round, in alternating
order) and reports each level's round of median output tokens/s; side by side, the median and range of the ratios
of servers measured in the same round.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

from specjax.bench.common import read_prompt_file, write_json
from specjax.cli import check_output_file, option, options_parser, parse_into

BUILTIN_PROMPTS = [
    "Explain how speculative decoding speeds up text generation.",
    "Write a short poem about the sea.",
    "What are the three primary colors? Answer in one sentence.",
    "Give me a recipe for pancakes.",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "Write a Python function that checks whether a number is prime.",
    "What is the capital of France, and what is it famous for?",
    "List five tips for staying productive while working from home.",
]


def load_prompts(spec: str, n: int) -> list[str]:
    """``mtbench`` (first turns of MT-bench, fetched by ``python -m specjax.convert fetch-mtbench``), ``builtin``,
    or a file (see ``read_prompt_file``): JSON lines in the trainer's chat formats, or one prompt per line."""
    if spec == "builtin":
        rows = BUILTIN_PROMPTS
    else:
        path = spec
        if spec == "mtbench":
            from specjax.hub import default_mtbench_path
            path = default_mtbench_path()
            if not os.path.exists(path):
                print(f"MT-bench questions not found at {path}; fetch them with "
                      f"`python -m specjax.convert fetch-mtbench` (using the built-in prompts now)", file=sys.stderr)
                return (BUILTIN_PROMPTS * (n // len(BUILTIN_PROMPTS) + 1))[:n]
        rows = read_prompt_file(path, n)  # records without a prompt are dropped; none left is a ValueError
    return (rows * (n // len(rows) + 1))[:n]


async def one_request(client, url: str, model: str, prompt: str, max_tokens: int, temperature: float,
                      ignore_eos: bool, headers: dict) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if max_tokens:
        body["max_tokens"] = max_tokens
    if ignore_eos:
        body["ignore_eos"] = True
    t0 = time.perf_counter()
    times, usage, err = [], None, None
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if ev.get("usage"):
                    usage = ev["usage"]
                for c in ev.get("choices", []):
                    if c.get("delta", {}).get("content"):
                        times.append(time.perf_counter())
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        err = f"{type(e).__name__}: {e}"
    if err or not times:
        return {"error": err or "no tokens"}
    n = usage["completion_tokens"] if usage else len(times)
    return {"ttft": times[0] - t0, "e2e": times[-1] - t0, "tokens": n,
            "tpot": (times[-1] - times[0]) / (n - 1) if n > 1 else None, "itl": list(np.diff(times))}


async def run_level(url: str, model: str, prompts: list[str], concurrency: int, args, headers: dict,
                    what: str = "") -> dict:
    """One concurrency level (``what`` = "warm-up " for the untimed requests before the sweep, as errors say)."""
    import httpx
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results = []

    async def worker(client):
        while not queue.empty():
            p = queue.get_nowait()
            results.append(await one_request(client, url, model, p, args.max_tokens, args.temperature,
                                             args.ignore_eos, headers))

    before = server_state(url, headers)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout)) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    dur = time.perf_counter() - t0
    after = server_state(url, headers)
    ok = [r for r in results if "error" not in r]
    pct = lambda xs, q: float(np.percentile(xs, q)) * 1000 if len(xs) else float("nan")  # noqa: E731
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    itl = [x for r in ok for x in r["itl"]]
    out = {"concurrency": concurrency, "requests": len(ok), "failed": len(results) - len(ok), "duration_s": dur,
           "req_per_s": len(ok) / dur, "out_tok_per_s": sum(r["tokens"] for r in ok) / dur,
           "mean_out_tokens": float(np.mean([r["tokens"] for r in ok])) if ok else 0.0}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}_ms"] = pct(xs, q)
    if before and after and "spec_verify_ct" in after and after.get("spec_verify_ct", 0) > before.get(
            "spec_verify_ct", 0):
        out["accept_len"] = (after["spec_tokens"] - before["spec_tokens"]) / (
            after["spec_verify_ct"] - before["spec_verify_ct"])
    errors = sorted({r["error"] for r in results if "error" in r})
    where = f"{what}requests to {url}" + ("" if what else f" at concurrency {concurrency}")
    if results and not ok:  # a table of nan would hide the reason (a wrong --api-key, a server that fails)
        raise ValueError(f"all {len(results)} {where} failed, e.g. {errors[0]}")
    if errors:
        print(f"  {len(results) - len(ok)} of {len(results)} {where} failed, e.g. {errors[0]}", file=sys.stderr)
    return out


def server_state(url: str, headers: dict) -> dict | None:
    import httpx
    try:
        info = httpx.get(url + "/get_server_info", headers=headers, timeout=10).json()
        return (info.get("internal_states") or [None])[0]
    except Exception:  # noqa: BLE001 - other servers may not have it
        return None


def served_model(url: str, headers: dict) -> str:
    """The model ``url`` serves (ValueError, one line, when nothing answers there or the answer is not a model list:
    no server, a wrong --api-key)."""
    import httpx
    try:
        r = httpx.get(url + "/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise ValueError(f"no server answers at {url} ({type(e).__name__}: {e}); start one with `python -m "
                         f"specjax.serve --model-path MODEL --port PORT` and pass its --url, or use --launch") from None
    if r.status_code != 200:
        hint = "; check --api-key" if r.status_code in (401, 403) else ""
        raise ValueError(f"{url}/v1/models answered HTTP {r.status_code}: {r.text[:200]}{hint}")
    try:
        return r.json()["data"][0]["id"]
    except (ValueError, LookupError, TypeError):
        raise ValueError(f"{url}/v1/models did not answer an OpenAI model list: {r.text[:200]}") from None


def sweep(url: str, args, prompts: list[str]) -> list[dict]:
    """Warm the server up, then run each concurrency level in turn (``args.rounds`` times each)."""
    target = Target(url, args, prompts)
    target.warm()
    return [median_round([target.level(c) for _ in range(args.rounds)]) for c in args.concurrency]


def median_round(rounds: list[dict]) -> dict:
    """The row of the round with the median output tokens/s (its latencies from the same run; the lower median of
    an even count), with every round's tokens/s in ``rounds_out_tok_per_s`` when there were several."""
    row = dict(sorted(rounds, key=lambda r: r["out_tok_per_s"])[(len(rounds) - 1) // 2])
    if len(rounds) > 1:
        row["rounds_out_tok_per_s"] = [r["out_tok_per_s"] for r in rounds]
    return row


def speedup_cell(row: dict, base: dict) -> str:
    """``row``'s output tokens/s over ``base``'s: with rounds measured side by side (``--interleave``), the median of
    the per-round ratios and their range; else the ratio of the rows."""
    a, b = row.get("rounds_out_tok_per_s"), base.get("rounds_out_tok_per_s")
    if a and b and len(a) == len(b) and row.get("interleaved") and base.get("interleaved"):
        ratios = [x / y for x, y in zip(a, b) if y]
        if ratios:
            return f"{float(np.median(ratios)):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
    return f"{row['out_tok_per_s'] / base['out_tok_per_s']:.2f}x" if base["out_tok_per_s"] else "-"


class Target:
    """One server under load: its URL, auth headers, served model name and the prompts."""

    def __init__(self, url: str, args, prompts: list[str], name: str = ""):
        self.url, self.args, self.name, self.prompts = url, args, name, prompts
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.model = served_model(url, self.headers)

    def warm(self) -> None:
        n = self.args.warmup_requests
        if n:
            asyncio.run(run_level(self.url, self.model, self.prompts[:n], min(n, 4), self.args, self.headers,
                                  what="warm-up "))

    def level(self, c: int) -> dict:
        r = asyncio.run(run_level(self.url, self.model, self.prompts, c, self.args, self.headers))
        tag = f"[{self.name}] " if self.name else ""
        print(f"  {tag}concurrency {c}: {r['out_tok_per_s']:.1f} out tok/s, TTFT p50 {r['ttft_p50_ms']:.0f} ms, "
              f"load {os.getloadavg()[0]:.2f}", file=sys.stderr)
        return r


COLUMNS = [("concurrency", "conc", "{:d}"), ("requests", "reqs", "{:d}"), ("req_per_s", "req/s", "{:.2f}"),
           ("out_tok_per_s", "out tok/s", "{:.1f}"), ("ttft_p50_ms", "TTFT p50", "{:.0f}"),
           ("ttft_p90_ms", "p90", "{:.0f}"), ("ttft_p99_ms", "p99", "{:.0f}"), ("tpot_p50_ms", "TPOT p50", "{:.1f}"),
           ("tpot_p90_ms", "p90", "{:.1f}"), ("tpot_p99_ms", "p99", "{:.1f}"), ("itl_p50_ms", "ITL p50", "{:.1f}"),
           ("itl_p90_ms", "p90", "{:.1f}"), ("itl_p99_ms", "p99", "{:.1f}"), ("accept_len", "accept", "{:.2f}")]


def print_table(rows: list[dict], title: str = "") -> None:
    cols = [c for c in COLUMNS if any(c[0] in r for r in rows)]
    head = [c[1] for c in cols]
    body = [[(c[2].format(r[c[0]]) if c[0] in r else "-") for c in cols] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    if title:
        print(f"\n{title}  (latencies in ms)")
    print("| " + " | ".join(h.rjust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for b in body:
        print("| " + " | ".join(x.rjust(w) for x, w in zip(b, widths)) + " |")


def print_side_by_side(results: dict[str, list[dict]]) -> None:
    names = list(results)
    base = names[0]
    spec = [n for n in names[1:] if any("accept_len" in r for r in results[n])]  # speculative servers report it
    rounds = max(len(r.get("rounds_out_tok_per_s", [0])) for rows in results.values() for r in rows)
    how = f"; of {rounds} rounds, the median round, and the median (range) of the per-round speedups" \
        if rounds > 1 else ""
    print(f"\nside by side (output tokens/s, TPOT p50 ms, accept length; speedup vs {base}{how})")
    head = ["conc"] + [f"{n} tok/s" for n in names] + [f"{n} TPOT" for n in names] + [
        f"{n} accept" for n in spec] + [f"{n}/{base}" for n in names[1:]]
    rows = []
    for i, c in enumerate(results[base]):
        row = [str(c["concurrency"])]
        row += [f"{results[n][i]['out_tok_per_s']:.1f}" if i < len(results[n]) else "-" for n in names]
        row += [f"{results[n][i]['tpot_p50_ms']:.1f}" if i < len(results[n]) else "-" for n in names]
        row += [f"{results[n][i]['accept_len']:.2f}" if i < len(results[n]) and "accept_len" in results[n][i]
                else "-" for n in spec]
        row += [speedup_cell(results[n][i], c) if i < len(results[n]) else "-" for n in names[1:]]
        rows.append(row)
    widths = [max(len(h), *(len(r[j]) for r in rows)) for j, h in enumerate(head)]
    print("| " + " | ".join(h.rjust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(x.rjust(w) for x, w in zip(r, widths)) + " |")


# ---- --launch: one server per configuration ------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_flags(name: str, args) -> list[str]:
    """The server flags of configuration ``name``: plain, eagle3 or eagle, optionally ``:FLAGS`` for that server
    alone (e.g. ``plain:--disable-overlap-schedule``)."""
    base, _, own = name.partition(":")
    flags = ["--model-path", args.model_path] + shlex.split(args.server_args or "") + shlex.split(own)
    if base == "plain":
        return flags
    algo = {"eagle3": "EAGLE3", "eagle": "EAGLE"}.get(base.lower())
    if algo is None:
        raise SystemExit(f"--launch: unknown configuration {base!r} (plain, eagle3, eagle)")
    if not args.draft:
        raise SystemExit(f"--launch {name} needs --draft HEAD_FOLDER")
    return flags + ["--speculative-algorithm", algo, "--speculative-draft-model-path", args.draft] + shlex.split(
        args.spec_args or "")


@contextlib.contextmanager
def launched(name: str, args):
    """Start the server of configuration ``name`` on a free port; yields its URL once /health answers, stops it on
    exit."""
    import httpx
    port = _free_port()
    cmd = [sys.executable, "-m", "specjax.serve", *launch_flags(name, args), "--port", str(port), "--log-level",
           "warning"]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    log = tempfile.NamedTemporaryFile("w+", prefix=f"specjax_bench_{name.partition(':')[0]}_", suffix=".log",
                                      delete=False)
    print(f"[{name}] starting: {shlex.join(cmd)}  (log: {log.name})", file=sys.stderr)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    try:
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise SystemExit(f"[{name}] server exited ({proc.returncode}):\n{log.read()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() - t0 > args.launch_timeout:
                raise SystemExit(f"[{name}] server not up after {args.launch_timeout}s (log: {log.name})")
            time.sleep(1)
        print(f"[{name}] up in {time.time() - t0:.0f}s", file=sys.stderr)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def launch_and_sweep(name: str, args, prompts: list[str]) -> list[dict]:
    with launched(name, args) as url:
        return sweep(url, args, prompts)


def launch_interleaved(names: list[str], args, prompts: list[str]) -> dict[str, list[dict]]:
    """Every configuration's server up at once; each concurrency level runs them back to back (in reverse order on
    every other level and round), so a drifting machine shifts all of them alike; ``args.rounds`` times over."""
    with contextlib.ExitStack() as stack:
        targets = [Target(stack.enter_context(launched(n, args)), args, prompts, n) for n in names]
        for t in targets:
            t.warm()
        runs: dict[str, list[list[dict]]] = {n: [[] for _ in args.concurrency] for n in names}
        for r in range(args.rounds):
            for i, c in enumerate(args.concurrency):
                for t in targets if (i + r) % 2 == 0 else targets[::-1]:
                    runs[t.name][i].append(t.level(c))
        return {n: [dict(median_round(rounds), interleaved=True) for rounds in runs[n]] for n in names}


_LAUNCH = "launch mode: start a server per configuration and compare"


@dataclasses.dataclass
class ServeBenchOptions:
    url: str = option("http://127.0.0.1:30000", help="server to load (ignored with --launch)")
    concurrency: tuple[int, ...] = option((1, 4, 16), help="concurrent clients per level")
    num_prompts: int = option(32, help="requests per concurrency level")
    max_tokens: int = option(128, help="max_tokens per request (0: none sent, as chat clients that set none do; the "
                                       "server's limit, the context, applies)")
    prompts: str = option("mtbench", help="mtbench | builtin | FILE (JSONL or one prompt per line)")
    temperature: float = option(0.0, help="sampling temperature of every request (0 = greedy)")
    ignore_eos: bool = option(False, help="always generate max_tokens tokens")
    api_key: str | None = option(None, help="bearer key of the server, if it has one")
    warmup_requests: int = option(2, help="untimed requests before the sweep")
    request_timeout: float = option(600.0, help="seconds before a request counts as failed")
    rounds: int = option(1, help="run every concurrency level this many times and report its round of median "
                                 "output tokens/s (with --interleave: the servers back to back in each round; side "
                                 "by side, the median and range of the per-round speedups)")
    json: str | None = option(None, help="also write the results here")
    launch: str | None = option(None, group=_LAUNCH, help="comma-separated configurations: plain, eagle3, eagle, "
                                "each optionally with flags of its own after a colon, e.g. "
                                "\"plain,plain:--disable-overlap-schedule\"")
    model_path: str | None = option(None, group=_LAUNCH, help="target model the launched servers load")
    draft: str | None = option(None, group=_LAUNCH, help="draft head folder for eagle3 / eagle")
    server_args: str = option("", group=_LAUNCH, help="extra flags for every server, e.g. \"--context-length 2048\"")
    spec_args: str = option("", group=_LAUNCH, help="extra flags for speculative servers, e.g. "
                                                   "\"--speculative-num-steps 3 --speculative-eagle-topk 1 "
                                                   "--speculative-num-draft-tokens 4\"")
    interleave: bool = option(False, group=_LAUNCH,
                              help="start every configuration's server at once and run them back to back at each "
                                   "concurrency level (fair on a drifting machine; needs memory for all of them)")
    launch_timeout: float = option(1800.0, group=_LAUNCH,
                                   help="seconds to wait for a launched server to become healthy")


def main(argv=None) -> int:
    ap = options_parser(ServeBenchOptions, "python -m specjax.bench serve", __doc__.split("\n\n")[0],
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    args = parse_into(ServeBenchOptions, ap, argv)
    for flag, value in (("rounds", args.rounds), ("concurrency", min(args.concurrency)),
                        ("num-prompts", args.num_prompts)):
        if value < 1:
            ap.error(f"--{flag} must be at least 1")
    if args.max_tokens < 0:
        ap.error("--max-tokens must be at least 0 (0: none sent)")
    if args.warmup_requests < 0:
        ap.error("--warmup-requests must be at least 0")
    for flag, value in (("request-timeout", args.request_timeout), ("launch-timeout", args.launch_timeout)):
        if not value > 0:  # 0 failed every request (httpx's ConnectTimeout) after the server had been started
            ap.error(f"--{flag} must be more than 0 seconds (got {value})")
    if args.interleave and not args.launch:
        ap.error("--interleave runs the servers of --launch side by side; give --launch plain,eagle3 (or others)")
    check_output_file(args.json, "--json")
    if args.launch and not args.model_path:
        ap.error("--launch needs --model-path")
    prompts = load_prompts(args.prompts, args.num_prompts)  # a file without prompts is said before any server starts
    if args.launch:
        names = [n.strip() for n in args.launch.split(",") if n.strip()]
        results = launch_interleaved(names, args, prompts) if args.interleave else {
            n: launch_and_sweep(n, args, prompts) for n in names}
        for name in names:
            print_table(results[name], title=name)
        if len(results) > 1:
            print_side_by_side(results)
    else:
        results = {"server": sweep(args.url.rstrip("/"), args, prompts)}
        print_table(results["server"], title=args.url)
    write_json(args.json, results, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
