"""Radix-tree prefix cache over KV pages (RadixAttention, page-aligned).

Each edge holds a run of whole pages: ``key`` is the tokens (a multiple of
``page_size``), ``pages`` the page ids holding their K/V, ``hashes`` their block
hashes (contract 1, block == page). Trees are kept per cache salt, so tenants
with different salts never share a node.

Contracts:
- ``match_prefix`` returns the longest cached page-aligned prefix; it splits an
  edge where the match ends inside it. It does not lock: callers lock the node
  they will use with ``lock`` before the next eviction can run.
- ``insert`` adds a page-aligned sequence whose pages the caller owns. Pages for
  positions the tree already holds with *other* page ids are returned as
  duplicates: the caller frees them and from then on uses the tree's pages.
- ``lock``/``unlock`` count references on the node and every ancestor; a node
  with a reference is never evicted. ``relock(old, new)`` moves a lock down a path.
- ``evict(n)`` frees up to ``n`` pages from unlocked leaves, least recently used
  first, and returns how many it freed.
- ``on_event(kind, hashes, parent)`` (contract 2) is called with ``"stored"`` when
  pages are added and ``"removed"`` when they are evicted. With ``event_tokens`` a
  ``"stored"`` call also passes the stored blocks' token ids and the tree's cache salt,
  ``on_event("stored", hashes, parent, tokens, salt)``: vLLM's event format carries the
  tokens (``router/vllm_publisher.py``).
- ``on_evict(hashes, pages)``, when set, is called with a leaf's block hashes and page ids
  just before ``evict`` returns its pages to the pool: the last moment their K/V can be
  copied out (the KV tiers, engine/kv_tier.py).

Sliding windows (a ``WindowedPagePool``, engine/window_pool.py, with its ``window`` W): a page keeps its
sliding-layer page only while it lies in the window before some *end* a hit may stop at: the end of
a leaf, of a node with two or more children, or of a node a request or pin holds (``lock(node)`` on
that node itself). The window before an end T is positions ``T - W + 1 .. T - 1``: what the query at
T reads. Every other page's sliding page is dropped (a tombstone) when it stops being in such a window:
on ``insert`` (the new leaf's pages, and its parent's end), on ``unlock`` and on ``relock`` (a holder
moving down its path). ``match_usable`` then
stops the hit at the longest page boundary whose window is held (a split where that falls inside an
edge); the tokens after it are computed again. ``match_prefix`` is the raw match (every page of the
prefix, dropped or not), for a holder that adopts pages it computed itself.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Sequence

from engine.hashing import block_hashes
from engine.kv_pool import PagePool
from engine.window_pool import usable_pages

EventCallback = Callable[..., None]  # (kind, hashes, parent[, tokens, salt]): see the module docstring


class Node:
    __slots__ = ("key", "pages", "hashes", "children", "parent", "lock_ref", "last_access", "end", "holders")

    def __init__(self, key: tuple[int, ...], pages: list[int], hashes: list[int],
                 parent: "Node | None") -> None:
        self.key = key
        self.pages = pages
        self.hashes = hashes
        self.children: dict[tuple[int, ...], Node] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.end = (parent.end if parent is not None else 0) + len(key)   # tokens from the root to its end
        self.holders = 0   # locks taken on this node itself (lock_ref also counts its descendants')

    @property
    def last_hash(self) -> int | None:
        return self.hashes[-1] if self.hashes else None


class RadixCache:
    def __init__(self, pool: PagePool, page_size: int, seed_fn: Callable[[str], bytes],
                 on_event: EventCallback | None = None, event_tokens: bool = False) -> None:
        self.pool = pool
        self.event_tokens = event_tokens
        self.page_size = page_size
        self.seed_fn = seed_fn
        self.on_event = on_event
        self.on_evict: Callable[[list[int], list[int]], None] | None = None
        self._roots: dict[str, Node] = {}
        self._clock = itertools.count(1)
        self.cached_pages = 0      # pages owned by the tree
        self.locked_pages = 0      # of which locked (not evictable)
        self.window: int | None = getattr(pool, "window", None)   # sliding layers' window (None: no such layers)

    # -- lookup ---------------------------------------------------------------
    def root(self, salt: str = "") -> Node:
        node = self._roots.get(salt)
        if node is None:
            node = self._roots[salt] = Node((), [], [], None)
            node.lock_ref = 1  # roots are never evicted
        return node

    def _child_key(self, tokens: Sequence[int], pos: int) -> tuple[int, ...]:
        return tuple(tokens[pos:pos + self.page_size])

    def match_prefix(self, tokens: Sequence[int], salt: str = "") -> tuple[list[int], Node]:
        """(pages of the longest cached prefix of whole pages, the node where it ends)."""
        P = self.page_size
        node, pos, pages = self.root(salt), 0, []
        now = next(self._clock)
        node.last_access = now
        while pos + P <= len(tokens):
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                break
            n = self._matching_pages(child.key, tokens, pos)
            if n < len(child.pages):
                child = self._split(child, n)
            pages.extend(child.pages)
            pos += len(child.key)
            node = child
            node.last_access = now
        return pages, node

    def match_usable(self, tokens: Sequence[int], salt: str = "") -> tuple[list[int], Node]:
        """``match_prefix``, stopped at the longest page boundary whose sliding window is held (without
        sliding layers: the same)."""
        pages, node = self.match_prefix(tokens, salt)
        if self.window is None:
            return pages, node
        n = self._usable_pages(pages)
        if n == len(pages):
            return pages, node
        end = n * self.page_size
        while node.end - len(node.key) >= end and node.parent is not None:   # up to the node holding ``end``
            node = node.parent
        if node.end > end:
            node = self._split(node, (end - (node.end - len(node.key))) // self.page_size)
        return pages[:n], node

    def _usable_pages(self, pages: list[int]) -> int:
        """The most leading pages of ``pages`` (a prefix from the root) whose end's window is held."""
        return usable_pages([self.pool.has_window(p) for p in pages], self.page_size, self.window)

    def _matching_pages(self, key: tuple[int, ...], tokens: Sequence[int], pos: int) -> int:
        P, n = self.page_size, 0
        while (n + 1) * P <= len(key) and pos + (n + 1) * P <= len(tokens):
            if tuple(tokens[pos + n * P:pos + (n + 1) * P]) != key[n * P:(n + 1) * P]:
                break
            n += 1
        return n

    def _split(self, child: Node, n_pages: int) -> Node:
        """Cut ``child`` after ``n_pages`` pages; returns the new upper node."""
        P = self.page_size
        parent = child.parent
        upper = Node(child.key[:n_pages * P], child.pages[:n_pages], child.hashes[:n_pages], parent)
        upper.lock_ref = child.lock_ref   # its end is a new one: nobody holds it (holders 0)
        upper.last_access = child.last_access
        parent.children[child.key[:P]] = upper
        child.key, child.pages, child.hashes = (child.key[n_pages * P:], child.pages[n_pages:],
                                                child.hashes[n_pages:])
        child.parent = upper
        upper.children[child.key[:P]] = child
        return upper

    # -- insert ---------------------------------------------------------------
    def insert(self, tokens: Sequence[int], pages: Sequence[int], salt: str = "") -> tuple[Node, list[int]]:
        """Insert whole pages of ``tokens``; returns (end node, duplicate pages to free)."""
        P = self.page_size
        n_pages = len(tokens) // P
        if len(pages) < n_pages:
            raise ValueError(f"insert: {n_pages} pages of tokens but only {len(pages)} page ids")
        node, pos, dups = self.root(salt), 0, []
        now = next(self._clock)
        while pos < n_pages * P:
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                break
            n = self._matching_pages(child.key, tokens[:n_pages * P], pos)
            if n < len(child.pages):
                child = self._split(child, n)
            first = pos // P
            for p, q in zip(pages[first:first + n], child.pages):
                if p != q:
                    dups.append(p)
                    if self.window is not None and self.pool.has_window(p) and not self.pool.has_window(q):
                        self.pool.move_window(p, q)   # the caller reads the tree's page from now on
            pos += len(child.key)
            node = child
            node.last_access = now
        if pos < n_pages * P:
            first = pos // P
            new_pages = list(pages[first:n_pages])
            hashes = block_hashes(tokens[pos:n_pages * P], P, self.seed_fn(salt), parent=node.last_hash)
            leaf = Node(tuple(tokens[pos:n_pages * P]), new_pages, hashes, node)
            leaf.last_access = now
            node.children[leaf.key[:P]] = leaf
            self.cached_pages += len(new_pages)
            if self.on_event and self.event_tokens:
                self.on_event("stored", hashes, node.last_hash, leaf.key, salt)
            elif self.on_event:
                self.on_event("stored", hashes, node.last_hash)
            node = leaf
            if self.window is not None:   # the parent's end may be no end any more; the leaf's inside neither
                self._drop_windows(leaf, len(leaf.key) + self.window)
        return node, dups

    # -- locking --------------------------------------------------------------
    def lock(self, node: Node) -> None:
        node.holders += 1
        while node is not None:
            if node.lock_ref == 0:
                self.locked_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        if node.holders <= 0:
            raise RuntimeError("radix cache: unlock of a node that is not locked")
        node.holders -= 1
        held = node
        while node is not None:
            if node.lock_ref <= 0:
                raise RuntimeError("radix cache: unlock of a node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.locked_pages -= len(node.pages)
            node = node.parent
        if self.window is not None and held.holders == 0 and held.parent is not None:
            self._drop_windows(held, self.window)

    def relock(self, old: Node, new: Node) -> None:
        """Hold ``new`` instead of ``old``, a node on its path (a request whose pages went into the tree).
        With sliding windows, the pages from the window before ``old``'s end to ``new``'s end that lie in
        no end's window lose their sliding pages: among them the tree's own pages that took a request's
        window on ``insert``."""
        self.lock(new)
        self.unlock(old)
        if self.window is not None and new.end > old.end:
            self._drop_windows(new, new.end - old.end)

    # -- sliding windows --------------------------------------------------------
    def _is_end(self, node: Node) -> bool:
        """Whether a hit may stop at ``node``'s end: a leaf, a branch, or a node held there."""
        return node.holders > 0 or len(node.children) != 1

    def _drop_windows(self, node: Node, span: int) -> None:
        """Drop the sliding pages of the pages within ``span`` tokens before ``node``'s end (on its path)
        that lie in no end's window."""
        P = self.page_size
        while node.parent is not None and span > 0:
            start = node.end - len(node.key)
            for i in range(len(node.pages) - 1, -1, -1):
                if span <= 0:
                    return
                span -= P
                page = node.pages[i]
                if self.pool.has_window(page) and not self._in_a_window(node, start + i * P):
                    self.pool.drop_window([page])
            node = node.parent

    def _in_a_window(self, node: Node, s: int) -> bool:
        """Whether the page of ``node`` starting at position ``s`` holds a position of the window before
        an end: an end T with ``s < T <= s + P + W - 2``, at ``node`` or below it."""
        last = s + self.page_size + self.window - 2
        stack = [node]
        while stack:
            n = stack.pop()
            if n.end > last:
                continue
            if self._is_end(n):
                return True
            stack.extend(n.children.values())
        return False

    @property
    def evictable_pages(self) -> int:
        return self.cached_pages - self.locked_pages

    # -- eviction -------------------------------------------------------------
    def _leaves(self) -> list[Node]:
        out, stack = [], list(self._roots.values())
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n.parent is not None:
                out.append(n)
        return out

    def evict(self, n_pages: int) -> int:
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < n_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.key[:self.page_size]]
            if self.on_evict is not None:
                self.on_evict(leaf.hashes, leaf.pages)
            self.pool.free(leaf.pages)
            freed += len(leaf.pages)
            self.cached_pages -= len(leaf.pages)
            if self.on_event:
                self.on_event("removed", leaf.hashes, parent.last_hash)
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def sequence(self, node: Node) -> tuple[list[int], str]:
        """The tokens from the root to ``node`` (whole pages) and the cache salt of its tree."""
        keys = []
        while node.parent is not None:
            keys.append(node.key)
            node = node.parent
        salt = next(s for s, root in self._roots.items() if root is node)
        return [t for key in reversed(keys) for t in key], salt

    def all_hashes(self) -> list[int]:
        """Every cached block hash (the worker's snapshot for router resync)."""
        out, stack = [], list(self._roots.values())
        while stack:
            n = stack.pop()
            out.extend(n.hashes)
            stack.extend(n.children.values())
        return out

    def reset(self) -> int:
        """Drop every unlocked page (flush_cache); returns pages freed."""
        return self.evict(self.cached_pages)
