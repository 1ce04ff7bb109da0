"""``python -m specjax.serve --model-path PATH [...]``: load, warm up, serve over HTTP. ``--help`` lists every flag.
With no model and no speculative flags it serves the default pair: SmolLM2-135M-Instruct (fetched on first use)
with the EAGLE3 head shipped in the package, at the head's tuned tree shape."""

from __future__ import annotations

import logging
import sys
import time

from .args import ArgsError, parse_args

log = logging.getLogger("specjax.serve")


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
    except ArgsError as e:
        print(f"python -m specjax.serve: error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    from specjax.hub import enable_compilation_cache

    from .api import bind_sockets, create_app, http_protocol
    from .launch import build, setup_logging

    setup_logging(args.log_level)
    try:
        sockets = bind_sockets(args.host, args.port)
    except OSError as e:
        print(f"python -m specjax.serve: cannot start: {e}", file=sys.stderr)
        return 1
    if folder := enable_compilation_cache():
        log.info("compiled programs are kept in %s for the next start (SPECJAX_COMPILATION_CACHE=0: off)", folder)
    try:
        backend = build(args)
    except Exception as e:  # noqa: BLE001 - a startup failure is reported in one line, not a traceback
        log.debug("startup failed", exc_info=True)
        print(f"python -m specjax.serve: cannot start: {type(e).__name__}: {e}", file=sys.stderr)
        for sock in sockets:
            sock.close()
        return 1
    if args.skip_server_warmup:
        log.info("skipping warmup (--skip-server-warmup): the first requests compile their shapes")
    else:
        log.info("warming up (compiling the common shapes; --skip-server-warmup skips this)")
        log.info("warmup done in %.1fs", backend.warmup())
    app = create_app(backend)
    log.info("serving %s on http://%s:%d (startup %.1fs)", args.model_name, args.host, args.port,
             time.perf_counter() - t_start)
    if args.speculative_algorithm and not args.speculation_off_reason:
        log.info("speculative decoding: %s, head %s, tree (steps %d, topk %d, draft tokens %d)",
                 args.speculative_algorithm, args.speculative_draft_model_path, args.speculative_num_steps,
                 args.speculative_eagle_topk, args.speculative_num_draft_tokens)
    if args.skip_tokenizer_init:  # token ids in and out
        log.info("try:  curl http://%s:%d/generate -H 'Content-Type: application/json' -d "
                 "'{\"input_ids\": [1, 2, 3], \"sampling_params\": {\"max_new_tokens\": 8}}'", args.host, args.port)
    else:
        log.info("try:  curl http://%s:%d/v1/chat/completions -H 'Content-Type: application/json' -d "
                 "'{\"model\": \"%s\", \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital "
                 "of France?\"}]}'", args.host, args.port, args.model_name)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                                           http=http_protocol(args.http_header_timeout),
                                           timeout_keep_alive=args.http_idle_timeout))
    try:
        server.run(sockets=sockets)
    except KeyboardInterrupt:
        pass
    finally:
        backend.shutdown()
    return 0 if server.started else 1


t_start = time.perf_counter()

if __name__ == "__main__":
    sys.exit(main())
