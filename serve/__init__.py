"""The serving front: ``python -m specjax.serve`` (HTTP, SGLang/OpenAI-compatible) and ``specjax.Engine`` (offline).

Modules: args (ServerArgs + CLI), launch (load + budget + runner), scheduler (the scheduler thread), runners/ (the
Runner protocol, PlainRunner, SpecRunner), pages (free list + radix cache), request (per-request state,
detokenization, stops), protocol (pydantic bodies), api (FastAPI app) and routes/ (its routers), engine (the offline
Engine), metrics (Prometheus).
"""


def __getattr__(name):
    if name == "Engine":
        from specjax.serve.engine import Engine
        return Engine
    if name == "ServerArgs":
        from .args import ServerArgs
        return ServerArgs
    raise AttributeError(name)
