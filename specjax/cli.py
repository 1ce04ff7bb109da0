"""One way from a dataclass to a command line.

A dataclass field declared with :func:`option` carries its help text (and any argparse detail: extra spellings,
choices, group) in its metadata. :func:`add_options` turns a flat dataclass into ``--kebab-case`` flags (serve's
SGLang-named flags, the bench and convert tools); :func:`add_dotted_options` turns a nested run config into
``--section.key VALUE`` overrides (training). :func:`dispatch` runs ``python -m specjax.X COMMAND ...`` front ends.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import importlib
import os
import sys
import types
import typing
from typing import Any, Callable, Collection, Sequence

from specjax.config import config_architectures

_ARGPARSE = "argparse"


def option(default: Any = dataclasses.MISSING, *, help: str = "", default_factory: Any = dataclasses.MISSING,
           flags: Sequence[str] = (), group: str | None = None, hidden: bool = False, positional: bool = False,
           one_of: str | None = None, **argparse_kw) -> Any:
    """A dataclass field that documents itself: ``help`` is the flag's help (and the key's documentation);
    ``flags`` adds spellings (aliases), ``group`` names the --help section, ``hidden`` keeps an accepted flag out of
    --help, ``positional`` makes it a positional argument, fields with the same ``one_of`` name are mutually
    exclusive and one of them is required; anything else (choices, type, metavar, required, nargs)
    goes to ``add_argument`` as is."""
    meta = {"help": help, _ARGPARSE: dict(argparse_kw, flags=tuple(flags), group=group, hidden=hidden,
                                          positional=positional, one_of=one_of)}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


def field_help(f: dataclasses.Field) -> str:
    return f.metadata.get("help", "")


def field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def strip_optional(tp) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (tp, False)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else tp), True
    return tp, False


def _group(parser, groups: dict, name: str | None, descriptions: dict[str, str]):
    if name is None:
        return parser
    if name not in groups:
        groups[name] = parser.add_argument_group(name, descriptions.get(name))
    return groups[name]


def add_options(parser: argparse.ArgumentParser, cls, *, group_descriptions: dict[str, str] | None = None,
                exclude: Sequence[str] = ()) -> argparse.ArgumentParser:
    """One ``--field-name`` flag per field of the flat dataclass ``cls`` (dest = the field name, default = the
    field's default): ``bool`` fields are switches, ``int`` / ``float`` fields are typed, ``tuple[X, ...]`` fields
    take one or more values. Returns the parser."""
    hints = typing.get_type_hints(cls)
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init or f.name in exclude:
            continue
        kw = dict(f.metadata.get(_ARGPARSE, {}))
        flags, group, hidden = kw.pop("flags", ()), kw.pop("group", None), kw.pop("hidden", False)
        positional, one_of = kw.pop("positional", False), kw.pop("one_of", None)
        tp, _ = strip_optional(hints[f.name])
        default = field_default(f)
        if tp is bool and "action" not in kw:
            kw["action"] = argparse.BooleanOptionalAction if default else "store_true"
        elif typing.get_origin(tp) in (tuple, list) and "nargs" not in kw and "action" not in kw:
            kw["nargs"] = "+"
            kw.setdefault("type", (typing.get_args(tp) or (str,))[0])
        elif tp in (int, float) and "type" not in kw:
            kw["type"] = tp
        if not (kw.get("required") or (positional and kw.get("nargs") != "?")):
            kw["default"] = list(default) if isinstance(default, tuple) else default
        target = _group(parser, groups, group, group_descriptions or {})
        if one_of is not None:
            if ("one_of", one_of) not in groups:
                groups[("one_of", one_of)] = target.add_mutually_exclusive_group(required=True)
            target = groups[("one_of", one_of)]
        names = [f.name] if positional else [f"--{f.name.replace('_', '-')}", *flags]
        target.add_argument(*names, **({} if positional else {"dest": f.name}),
                            help=argparse.SUPPRESS if hidden else field_help(f), **kw)
    return parser


def options_parser(cls, prog: str, description: str | None = None, epilog: str | None = None,
                   formatter_class=argparse.RawDescriptionHelpFormatter, **kw) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` for a command whose options are the fields of ``cls`` (see :func:`add_options`)."""
    p = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog, formatter_class=formatter_class)
    return add_options(p, cls, **kw)


def parse_options(cls, argv: Sequence[str] | None, prog: str, description: str | None = None, **kw):
    """``cls(**flags)`` from ``argv`` (the fields of ``cls`` are the options; see :func:`add_options`)."""
    return parse_into(cls, options_parser(cls, prog, description, **kw), argv)


def parse_into(cls, parser: argparse.ArgumentParser, argv: Sequence[str] | None = None):
    """Parse ``argv`` with a parser made by :func:`add_options` and return ``cls(**flags)``."""
    return from_namespace(cls, parser.parse_args(argv))


def from_namespace(cls, ns: argparse.Namespace):
    """``cls(**flags)`` from the flags in ``ns`` that are fields of ``cls`` (as tuples where the field is one)."""
    hints = typing.get_type_hints(cls)
    kw = {}
    for f in dataclasses.fields(cls):
        if f.init and f.name in vars(ns):
            v = getattr(ns, f.name)
            kw[f.name] = tuple(v) if isinstance(v, list) and typing.get_origin(strip_optional(hints[f.name])[0]) \
                is tuple else v
    return cls(**kw)


def add_dotted_options(parser: argparse.ArgumentParser, cls,
                       value: Callable[[str, Any], Any]) -> argparse.ArgumentParser:
    """``--section.key VALUE`` (also ``--section.key=VALUE`` and ``--section.some-key``) for every key of every
    section of the nested dataclass ``cls``; one argument group per section, titled by its docstring. A bare flag
    means ``true`` for a bool key (any other key needs its value). Values go through ``value(raw, the key's type)``
    (e.g. a YAML scalar parser) and are typed later by the config loader; only the flags given appear in the namespace (read them with
    :func:`dotted_values`)."""
    if parser.usage is None:  # the usage line names the parser's own options, then the overrides in one
        parser.usage = parser.format_usage().strip().removeprefix("usage: ") + " [--section.key VALUE ...]"
    hints = typing.get_type_hints(cls)
    for sec in dataclasses.fields(cls):
        sec_cls = hints[sec.name]
        doc = (sec_cls.__doc__ or "").strip().splitlines()
        g = parser.add_argument_group(sec.name, " ".join(doc[:1]) if doc and not doc[0].startswith(
            sec_cls.__name__ + "(") else None)
        for f in dataclasses.fields(sec_cls):
            names = [f"--{sec.name}.{f.name}"]
            if "_" in f.name:
                names.append(f"--{sec.name}.{f.name.replace('_', '-')}")
            default = field_default(f)
            shown = list(default) if isinstance(default, tuple) else default
            help_text = field_help(f)
            tp = typing.get_type_hints(sec_cls)[f.name]
            flag = dict(nargs="?", const="true") if strip_optional(tp)[0] is bool \
                else {}  # a bare flag means true for a yes/no key; any other key needs its value
            g.add_argument(*names, dest=f"{sec.name}.{f.name}", default=argparse.SUPPRESS, metavar="VALUE",
                           type=lambda raw, tp=tp: value(raw, tp),
                           help=(help_text + " " if help_text else "") + f"(default: {shown!r})", **flag)
    return parser


def dotted_values(ns: argparse.Namespace) -> list[tuple[str, Any]]:
    """The ``(section.key, value)`` pairs that :func:`add_dotted_options` flags set."""
    return [(k, v) for k, v in vars(ns).items() if "." in k]


def dispatch(prog: str, commands: dict[str, tuple[str, str]], argv: Sequence[str] | None,
             run: Callable[[Any, str, list[str]], int | None]) -> int:
    """``prog COMMAND ARGS...``: ``commands`` maps each command to (module, one-line description); the module is
    imported only when its command runs, and ``run(module, command, args)`` runs it. No command or ``--help``
    prints the list (exit 0); an unknown command prints it too (exit 2)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"{prog}: error: unknown command {argv[0]!r}", file=sys.stderr)
        print(f"usage: {prog} {{{','.join(commands)}}} [--help]\n")
        width = max(8, max(len(k) for k in commands) + 1)
        for k, (_, what) in commands.items():
            print(f"  {k:{width}s} {what}")
        return 0 if (not argv or argv[0] in ("-h", "--help")) else 2
    return run(importlib.import_module(commands[argv[0]][0]), argv[0], argv[1:]) or 0


def error_text(e: BaseException) -> str:
    """One line for an error the user must fix. A file-system error names the path and what is wrong with it in
    words (``cannot write /a/b/out: /a/b is a file, not a folder``) instead of Python's ``[Errno 20] ...``."""
    if not isinstance(e, OSError) or not e.filename:
        return str(e)
    path = os.fspath(e.filename)
    if e.errno == errno.EEXIST and os.path.isfile(path):
        return f"cannot use {path}: it is a file, not a folder"
    if e.errno == errno.ENOTDIR:
        return f"cannot use {path}: {nearest_existing(path)} is a file, not a folder"
    words = {errno.EACCES: "permission denied", errno.EPERM: "permission denied",
             errno.EROFS: "it is on a read-only file system", errno.ENOSPC: "no space left on the device",
             errno.EISDIR: "it is a folder, not a file", errno.ENOENT: "it does not exist",
             errno.EEXIST: "it already exists", errno.EDQUOT: "disk quota exceeded"}
    return f"cannot use {path}: {words.get(e.errno, e.strerror or str(e))}"


def nearest_existing(path: str) -> str:
    """The longest leading part of the absolute ``path`` that exists (a file or a folder; "/" at least)."""
    path = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(path) and path != os.path.dirname(path):
        path = os.path.dirname(path)
    return path


def check_output_file(path: str | None, flag: str) -> None:
    """Raise a ValueError now, before the work, when ``path`` cannot be written as a file later: it is a folder,
    its nearest existing folder is a file, or that folder is not writable (missing folders are created then).
    The write is also tried for real (the missing folders made, the file opened for appending, then what did not
    exist removed again): ``os.access`` trusts permission bits, which root passes under /proc or on a read-only
    mount."""
    if not path:
        return
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a folder; give a file name")
    parent = nearest_existing(os.path.dirname(path))
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{flag} {path}: the folder {parent} is not writable")
    _try_writing(path, parent, flag)


def _try_writing(path: str, parent: str, flag: str) -> None:
    """Make ``path``'s missing folders below ``parent`` and open it for appending (its content untouched), then
    remove what this made; a ValueError naming ``flag`` when the file system refuses."""
    existed = os.path.exists(path)
    made = []  # the missing folders, outermost first
    folder = os.path.dirname(path)
    while folder != parent and len(folder) > len(parent):
        made.insert(0, folder)
        folder = os.path.dirname(folder)
    try:
        for d in made:
            os.mkdir(d)
        with open(path, "a"):
            pass
    except OSError as e:  # "does not exist" would puzzle where the file is to be made: say what could not be
        said = f"cannot create {e.filename}" if e.errno == errno.ENOENT and e.filename else error_text(e)
        raise ValueError(f"{flag} {path}: {said}") from None
    finally:
        if not existed and os.path.isfile(path):
            os.remove(path)
        for d in reversed(made):
            with contextlib.suppress(OSError):  # only the empty folders this made
                os.rmdir(d)


class OutputFolderError(ValueError):
    """An output folder that a conversion must not write into: its own files would be left beside the new ones."""


def check_output_folder(path: str, command: str, replaces: Collection[str] = (), architecture: str = "") -> bool:
    """The one check of the output folder of ``convert gguf``, ``export-head`` and ``import-head`` (``command`` is
    the verb the message uses: "convert", "export", "import"). ``path`` must not exist yet, be empty, or hold exactly
    a complete previous output of the same command: every file ``replaces`` names and nothing else (but their
    ``.tmp`` of a write cut short), config.json naming ``architecture``; that output is replaced. Anything else (a
    model folder or part of one, a head folder with a README or a tune table, a training checkpoint) would be left
    with the new config.json and weights beside its own files, a folder that is neither: an OutputFolderError.
    Returns whether ``path`` holds a previous output: the caller then removes its config.json before writing
    (``clear_previous``), so that a run cut short leaves no complete-looking folder of old and new files (and is
    refused the next time: remove it)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise OutputFolderError(f"{path} is a file: {command} into a new (or empty) folder")
    names = set(os.listdir(path)) if os.path.isdir(path) else set()
    if not names:
        return False
    if replaces and set(replaces) <= names and all(n.removesuffix(".tmp") in replaces for n in names) \
            and architecture in config_architectures(path):
        return True
    also = f" (one that holds exactly an earlier output of this command, {', '.join(replaces)}, is replaced)" \
        if replaces else ""
    raise OutputFolderError(f"{path} is not empty: {command} into a new (or empty) folder{also}")


def clear_previous(path: str, log=print) -> None:
    """Before writing over the previous output that ``check_output_folder`` found: remove its config.json."""
    log(f"replacing the previous output in {path}")
    os.remove(os.path.join(path, "config.json"))


def check_field_types(cls, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` for fields of the dataclass ``cls`` given from Python (``specjax.Engine(**kwargs)``), where no
    argparse typed them: a bool, int, float or str field takes only that type (an int for a float, None where the
    field is optional); anything else is a ValueError naming the field. Returns the values, ints made floats where
    the field is a float."""
    hints = typing.get_type_hints(cls)
    out = dict(values)
    for name, v in values.items():
        tp, optional = strip_optional(hints[name])
        if v is None and optional:
            continue
        is_bool = isinstance(v, bool)
        ok = {bool: is_bool, int: isinstance(v, int) and not is_bool,
              float: isinstance(v, (int, float)) and not is_bool, str: isinstance(v, str)}.get(tp, True)
        if not ok:
            raise ValueError(f"{name} must be {tp.__name__}{' or None' if optional else ''}, got {v!r}")
        if tp is float:
            out[name] = float(v)
    return out
