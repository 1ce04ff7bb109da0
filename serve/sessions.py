"""SGLang's sessions (``/open_session``, ``/close_session``, ``session_params`` of ``/generate`` and
``Engine.generate``): a request in a session continues an earlier one of the same session, named by its rid. Its
prompt is that request's prompt and output (only its prompt with ``drop_previous_output``; the first ``offset`` of
them with an offset) followed by the new input ids; the K/V of the shared part is found in the prefix cache. With
``replace``, the request named is aborted if still running and its continuations are dropped from the session (the
whole session without a rid), so a branch can be regenerated. The requests of a session form a tree; a session
holds its requests' tokens until it is closed.

Unlike SGLang, a ``session_params.id`` that names no open session, a ``rid`` the session does not hold, and an
append to a request still running are a 400 (SGLang serves the first as a plain request and aborts the others), and
an appended prompt loses a leading BOS only where the tokenizer puts one before every text (SGLang trims the BOS id
always, which would cut the ``<|im_start|>`` of a ChatML turn whose tokenizer calls it BOS, as SmolLM2's does).
A request's effects on its session (``replace``) happen when it is submitted, after every check has passed.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from typing import Any

from .request import Request, RequestError


@dataclasses.dataclass
class SessionParams:
    """SGLang's ``session_params`` of a generate request."""
    id: str
    rid: str | None = None
    offset: int | None = None
    replace: bool | None = None
    drop_previous_output: bool | None = None

    @classmethod
    def of(cls, value: Any) -> SessionParams:
        """From a mapping (the request's JSON object), or a SessionParams; a RequestError naming what is wrong."""
        if isinstance(value, SessionParams):
            return value
        if not isinstance(value, dict):
            raise RequestError(f"session_params must be an object, got {type(value).__name__}", "session_params")
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise RequestError(f"unknown field session_params.{unknown[0]!r}", "session_params")
        if not isinstance(value.get("id"), str):
            raise RequestError("session_params.id (the session's id, a string) is required", "session_params")
        if value.get("rid") is not None and not isinstance(value["rid"], str):
            raise RequestError("session_params.rid must be a string", "session_params")
        offset = value.get("offset")
        if offset is not None and (isinstance(offset, bool) or not isinstance(offset, int)):
            raise RequestError("session_params.offset must be an integer", "session_params")
        for flag in ("replace", "drop_previous_output"):
            if value.get(flag) is not None and not isinstance(value[flag], bool):
                raise RequestError(f"session_params.{flag} must be true or false", "session_params")
        return cls(**value)


@dataclasses.dataclass
class _Node:
    req: Request
    parent: _Node | None
    children: list[_Node] = dataclasses.field(default_factory=list)


class Session:
    def __init__(self, session_id: str, capacity_of_str_len: int):
        self.id, self.capacity_of_str_len = session_id, capacity_of_str_len
        self.nodes: dict[str, _Node] = {}  # rid -> its node (a reused rid names the latest request)
        self._lock = threading.Lock()  # Engine callers on several threads, the HTTP loop

    def _drop(self, nodes: list[_Node], abort) -> None:
        """Forget ``nodes`` and their continuations, aborting the running ones."""
        stack = list(nodes)
        while stack:
            n = stack.pop()
            if not n.req.finished:
                abort(n.req.rid)
            if self.nodes.get(n.req.rid) is n:
                del self.nodes[n.req.rid]
            stack.extend(n.children)
            n.children = []

    def prompt(self, sp: SessionParams, ids: list[int], bos: int | None) -> tuple[list[int], _Node | None]:
        """The prompt of a request continuing ``sp.rid`` with ``ids`` (``ids`` alone without a rid), and the node
        it continues; nothing changes in the session (``add`` does it)."""
        if sp.rid is None:
            return list(ids), None
        with self._lock:
            last = self.nodes.get(sp.rid)
        if last is None:
            raise RequestError(f"session {self.id!r} holds no request {sp.rid!r}", "session_params")
        if not sp.replace and not last.req.finished:
            raise RequestError(f"request {sp.rid!r} of session {self.id!r} has not finished: a request can "
                               f"continue it once it has (or replace it with replace: true)", "session_params")
        before = list(last.req.prompt_ids)
        if not sp.drop_previous_output:
            before += last.req.output_ids[:last.req.params.max_new_tokens]
        if sp.offset:
            before = before[:sp.offset]
        if ids and bos is not None and ids[0] == bos:  # an appended turn does not start the sequence again
            ids = ids[1:]
        return before + list(ids), last

    def recorder(self, sp: SessionParams, parent: _Node | None, abort):
        """A function adding each submitted request of a prompt (its n copies) to the session under ``parent``,
        the first call applying ``replace``: ``parent`` aborted if still running and its continuations dropped
        (without a rid: every request of the session). ``abort(rid)`` stops a running request."""
        first = [True]

        def add(req: Request) -> None:
            with self._lock:
                if sp.replace and first[0]:
                    first[0] = False
                    if parent is None:
                        self._drop([n for n in self.nodes.values() if n.parent is None], abort)
                    else:
                        if not parent.req.finished:
                            abort(parent.req.rid)
                        self._drop(parent.children, abort)
                        parent.children = []
                if parent is not None and self.nodes.get(parent.req.rid) is not parent:
                    return  # its parent left the session meanwhile (replaced by another request)
                node = _Node(req, parent)
                if parent is not None:
                    parent.children.append(node)
                self.nodes[req.rid] = node
        return add


class Sessions:
    """The open sessions of a server (any thread)."""

    def __init__(self):
        self._open: dict[str, Session] = {}
        self._lock = threading.Lock()

    def open(self, capacity_of_str_len: int, session_id: str | None = None) -> str | None:
        """SGLang's open_session: the new session's id (``session_id``, else a fresh one); None when a session of
        that id is open."""
        if isinstance(capacity_of_str_len, bool) or not isinstance(capacity_of_str_len, int):
            raise RequestError("capacity_of_str_len must be an integer", "capacity_of_str_len")
        if session_id is not None and not isinstance(session_id, str):
            raise RequestError("session_id must be a string", "session_id")
        sid = session_id if session_id is not None else uuid.uuid4().hex
        with self._lock:
            if sid in self._open:
                return None
            self._open[sid] = Session(sid, capacity_of_str_len)
        return sid

    def close(self, session_id: str) -> None:
        """SGLang's close_session: the session is forgotten (its running requests run on)."""
        with self._lock:
            if self._open.pop(session_id, None) is None:
                raise RequestError(f"no session {session_id!r} is open", "session_id")

    def get(self, session_id: str) -> Session:
        with self._lock:
            session = self._open.get(session_id)
        if session is None:
            raise RequestError(f"no session {session_id!r} is open (open one with /open_session)", "session_params")
        return session

    def __len__(self) -> int:
        return len(self._open)
