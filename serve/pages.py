"""KV pages on the host side: the free list, and the radix cache of full pages shared between requests.

Page 0 is a scratch page that is never handed out: unused page-table entries point at it, so a stray write (a
padded token, a rejected draft) lands somewhere harmless. The radix cache is a trie whose edges are whole pages
of token ids; a node owns its page while it is in the trie. Requests hold references on the nodes of their prefix
(ref counts); only unreferenced leaves are evicted, least recently used first. The count of unreferenced nodes and
a heap of unreferenced leaves are kept current as nodes are locked, unlocked, inserted and evicted, so counting
what may be evicted costs nothing and evicting k pages costs O(k log n), never a walk of the trie.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import time


class PagePool:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError("the KV pool needs at least 2 pages (one is scratch)")
        self.num_pages = num_pages
        self.capacity = num_pages - 1  # pages that can be handed out
        self._free = list(range(num_pages - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        out = [self._free.pop() for _ in range(n)]
        return out

    def release(self, pages) -> None:
        self._free.extend(pages)

    def reset(self) -> None:
        self._free = list(range(self.num_pages - 1, 0, -1))


class Node:
    __slots__ = ("key", "page", "parent", "children", "ref", "last_used")

    def __init__(self, key, page, parent):
        self.key, self.page, self.parent = key, page, parent
        self.children: dict[tuple, Node] = {}
        self.ref = 0
        self.last_used = time.monotonic()


class RadixCache:
    """Prefix reuse at page granularity. ``enabled=False`` turns every call into a no-op (nothing is shared)."""

    def __init__(self, pool: PagePool, page_size: int, enabled: bool = True):
        self.pool, self.page_size, self.enabled = pool, page_size, enabled
        self._tick = itertools.count()
        self.reset()

    def _keys(self, tokens, num_pages):
        z = self.page_size
        return [tuple(tokens[i * z:(i + 1) * z]) for i in range(num_pages)]

    def match(self, tokens, max_pages: int) -> list[Node]:
        """Nodes of the longest cached prefix of ``tokens``, at most ``max_pages`` pages (nothing is locked)."""
        if not self.enabled:
            return []
        out, node = [], self.root
        for key in self._keys(tokens, min(max_pages, len(tokens) // self.page_size)):
            node = node.children.get(key)
            if node is None:
                break
            out.append(node)
        return out

    def lock(self, nodes) -> None:
        now = time.monotonic()
        for n in nodes:
            self._evictable -= n.ref == 0
            n.ref += 1
            n.last_used = now

    def unlock(self, nodes) -> None:
        now = time.monotonic()
        for n in nodes:
            n.ref -= 1
            n.last_used = now
            assert n.ref >= 0, "radix node unlocked more often than locked"
            if n.ref == 0:
                self._evictable += 1
                if not n.children:
                    self._push_leaf(n)

    def _push_leaf(self, n: Node) -> None:
        """``n`` became an unreferenced leaf (an evictable page). Entries are checked when popped (the node may have
        been locked, touched or evicted since), and the heap is rebuilt when stale entries outnumber the trie."""
        heapq.heappush(self._leaves, (n.last_used, next(self._tick), n))
        if len(self._leaves) > 2 * self.num_nodes + 64:
            self._leaves = [(m.last_used, next(self._tick), m) for m in self._walk() if m.ref == 0 and not m.children]
            heapq.heapify(self._leaves)

    def insert(self, tokens, pages, held: list[Node]) -> list[Node]:
        """Insert the full pages of ``tokens`` (KV in ``pages``) below the path ``held`` that the caller already holds.
        Returns the nodes newly held by the caller (locked): existing nodes are reused, and the caller's own page
        becomes the trie's only when the node is new. The caller keeps (and later frees) pages the trie did not take.
        """
        if not self.enabled:
            return []
        keys = self._keys(tokens, len(tokens) // self.page_size)
        node = held[-1] if held else self.root
        new: list[Node] = []
        for i in range(len(held), len(keys)):
            child = node.children.get(keys[i])
            if child is None:
                child = Node(keys[i], pages[i], node)
                node.children[keys[i]] = child
                self.num_nodes += 1
                self._evictable += 1  # unreferenced until ``lock`` below
            new.append(child)
            node = child
        self.lock(new)
        return new

    def dfs_weight_order(self, last_nodes: list[Node | None]) -> list[int]:
        """SGLang's dfs-weight order of requests whose longest cached prefixes end at ``last_nodes`` (None: none
        cached): a depth-first walk of the trie that enters the subtrees holding more of these requests first and
        takes a node's own requests after its subtree's, so requests sharing a prefix run together. Returns indices
        into ``last_nodes``. (Iterative: a long prompt's path is thousands of nodes deep.)"""
        here: dict[Node, list[int]] = collections.defaultdict(list)
        weight: dict[Node, int] = collections.defaultdict(int)
        for i, node in enumerate(last_nodes):
            node = node or self.root
            here[node].append(i)
            while node is not None:
                weight[node] += 1
                node = node.parent
        order: list[int] = []
        stack = [(self.root, False)]
        while stack:
            node, done = stack.pop()
            if done:
                order.extend(here[node])
                continue
            stack.append((node, True))
            kids = sorted((c for c in node.children.values() if weight[c]), key=lambda c: -weight[c])
            stack.extend((c, False) for c in reversed(kids))  # the heaviest is popped first
        return order

    def owns(self, node: Node, page: int) -> bool:
        return node.page == page

    def evictable_pages(self) -> int:
        """Pages of unreferenced nodes: all of them can be evicted (a request holds its whole prefix path, so an
        unreferenced node's subtree is unreferenced too)."""
        return self._evictable

    def cached_pages(self) -> int:
        return self.num_nodes

    def _walk(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` pages from unreferenced leaves, least recently used first. Returns pages freed."""
        freed = 0
        while self._leaves and freed < num_pages:
            used, _, n = heapq.heappop(self._leaves)
            if n.parent is None or n.ref or n.children or n.last_used != used:
                continue  # evicted, locked, grown or touched since it was pushed: a stale entry
            parent = n.parent
            del parent.children[n.key]
            n.parent = None
            self.num_nodes -= 1
            self._evictable -= 1
            self.pool.release([n.page])
            freed += 1
            if parent is not self.root and parent.ref == 0 and not parent.children:
                self._push_leaf(parent)
        return freed

    def reset(self) -> None:
        """Forget every node (their pages are returned by the caller resetting the pool)."""
        self.root = Node((), -1, None)
        self.num_nodes = 0
        self._evictable = 0  # nodes with ref 0
        self._leaves: list[tuple[float, int, Node]] = []  # (last_used when pushed, tie-break, node), lazily pruned
