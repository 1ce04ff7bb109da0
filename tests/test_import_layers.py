"""The house's import layers, checked on the source (ast), not by importing anything.

Layers, lowest first (docs/01-data-flow.md draws them):
  core   specjax/ itself: config, cli, layers, sharding, kv_cache, sampling, batching, weights, safetensors_io,
         gguf_io, head_weights, hub, plain_step, generate, models/, kernels/, speculative/ (drafting, tree,
         verification, the jitted speculative step, offline speculative generation), heads/ (shipped head files)
  apps   specjax.train (train/) and specjax.serve (serve/: scheduler, runners/, routes/, engine)
  tools  specjax.convert, specjax.bench, specjax.preflight
A module may import its own layer or lower ones, never a higher one. Imports of our own modules sit at the top of
the file; an import inside a function is allowed only in the tools layer and in ``__main__`` files (they load
heavy parts on demand). The package root ``specjax/__init__.py`` is the facade above every layer: it re-exports
``specjax.Engine`` lazily (SGLang's ``sgl.Engine``).
"""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent
SOURCE_DIRS = {"specjax": "specjax", "train": "specjax.train", "serve": "specjax.serve"}
TOOLS = ("specjax.convert", "specjax.bench", "specjax.preflight")
APPS = ("specjax.train", "specjax.serve")
LAYER_NAMES = ("core", "apps", "tools")


def _under(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def layer_of(module: str) -> int:
    """0 core, 1 apps, 2 tools."""
    if _under(module, TOOLS):
        return 2
    if _under(module, APPS):
        return 1
    return 0


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(REPO)
    parts = list(rel.with_suffix("").parts)
    parts = SOURCE_DIRS[parts[0]].split(".") + parts[1:]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:  # relative: resolve against this module's package
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(package[: len(package) - (node.level - 1)] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    return [f"{base}.{a.name}" for a in node.names]  # `from specjax import sharding` is specjax.sharding


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """Every import in ``source`` (the text of ``module``) that breaks the layers, as readable lines."""
    tree = ast.parse(source)
    top_level = {id(n) for n in tree.body}
    for n in tree.body:  # imports under a top-level `if TYPE_CHECKING:` / try block still count as top level
        if isinstance(n, (ast.If, ast.Try)):
            top_level |= {id(c) for c in ast.walk(n) if isinstance(c, (ast.Import, ast.ImportFrom))}
    lazy_ok = _under(module, TOOLS) or module.endswith("__main__")
    lazy_exports = set()  # PEP 562 module __getattr__ of a package facade (specjax.Engine, specjax.serve.Engine)
    for n in tree.body:
        if isinstance(n, ast.FunctionDef) and n.name == "__getattr__" and is_package:
            lazy_exports |= {id(c) for c in ast.walk(n)}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        for target in _imported(node, module, is_package):
            if not _under(target, ("specjax",)):
                continue
            if id(node) in lazy_exports:
                continue
            if layer_of(target) > layer_of(module):
                found.append(f"{module}:{node.lineno} ({LAYER_NAMES[layer_of(module)]}) imports {target} "
                             f"({LAYER_NAMES[layer_of(target)]}): upward")
            if id(node) not in top_level and not lazy_ok and target != module:
                found.append(f"{module}:{node.lineno} imports {target} inside a function; move it to the top")
    return found


def _sources():
    for folder in SOURCE_DIRS:
        for path in sorted((REPO / folder).rglob("*.py")):
            yield path, module_name(path)


def test_the_house_keeps_its_layers():
    found = []
    for path, module in _sources():
        found += violations(path.read_text(), module, path.name == "__init__.py")
    assert not found, "imports against the layers (see this file's docstring):\n" + "\n".join(found)


def test_every_source_folder_is_checked():
    modules = {m for _, m in _sources()}
    assert {"specjax.config", "specjax.train.loss", "specjax.serve.api", "specjax.bench.decode"} <= modules


def test_the_check_fails_on_an_upward_import():
    # core importing an app, an app importing a tool, and a hidden in-function import in core: each is reported
    assert violations("from specjax.serve.api import create_app\n", "specjax.layers")
    assert violations("import specjax.convert.head\n", "specjax.train.loss")
    assert violations("from ..bench import decode\n", "specjax.serve.api")
    assert violations("def f():\n    from specjax import sharding\n", "specjax.layers")
    # while downward imports, and lazy ones in a tool, pass
    assert not violations("from specjax.models import target\nfrom specjax.serve import api\n", "specjax.bench.x")
    assert not violations("def f():\n    from specjax.train import checkpoint\n", "specjax.convert.head")
    assert not violations("from . import loss\n", "specjax.train.train_step")
