"""Continuous batching with chunked prefill, a radix prefix cache and preemption.

Each step, under a token budget (``max_batched_tokens``):
1. every running request that is decoding gets one token;
2. running requests still prefilling get their next chunk;
3. waiting requests are admitted, oldest first (or, with an ``order``, least key first:
   engine/session_priority.py, scheduling_policy "session"): the longest cached prefix is
   matched (and locked) in the radix cache, and the next chunk is scheduled. A request
   whose next pages a running request is still prefilling (same prompt prefix) waits
   for them to reach the cache instead of computing them a second time.
Then, with ``propose`` set (speculative decoding, engine/speculative.py), decoding
requests in the batch may add draft tokens to verify, within what is left of the budget
and of the free pages: a draft never evicts, unpins or preempts, so everything else is
scheduled as without speculation. After verification ``update_from_output`` calls
``rollback``, which frees the pages of rejected draft slots.
With KV tiers (``tiers``, engine/kv_tier.py) a request's match continues past the device
pool: the block hashes after the device match that a tier holds are loaded into fresh pages
and inserted in the radix cache, so the request computes only what no tier has. A request
whose tier pages are still being read from disk stays in the queue and the scheduler admits
the requests behind it meanwhile; it is admitted once they are in (``KVTiers.ready``). With sliding
windows the tiers' run continues the raw device match and stops where the window before its end is
held (device pages with their sliding page, whole tier blocks): docs/kv_tiers.md.
Pages come from the free pool; when it runs dry the scheduler evicts unlocked
cache, then releases session pins (earliest expiry first), then preempts the
youngest running request (with an ``order``, the one of greatest key): its
computed pages go into the cache (so resuming is
cheap if they survive) and it returns to the front of the waiting queue. A
request that cannot fit even alone is finished with an error. So every request
finishes: nothing waits on memory that no one will free.

After each step the engine core hands the step and its result to ``update_from_output``, the one
place where a step's result changes state: rows counted as computed and prefill progress cached,
sampled tokens appended with the stop checks (engine/stop_checks.py), verified drafts committed and
their rejected pages freed, finished requests freed (a session turn's sequence pinned) and withdrawn
from the step launched after theirs (overlap scheduling, ``launched`` / ``launched_step``).

``waiting_tokens`` is the KV demand of the waiting queue: each request counts its
tokens as of entering it (the prompt when new; prompt and output so far when
preempted) until it leaves it (admitted, failed or finished). The engine's
admission control reads it; only the thread that schedules changes it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.hashing import block_hashes
from engine.kv_pool import PagePool
from engine.kv_tier import PENDING, KVTiers
from engine.plan import ScheduledBatch, Step, StepResult
from engine.radix_cache import Node, RadixCache
from engine.request import PLACEHOLDER, Request, Status
from engine.session_priority import ServiceLedger, SessionOrder, charge
from engine.speculative import SpeculativeDecoder
from engine.stop_checks import StopRule, append_token
from engine.window_pool import usable_pages


@dataclass
class Pin:
    node: Node
    expires_at: float


@dataclass
class StepUpdate:
    """What ``update_from_output`` did: the requests whose output changed (to report, in step order) and
    how many of them were session turns that ended (their agents are likely coming straight back)."""
    requests: list[Request] = field(default_factory=list)
    returning: int = 0


class Scheduler:
    SHARED_PREFILL_PAGES = 2  # a waiting request defers to a running prefill sharing this many next pages
    def __init__(self, pool: PagePool, cache: RadixCache, page_size: int, max_num_seqs: int,
                 max_batched_tokens: int, enable_prefix_cache: bool = True) -> None:
        self.pool = pool
        self.cache = cache
        self.P = page_size
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.enable_prefix_cache = enable_prefix_cache
        self.waiting: deque[Request] = deque()   # change it only through enqueue/_requeue/_unqueue
        self.waiting_tokens = 0
        self.running: list[Request] = []
        self.pins: dict[str, Pin] = {}
        self.num_preemptions = 0
        self.failed: list[Request] = []   # finished by the scheduler; the engine reports them
        # (decoding request, most tokens) -> a draft to verify this step; None: no speculation
        self.propose: Callable[[Request, int], list[int]] | None = None
        # most rows a step may have with its drafts (None: the budget is the only limit)
        self.draft_rows_cap: int | None = None
        # KV tiers below the pool and how to copy a page back into it (LLMEngine sets both)
        self.tiers: KVTiers | None = None
        self.write_page: Callable[[int, torch.Tensor], None] | None = None
        # the session policy's order of requests (LLMEngine sets it); None: first come, first served
        self.order: SessionOrder | None = None
        self.clock: Callable[[], float] = time.monotonic   # queueing times and aging (tests step it)
        # after a step (``update_from_output``; the engine's builder sets them): the stop checks, the
        # ledger charged with each step's tokens, the speculative decoder that commits verified drafts
        self.stop = StopRule(frozenset(), 1 << 62)
        self.ledger: ServiceLedger | None = None
        self.spec: SpeculativeDecoder | None = None
        self.prompt_tokens_total = self.cached_tokens_total = self.generation_tokens_total = 0
        self.launched_step: Step | None = None   # the step on the forward thread, not yet committed (overlap)

    # -- the waiting queue ----------------------------------------------------
    def enqueue(self, req: Request) -> None:
        """A new request joins the back of the waiting queue."""
        req.queued_tokens = req.num_tokens
        req.queued_at = self.clock()
        self.waiting_tokens += req.queued_tokens
        self.waiting.append(req)

    def _requeue(self, req: Request) -> None:
        """A preempted request goes back to the front, counting what it must recompute."""
        req.queued_tokens = req.num_tokens
        req.queued_at = self.clock()
        self.waiting_tokens += req.queued_tokens
        self.waiting.appendleft(req)

    def _unqueue(self, req: Request) -> None:
        """Remove ``req`` from the waiting queue (the front one is O(1))."""
        if self.waiting and self.waiting[0] is req:
            self.waiting.popleft()
        else:
            self.waiting.remove(req)
        self.waiting_tokens -= req.queued_tokens
        req.queued_tokens = 0

    # -- pages ----------------------------------------------------------------
    def _pages_for(self, req: Request, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.P) - len(req.pages))

    def _free_up(self, n: int, ids: int = 0) -> bool:
        """Make ``n`` pages free (with sliding pages, where layers slide) and at least ``ids`` page ids by
        evicting cache, then releasing pins. With sliding windows a leaf may free page ids but no sliding
        pages (its window was dropped): evicting goes on while it frees."""
        def short() -> int:
            return max(n - self.pool.num_free, ids - self.pool.num_free_ids)
        while short() > 0 and self.cache.evict(short()):
            pass
        while short() > 0 and self.pins:
            pin_id = min(self.pins, key=lambda k: self.pins[k].expires_at)
            self.unpin(pin_id)
            self.cache.evict(short())
        return short() <= 0

    def _drop_behind_window(self, req: Request) -> None:
        """Give back the sliding pages of the request's own pages (not the radix cache's) that lie wholly
        before ``committed - window + 1``, committed being its cacheable tokens rounded down to a page:
        no query from there on reads them, and the page its next insert ends at keeps its window."""
        keep_from = (req.num_cacheable // self.P) * self.P - self.cache.window + 1
        end = min(len(req.pages), max(0, keep_from) // self.P)
        if end > req.num_tree_pages:
            self.pool.drop_window(req.pages[req.num_tree_pages:end])

    def _grow(self, req: Request, num_tokens: int) -> bool:
        if self.cache.window is not None:
            self._drop_behind_window(req)
        need = self._pages_for(req, num_tokens)
        if need and not self._free_up(need):
            return False
        req.pages.extend(self.pool.alloc(need))
        return True

    # -- pins -----------------------------------------------------------------
    def pin(self, pin_id: str, tokens: list[int], ttl_s: float, salt: str = "") -> int:
        """Lock the cached prefix of ``tokens`` for ``ttl_s`` seconds; returns pinned tokens."""
        self.unpin(pin_id)
        pages, node = self.cache.match_usable(tokens, salt)
        if not pages:
            return 0
        self.cache.lock(node)
        self.pins[pin_id] = Pin(node, time.monotonic() + ttl_s)
        return len(pages) * self.P

    def extend_pin(self, pin_id: str, ttl_s: float) -> bool:
        """Make the pin ``pin_id`` expire ``ttl_s`` seconds from now; False if it no longer holds."""
        pin = self.pins.get(pin_id)
        if pin is None:
            return False
        pin.expires_at = time.monotonic() + ttl_s
        return True

    def unpin(self, pin_id: str) -> None:
        pin = self.pins.pop(pin_id, None)
        if pin is not None:
            self.cache.unlock(pin.node)

    def expire_pins(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for pin_id in [k for k, p in self.pins.items() if p.expires_at <= now]:
            self.unpin(pin_id)

    # -- cache hand-over ------------------------------------------------------
    def _match(self, req: Request) -> str:
        """Start a (re)admitted request from the longest cached prefix: the device pool's, then the
        tiers'. ``"ok"`` when it holds its match; otherwise it holds nothing: ``"pending"`` while tier
        pages it needs are still being read, ``"wait"`` while the pool has no room to load them."""
        limit = ((req.num_tokens - 1) // self.P) * self.P  # at least one token must be computed for logits
        if self.enable_prefix_cache:
            pages, node = self.cache.match_usable(req.all_ids[:limit], req.cache_salt)
        else:
            pages, node = [], self.cache.root(req.cache_salt)
        self.cache.lock(node)
        req.tree_node, req.pages, req.num_tree_pages = node, list(pages), len(pages)
        req.num_computed = len(pages) * self.P
        if self.tiers is not None and self.enable_prefix_cache:
            got = self._load_from_tiers(req, limit)
            if got != "ok":
                self.release(req)
            return got
        return "ok"

    def _tier_run(self, req: Request, limit: int) -> tuple[list[int], Node, list[int], list[str]]:
        """The device's raw match of the request's first ``limit`` tokens (pages and node: with sliding
        windows it may run past the usable match ``req.tree_node``, over pages whose window is gone), the
        hashes of the blocks after it, and the media of the run of them the tiers hold, cut where a hit
        may end (``_usable_run``)."""
        raw, raw_node = self.cache.match_prefix(req.all_ids[:limit], req.cache_salt)
        hashes = block_hashes(req.all_ids[len(raw) * self.P:limit], self.P, self.cache.seed_fn(req.cache_salt),
                              parent=raw_node.last_hash)
        media = self.tiers.match(hashes)
        n = self._usable_run(raw, [not self.tiers.is_partial(h) for h in hashes[:len(media)]])
        return raw, raw_node, hashes, media[:n]

    def _usable_run(self, raw: list[int], whole: list[bool]) -> int:
        """How many of the tier blocks after the device's ``raw`` pages to load (``whole[i]``: block i has
        its sliding layers' K/V): the most after which a hit may end, the window before that end held by
        device pages that kept theirs or by whole blocks (engine/window_pool.py ``usable_pages``); all of
        them without sliding layers. 0 when no such end lies past ``raw``."""
        if self.cache.window is None:
            return len(whole)
        held = [self.pool.has_window(p) for p in raw] + list(whole)
        return usable_pages(held, self.P, self.cache.window, floor=len(raw)) - len(raw)

    def _load_from_tiers(self, req: Request, limit: int) -> str:
        """Continue the device match into the tiers: copy the blocks they hold into fresh pool pages and
        insert them in the radix cache. ``"pending"`` while some are still being read from disk;
        ``"wait"`` while the pool cannot hold them with the first chunk and running requests will free
        room (a load is far cheaper than the recompute that admitting without it would cost). With
        sliding windows the run is cut where the window before its end is held (docs/kv_tiers.md)."""
        raw, raw_node, hashes, media = self._tier_run(req, limit)
        if not media:
            return "ok"
        media = self._room_for(req, len(raw), media)
        if media is None:
            return "wait"
        if not media:
            return "ok"
        if not self.tiers.ready(hashes[:len(media)]):
            return "pending"
        data = []
        for h in hashes[:len(media)]:
            page = self.tiers.take(h)
            if page is None or page is PENDING:   # gone or corrupt: recompute from here
                break
            data.append(page)
        data = data[:self._usable_run(raw, [not self.tiers.is_partial_block(d) for d in data])]
        if not data:
            return "ok"
        self.cache.lock(raw_node)   # the raw match's pages past the usable one must survive the eviction
        try:
            loaded = self._insert_loaded(req, raw, data)
        finally:
            self.cache.unlock(raw_node)
        for medium in set(media[:loaded]):
            count = media[:loaded].count(medium)
            self.tiers.count_hit(medium, count, count * self.P)
            if req.cached_tokens is None:   # the first admission's cached tokens say where they came from
                req.tier_tokens[medium] = req.tier_tokens.get(medium, 0) + count * self.P
        return "ok"

    def _room_for(self, req: Request, first: int, media: list[str]) -> list[str] | None:
        """The tier blocks after the device's ``first`` pages there is room to load with the first chunk
        after them, from free and evictable pages and, if need be, pins released (as ``_free_up`` would);
        nothing moves between tiers before the pages are taken. None (wait) when there is no room for all
        and running requests will free some: pages loaded for a request that then cannot be admitted would
        be evicted again (and read again) before it runs. Alone, it loads what fits and computes the rest."""
        chunk = min(req.num_tokens - (first + len(media)) * self.P, self.max_batched_tokens)
        first_chunk = max(0, -(-chunk // self.P))

        def free() -> int:
            return self.pool.num_free_ids + self.cache.evictable_pages
        while free() < len(media) + first_chunk and self.pins:
            self.unpin(min(self.pins, key=lambda k: self.pins[k].expires_at))
        room = free() - first_chunk
        if room >= len(media):
            return media
        return None if self.running else media[:max(0, room)]

    def _insert_loaded(self, req: Request, raw: list[int], data: list[torch.Tensor]) -> int:
        """Write ``data`` (the blocks after the device's ``raw`` pages) into fresh pages, insert them and move
        the request's hold to the usable end; returns how many of them the request now holds (0: no room)."""
        new = self._alloc_for_load(len(raw), len(data))
        if new is None:
            return 0
        for page, tensor in zip(new, data):
            self.write_page(page, tensor)
        tokens = req.all_ids[:(len(raw) + len(data)) * self.P]
        _, dups = self.cache.insert(tokens, raw + new, req.cache_salt)
        if dups:
            self.pool.free(dups)
        pages, node = self.cache.match_usable(tokens, req.cache_salt)
        self.cache.lock(node)
        self.cache.unlock(req.tree_node)
        req.tree_node, req.pages, req.num_tree_pages = node, list(pages), len(pages)
        req.num_computed = len(pages) * self.P
        return max(0, len(pages) - len(raw))

    def _alloc_for_load(self, first: int, n: int) -> list[int] | None:
        """Pages for ``n`` blocks after the first ``first`` of a prefix (None if the pool cannot give them,
        the device match being locked). With sliding windows only those under the window before the run's
        end get a sliding page; the others are page ids alone (their sliding K/V is never read)."""
        if self.cache.window is None:
            return self.pool.alloc(n) if self._free_up(n) else None
        end = (first + n) * self.P
        bare = min(n, max(0, max(0, end - self.cache.window + 1) // self.P - first))
        if not self._free_up(n - bare, ids=n):
            return None
        return self.pool.alloc_ids(bare) + self.pool.alloc(n - bare)

    def cache_request(self, req: Request) -> Node:
        """Hand the request's full computed pages to the radix cache and adopt the tree's pages. Only
        pages of committed steps and known tokens (``Request.num_cacheable``): with overlap scheduling a
        launched step's K/V and sampled tokens are not in yet."""
        n_full = req.num_cacheable // self.P
        node = req.tree_node
        if self.enable_prefix_cache and n_full > req.num_tree_pages:
            tokens = req.all_ids[:n_full * self.P]
            _, dups = self.cache.insert(tokens, req.pages[:n_full], req.cache_salt)
            pages, node = self.cache.match_prefix(tokens, req.cache_salt)
            if dups:
                self.pool.free(dups)
            req.pages[:n_full] = pages
            self.cache.relock(req.tree_node, node)
            req.tree_node, req.num_tree_pages = node, n_full
        return node

    def release(self, req: Request) -> None:
        """Give back everything the request holds (its full pages go to the cache first)."""
        if req.tree_node is None:
            return
        node = self.cache_request(req)
        if (req.pin_ttl_s and req.finished and req.finish_reason in ("stop", "length")
                and req.num_tree_pages):
            self.cache.lock(node)
            self.unpin(req.request_id)
            self.pins[req.request_id] = Pin(node, time.monotonic() + req.pin_ttl_s)
        self.pool.free(req.pages[req.num_tree_pages:])
        self.cache.unlock(req.tree_node)
        req.pages, req.tree_node, req.num_tree_pages = [], None, 0
        req.num_computed = req.num_inflight = 0

    def preempt(self, req: Request) -> None:
        self.release(req)
        self.running.remove(req)
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._requeue(req)

    # -- the step -------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        budget = self.max_batched_tokens
        batch = ScheduledBatch([], [])
        # decoding requests first (oldest first, or by the order's key), then running prefills
        for req in self._running_order():
            if req.status is not Status.RUNNING or budget <= 0 or req.finishing:
                continue
            n = min(req.remaining_prefill, budget)
            while not self._grow(req, req.num_computed + n):
                victim = self._victim(batch, exclude=req)
                if victim is None:
                    break
                self.preempt(victim)
            else:
                batch.requests.append(req)
                batch.num_new.append(n)
                budget -= n
                continue
            # nothing left to preempt: this request cannot grow now
            if batch.requests:
                self.preempt(req)
            elif not req.pending:
                # alone and with the whole cache evicted it still does not fit: it never will
                self._fail(req, "the request does not fit in the KV cache")
            # else its last token is still being sampled (overlap): it fails once that token is in
        # admit waiting requests, oldest first (or least key first)
        for req in self._admission_order():
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if req.finishing:
                continue  # preempted while its last token is sampled: it ends when that token is in
            got = self._match(req)
            if got == "pending":
                continue  # its tier pages are on their way from disk: the requests behind it go first
            if got == "wait":
                break     # no room to load its tier pages until running requests free some
            if self._shares_a_running_prefill(req):
                self.release(req)  # wait a step or two: that prefill will hand its pages over
                continue
            n = min(req.remaining_prefill, budget)
            if not self._grow(req, req.num_computed + n):
                self.release(req)
                if not self.running and not batch.requests and not req.pending:
                    self._unqueue(req)
                    self._fail(req, "the request does not fit in the KV cache")
                    continue
                break
            self._unqueue(req)
            if req.cached_tokens is None:  # its first admission
                req.cached_tokens = min(req.num_computed, len(req.prompt_ids))
                req.admitted_at = self.clock()
            req.status = Status.RUNNING
            self.running.append(req)
            batch.requests.append(req)
            batch.num_new.append(n)
            budget -= n
        if self.propose is not None:
            self._add_drafts(batch, budget)
        return batch

    def _add_drafts(self, batch: ScheduledBatch, budget: int) -> None:
        """Give decoding requests drafts to verify, from the budget and free pages left over, and
        within ``draft_rows_cap`` rows for the step when one is set (unless the step already has
        more). Requests whose drafts were accepted most often ask first."""
        rows = sum(batch.num_new)
        if self.draft_rows_cap is not None and rows <= self.draft_rows_cap:
            budget = min(budget, self.draft_rows_cap - rows)
        decoding = [i for i, (req, n) in enumerate(zip(batch.requests, batch.num_new))
                    if n == 1 and req.remaining_prefill == 1 and req.output_ids]
        decoding.sort(key=lambda i: -_acceptance(batch.requests[i]))
        for i in decoding:
            if budget <= 0:
                return
            req = batch.requests[i]
            room = (len(req.pages) + self.pool.num_free) * self.P - req.num_tokens
            draft = self.propose(req, min(budget, room))
            if draft:
                req.pages.extend(self.pool.alloc(self._pages_for(req, req.num_tokens + len(draft))))
                batch.drafts[i] = draft
                budget -= len(draft)

    def rollback(self, req: Request) -> None:
        """Free the pages past the request's computed tokens: those held only for draft tokens that
        verification rejected. Their slots' K/V is never read (attention stops at the computed
        length) and the radix cache only ever receives computed, committed tokens."""
        keep = -(-req.num_computed // self.P)
        if len(req.pages) > keep:
            self.pool.free(req.pages[keep:])
            del req.pages[keep:]

    def _shares_a_running_prefill(self, req: Request) -> bool:
        """True when a running request is still prefilling the next pages ``req`` would compute
        (two agent sessions on one system prompt, arriving together). Admitting ``req`` now would
        compute those pages twice; a step or two later they are in the cache (each prefill chunk
        is handed over), as SGLang's in-batch prefix check does."""
        if not self.enable_prefix_cache:
            return False
        end = req.num_computed + self.SHARED_PREFILL_PAGES * self.P
        if req.num_tokens <= end:
            return False
        head = req.all_ids[:end]
        for other in self.running:
            if (other.status is Status.RUNNING and other.num_cacheable < end <= len(other.prompt_ids)
                    and other.cache_salt == req.cache_salt and other.prompt_ids[:end] == head):
                return True
        return False

    def _running_order(self) -> list[Request]:
        """Running requests in the order they get the step's budget: decoding before prefilling, each
        oldest first, or least key first under the session policy (waiting time does not count)."""
        if self.order is None:
            return sorted(self.running, key=lambda r: (r.remaining_prefill > 1, r.arrival))
        key = self.order.key_fn(self.clock(), waiting=False)
        return sorted(self.running, key=lambda r: (r.remaining_prefill > 1, key(r)))

    def _admission_order(self) -> list[Request]:
        """Waiting requests in the order they are admitted: the queue's (arrival, preempted ones at the
        front), or least key first under the session policy (aging included)."""
        if self.order is None:
            return list(self.waiting)
        return sorted(self.waiting, key=self.order.key_fn(self.clock()))

    def _victim(self, batch: ScheduledBatch, exclude: Request) -> Request | None:
        """The running request to preempt: not ``exclude``, not in the batch yet; the youngest, or
        under the session policy the one of greatest key (the reverse of the admission order)."""
        scheduled = set(map(id, batch.requests))
        candidates = [r for r in self.running if r is not exclude and id(r) not in scheduled]
        if not candidates:
            return None
        if self.order is None:
            return max(candidates, key=lambda r: r.arrival)
        return max(candidates, key=self.order.key_fn(self.clock(), waiting=False))

    def _fail(self, req: Request, message: str) -> None:
        if req in self.running:
            self.running.remove(req)
        req.status = Status.FINISHED
        if req.output_ids:
            req.finish_reason = "length"   # it ran out of room while generating
        else:
            req.finish_reason, req.error = "error", message
        self.release(req)
        self.failed.append(req)

    def finish(self, req: Request) -> None:
        """Remove a finished (or aborted) request and free what it holds."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self._unqueue(req)
        req.status = Status.FINISHED
        self.release(req)

    # -- after a step ---------------------------------------------------------
    def update_from_output(self, step: Step, result: StepResult) -> StepUpdate:
        """Apply a step's result: its rows count as computed (``_settle``); each sampling request's token
        is appended with the stop checks (a verified draft's tokens through the speculative decoder, the
        rejected slots' pages freed); a request that ended is freed (a session turn's sequence pinned) and
        withdrawn from the step launched after this one, if any (overlap scheduling)."""
        if self.launched_step is step:
            self.launched_step = None
        self._settle(step)
        update = StepUpdate()
        now = time.monotonic()
        for j, req in enumerate(step.reqs):
            if req.finished:
                continue   # aborted while its step was in flight: the token is dropped
            if req.first_token_time is None:
                req.first_token_time = now
                self.prompt_tokens_total += len(req.prompt_ids)
                self.cached_tokens_total += req.cached_tokens or 0
            if step.drafts[j]:
                self.spec.commit(req, step.drafts[j], *result.verified[j], append=self.append_token)
                self.rollback(req)   # the pages of the rejected draft slots
            else:
                self.append_token(req, result.tokens[j], result.logprobs[j])
            if req.finished:
                update.returning += self.finish_committed(req)
            update.requests.append(req)
        return update

    def append_token(self, req: Request, tok: int, lp, constraint_accepted: bool = False,
                     check_complete: bool = True) -> None:
        """Commit one sampled token to ``req`` and apply the token-level stop checks (engine/stop_checks.py)."""
        append_token(req, tok, lp, self.stop, constraint_accepted, check_complete)
        self.generation_tokens_total += 1

    def _settle(self, step: Step) -> None:
        """The step's forward is done: its rows count as computed, and prefill progress is shared with
        other requests, the chunk that completes the prompt included (a decode step, one token completing
        the sequence, waits for the request's end)."""
        samplers = {id(req) for req in step.reqs}
        now = time.monotonic()
        for req, n in zip(step.batch.requests, step.batch.num_new):
            if not step.live(req):
                continue   # ended, withdrawn or preempted since the step was launched
            if step.overlapped:
                req.num_inflight -= n
            else:
                req.num_computed += n
            if self.ledger is not None:
                charge(self.ledger, req, n, now)
            if (n > 1 or id(req) not in samplers) and req.num_cacheable // self.P > req.num_tree_pages:
                self.cache_request(req)

    def finish_committed(self, req: Request) -> int:
        """Free a request that ended at commit (taken out of the launched step first); 1 when it is a
        session turn whose agent is likely coming straight back (the engine's coalescer counts those)."""
        self._withdraw(req)
        self.finish(req)
        if self.spec is not None:
            self.spec.finished(req)
        return int(bool(req.pin_ttl_s) and req.finish_reason in ("stop", "length"))

    def _withdraw(self, req: Request) -> None:
        """A request ended at a step launched ahead of: take it out of the step launched after (its row
        there is not counted, its token there is dropped)."""
        nxt = self.launched_step
        row = nxt.rows.pop(id(req), None) if nxt is not None else None
        if row is not None and row[1] == req.num_preemptions:
            req.num_computed -= row[0]
            req.num_inflight -= row[0]
        req.drop_placeholders()

    def abort(self, req: Request) -> None:
        """End a request early (finish reason ``abort``): a launched step's token for it is dropped at its
        commit."""
        req.drop_placeholders()
        req.finish_reason = "abort"
        self.finish(req)

    # -- overlap scheduling (engine/overlap.py) -------------------------------
    def launched(self, step: Step) -> None:
        """``step`` goes to the forward thread ahead of its commit: its rows count as computed but in
        flight, and when the next step may run ahead of it each request that samples gets a placeholder
        for its token, ``finishing`` when that token is certainly its last (``max_tokens``, context)."""
        step.overlapped = True
        self.launched_step = step
        for req, n in zip(step.batch.requests, step.batch.num_new):
            req.num_computed += n
            req.num_inflight += n
        if step.run_ahead:
            for j, req in enumerate(step.reqs):
                step.slots[id(req)] = j
                req.output_ids.append(PLACEHOLDER)
                req.pending += 1
                req.finishing = (len(req.output_ids) >= req.params.max_tokens
                                 or req.num_tokens >= self.stop.max_model_len)

    def abandon_launched(self) -> None:
        """A step failed: every request goes back to its last committed step (placeholders dropped,
        in-flight rows uncounted). The forward thread must be idle."""
        self.launched_step = None
        for req in list(self.running) + list(self.waiting):
            req.num_computed -= req.num_inflight
            req.num_inflight = 0
            req.drop_placeholders()
            req.finishing = False


def _acceptance(req: Request) -> float:
    """The request's estimated draft acceptance (1/2 before its first draft)."""
    return 0.5 if req.speculative is None else req.speculative.length.alpha
