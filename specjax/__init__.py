"""specjax: EAGLE3 speculative decoding in pure JAX. ``import specjax`` stays light: heavy parts load on first use."""

__all__ = ["Engine"]


def __getattr__(name):
    if name == "Engine":  # the offline serving engine (SGLang's ``sgl.Engine``)
        from specjax.serve.engine import Engine
        return Engine
    raise AttributeError(f"module 'specjax' has no attribute {name!r}")
