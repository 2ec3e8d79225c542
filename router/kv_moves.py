"""KV that moves: a worker serves its cached pages to another worker, which pulls the blocks it lacks.

Holder side, ``POST /internal/kv/blocks`` (wire format: router/kv_wire.py): the puller's token ids,
first block and hashes; the holder checks the puller's layout and hashes against its own (409 with
the difference otherwise), then streams the blocks it holds from there, in chunks of ``CHUNK`` pages
that the engine thread copies out between steps (``LLMEngine.request_kv("export")``): device pool,
host tier, and disk-tier pages read here, off the engine thread. CRCs and bytes are made in a helper
thread. The stream stops at the first block it no longer holds.

Puller side, ``KVMoves.pull``: a turn that arrives with a ``kv_source`` (the router's hint: the worker
that holds its prefix, router/core.py ``kv_move``) first asks its own engine how many of the prompt's
blocks it holds, then pulls the rest from the holder and verifies each page as it arrives (hash of
its own token ids per block, page size, CRC-32 of the bytes; ``StreamReader``), and hands verified
pages to its engine in chunks as they come (``request_kv("import")``: written into fresh pages and
inserted in the radix cache, as a tier load is). The turn is submitted after: the scheduler finds the
pages in its cache and computes only the rest. A refused, failed, cut, corrupt or slow transfer
(``timeout_s``) keeps the pages verified before it and recomputes the others; each ends with one log
line. No step waits for the network: the transfer runs on the worker's event loop, the engine thread
sees only bounded copy commands.

Drain handover, ``KVMoves.hand_over``: a worker that drains (SIGTERM) asks the live workers, least loaded
first, to pull its pinned sessions' sequences (``POST /internal/kv/pull``: the same pull, every full
block, then pinned there for what was left of the pin). Their ``stored`` KV events tell the routers, so a
session's next turn goes where its KV now is instead of recomputing it.

``KVMoveStats`` counts what moved (bytes and blocks, each way), pulls and how they ended, and the
measured pull bandwidth the worker reports to routers (``LoadReport.kv_pull_bytes_per_s``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, AsyncIterator

import httpx
from fastapi import APIRouter, Request
from pydantic import BaseModel, Field
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.core import CounterMetricFamily

from engine.kv_move import ON_DISK

from router.kv_wire import (KVPullRequest, KVWireError, StreamReader, WireLayout, decode_request, encode_end,
                            encode_header, encode_page, encode_request)

log = logging.getLogger("router.kv_moves")

CHUNK = 32   # pages per engine command (about 24 MB of float32 pages of the default model)

kv_routes = APIRouter()


@dataclass
class KVMoveStats:
    served_bytes: int = 0
    served_blocks: int = 0
    pulls: int = 0               # turns that came with a kv_source and lacked blocks
    pulled_bytes: int = 0
    pulled_blocks: int = 0       # verified and inserted in the cache
    pull_failures: int = 0       # refused, cut, corrupt, timed out or unreachable (the rest recomputed)
    pull_time_s: float = 0.0
    bytes_per_s: float = 0.0     # measured on pulls of 1 MB or more (EWMA); 0 before the first

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PullResult:
    held_before: int      # blocks the engine held before the pull
    imported: int         # blocks pulled, verified and inserted
    wanted: int           # blocks asked for
    error: str | None = None


class KVMoves:
    """Both halves of page transfers for one worker's engine (``llm``: an ``LLMEngine``)."""

    def __init__(self, llm: Any, timeout_s: float = 30.0) -> None:
        self.llm = llm
        self.layout = WireLayout.of(llm.mover.layout)
        self.timeout_s = timeout_s
        self.stats = KVMoveStats()
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=timeout_s))

    async def close(self) -> None:
        await self.http.aclose()

    async def _engine(self, op: str, *args) -> Any:
        return await asyncio.wrap_future(self.llm.request_kv(op, *args))

    # ------------------------------------------------------------ holder

    def check(self, req: KVPullRequest) -> str | None:
        """Why this holder cannot serve ``req`` (a layout or hash mismatch), or None."""
        why = self.layout.mismatch(req.layout)
        if why:
            return f"KV layouts differ (the puller's vs this worker's): {why}"
        if req.hashes:
            end = req.start + len(req.hashes)
            ours = self.llm.mover.hashes(req.token_ids[:end * self.layout.page_size], req.cache_salt)
            if ours[req.start] != req.hashes[0]:
                return (f"block {req.start} hashes to {ours[req.start]:016x} here, {req.hashes[0]:016x} on the "
                        "puller: another model id or cache salt")
        return None

    async def serve(self, req: KVPullRequest) -> AsyncIterator[bytes]:
        """The stream: header, a record per block held from ``req.start``, the end record."""
        yield encode_header(self.layout, req.start)
        sent, block, end = 0, req.start, req.start + len(req.hashes)
        while block < end:
            chunk = await self._engine("export", req.token_ids, req.cache_salt, block, min(CHUNK, end - block))
            frames = await asyncio.to_thread(self._encode, chunk)
            for frame in frames:
                yield frame
            self.stats.served_blocks += len(frames)
            self.stats.served_bytes += sum(len(f) for f in frames)
            sent += len(frames)
            block += len(frames)
            if len(frames) < CHUNK:
                break
        yield encode_end(sent)

    def _encode(self, chunk: list[tuple[int, Any]]) -> list[bytes]:
        """Records of a chunk (a helper thread): disk-tier pages read here; stops at one it cannot read."""
        frames = []
        for block_hash, page in chunk:
            if isinstance(page, str) and page == ON_DISK:
                page = self.llm.tiers.read_disk(block_hash) if self.llm.tiers is not None else None
                if page is None:
                    break
            frames.append(encode_page(block_hash, page))
        return frames

    # ------------------------------------------------------------ puller

    async def pull(self, source_url: str, prompt: list[int], cache_salt: str = "", max_blocks: int | None = None,
                   timeout_s: float | None = None, whole: bool = False) -> PullResult:
        """Pull the blocks of ``prompt`` this engine lacks from ``source_url``, up to the last full block
        before the prompt's last token (the engine computes that one; ``whole``: every full block, for a
        sequence handed over) and ``max_blocks``, within ``timeout_s`` (and this worker's own limit)."""
        P = self.layout.page_size
        want = len(prompt) // P if whole else (len(prompt) - 1) // P
        if max_blocks is not None:
            want = min(want, max_blocks)
        tokens = prompt[:want * P]
        held = await self._engine("held", tokens, cache_salt)
        if held >= want:
            return PullResult(held, 0, 0)
        hashes = self.llm.mover.hashes(tokens, cache_salt)[held:]
        request = KVPullRequest(tokens, held, hashes, self.layout, cache_salt)
        self.stats.pulls += 1
        started = time.monotonic()
        limit = self.timeout_s if timeout_s is None else min(timeout_s, self.timeout_s)
        imported, error, nbytes = await self._transfer(source_url, request, limit)
        elapsed = time.monotonic() - started
        self.stats.pull_time_s += elapsed
        self.stats.pulled_bytes += nbytes
        self.stats.pulled_blocks += imported
        if nbytes >= 1 << 20 and elapsed > 0:
            rate = nbytes / elapsed
            self.stats.bytes_per_s = rate if not self.stats.bytes_per_s else 0.7 * self.stats.bytes_per_s + 0.3 * rate
        if error is not None:
            self.stats.pull_failures += 1
            log.warning("KV pull from %s: %d of %d blocks received before it failed (%s); the rest is recomputed",
                        source_url, imported, len(hashes), error)
        else:
            log.info("KV pull from %s: %d of %d blocks in %.3f s (%d bytes)", source_url, imported, len(hashes),
                     elapsed, nbytes)
        return PullResult(held, imported, len(hashes), error)

    async def _transfer(self, source_url: str, request: KVPullRequest,
                        timeout_s: float) -> tuple[int, str | None, int]:
        """(blocks inserted, why it stopped early or None, bytes received)."""
        reader = StreamReader(self.layout, request.start, request.hashes)
        pending: list = []
        inserted, nbytes, error = 0, 0, None
        try:
            async with asyncio.timeout(timeout_s):
                async with self.http.stream("POST", source_url.rstrip("/") + "/internal/kv/blocks",
                                            content=encode_request(request),
                                            headers={"content-type": "application/json"}) as resp:
                    if resp.status_code != 200:
                        body = (await resp.aread())[:500].decode(errors="replace")
                        raise KVWireError(f"the holder refused ({resp.status_code}): {body}")
                    async for data in resp.aiter_bytes():
                        nbytes += len(data)
                        pending.extend(reader.feed(data))
                        if len(pending) >= CHUNK:
                            inserted = await self._insert(request, inserted, pending)
                            pending = []
                    if reader.error is not None:
                        raise reader.error
                    if not reader.ended:
                        raise KVWireError(f"the stream was cut after {reader.received} pages")
        except TimeoutError:
            error = f"timed out after {timeout_s} s"
        except (httpx.HTTPError, KVWireError, OSError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        if pending:   # verified before the stream stopped: kept
            try:
                inserted = await self._insert(request, inserted, pending)
            except KVWireError as exc:
                error = error or str(exc)
        return inserted, error, nbytes

    async def _insert(self, request: KVPullRequest, inserted: int, pages: list) -> int:
        """Insert ``pages`` as the blocks after the ``inserted`` ones; returns the request's blocks now
        inserted. ``KVWireError`` when the cache took fewer (no room, or it lost the prefix meanwhile):
        blocks after a gap would not attach, so the pull stops there."""
        try:
            held = await self._engine("import", request.token_ids, request.cache_salt, request.start + inserted,
                                      pages)
        except (RuntimeError, ValueError) as exc:   # e.g. a page the pool cannot take: the rest is recomputed
            raise KVWireError(f"inserting pulled pages failed: {exc}") from None
        got = max(0, held - request.start)
        if got < inserted + len(pages):
            raise KVWireError(f"the cache took {got} of {inserted + len(pages)} pulled blocks")
        return got


    # ------------------------------------------------------------ drain handover

    async def hand_over(self, self_url: str, targets: list[str], timeout_s: float) -> dict:
        """A draining worker's pinned sessions: each target (in turn, ``targets`` best first) is asked to
        pull one session's blocks from here (``POST /internal/kv/pull``) and pin them for what is left of
        the session's pin. Returns what was handed over; a target that fails is logged and skipped (that
        session is recomputed where its next turn lands, as without a handover)."""
        pinned = await self._engine("pinned")
        done = {"sessions": len(pinned), "handed_over": 0, "blocks": 0}
        if not pinned or not targets:
            # said either way: a drain that hands nothing over says why (no pins, or no live worker to take them)
            log.warning("drain handover: %d pinned sessions, %d live workers to take them; nothing handed over",
                        len(pinned), len(targets))
            return done
        deadline = time.monotonic() + timeout_s
        for i, (pin_id, tokens, salt, ttl_s) in enumerate(pinned):
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("drain handover: out of time after %d of %d sessions", i, len(pinned))
                break
            target = targets[i % len(targets)]
            body = {"source": self_url, "token_ids": tokens, "cache_salt": salt, "pin_id": pin_id,
                    "pin_ttl_s": max(ttl_s, 1.0), "timeout_s": left}
            try:
                resp = await self.http.post(target.rstrip("/") + "/internal/kv/pull", json=body, timeout=left + 5)
                resp.raise_for_status()
            except httpx.HTTPError as exc:
                log.warning("drain handover of %s to %s failed (%s); it is recomputed where it lands", pin_id,
                            target, exc)
                continue
            done["handed_over"] += 1
            done["blocks"] += resp.json()["held"]
        log.warning("drain handover: %d of %d pinned sessions handed over (%d blocks)", done["handed_over"],
                    len(pinned), done["blocks"])
        return done


class KVMoveCollector:
    """``agentrt_kv_move_*`` on a worker's ``/metrics``: what its transfers moved, each way."""

    def __init__(self, moves: KVMoves) -> None:
        self.moves = moves

    def collect(self):
        st = self.moves.stats
        moved = CounterMetricFamily("agentrt_kv_move_bytes", "KV page bytes this worker sent to other workers (out) "
                                    "and pulled from them (in), in bytes", labels=["direction"])
        moved.add_metric(["out"], st.served_bytes)
        moved.add_metric(["in"], st.pulled_bytes)
        yield moved
        blocks = CounterMetricFamily("agentrt_kv_move_blocks", "KV blocks this worker sent to other workers (out) "
                                     "and pulled, verified and cached (in)", labels=["direction"])
        blocks.add_metric(["out"], st.served_blocks)
        blocks.add_metric(["in"], st.pulled_blocks)
        yield blocks
        pulls = CounterMetricFamily("agentrt_kv_move_pulls", "KV pulls this worker made for turns sent with a "
                                    "kv_source, by outcome (failed: refused, cut, corrupt, timed out or unreachable; "
                                    "the rest recomputed)", labels=["outcome"])
        pulls.add_metric(["ok"], st.pulls - st.pull_failures)
        pulls.add_metric(["failed"], st.pull_failures)
        yield pulls
        yield CounterMetricFamily("agentrt_kv_move_pull_seconds", "Time this worker's KV pulls took, in seconds",
                                  value=st.pull_time_s)


# ------------------------------------------------------------ routes


@kv_routes.post("/internal/kv/blocks")
async def kv_blocks(request: Request) -> Response:
    """Stream the cached pages asked for (router/kv_wire.py); 409 on a layout or hash mismatch."""
    moves: KVMoves | None = getattr(request.app.state, "kv_moves", None)
    if moves is None:
        return _error(404, "KV moves are off on this worker (--kv-moves false)", "kv_moves_off")
    try:
        req = decode_request(await request.body())
    except KVWireError as exc:
        return _error(400, str(exc), "invalid_request")
    why = moves.check(req)
    if why:
        log.warning("KV pull refused: %s", why)
        return _error(409, why, "kv_layout_mismatch")
    return StreamingResponse(moves.serve(req), media_type="application/octet-stream")


class HandOverBody(BaseModel):
    """A draining worker asks this one to take a pinned session's KV (``KVMoves.hand_over``)."""

    source: str = Field(min_length=1, max_length=2048, pattern=r"^https?://")
    token_ids: list[int] = Field(min_length=1)
    cache_salt: str = ""
    pin_id: str = Field(min_length=1, max_length=256)
    pin_ttl_s: float = Field(gt=0)
    timeout_s: float | None = Field(default=None, gt=0)


@kv_routes.post("/internal/kv/pull")
async def kv_pull(body: HandOverBody, request: Request) -> Response:
    """Pull a session's whole sequence from ``source`` and pin it here under its pin id (a drain handover)."""
    moves: KVMoves | None = getattr(request.app.state, "kv_moves", None)
    if moves is None:
        return _error(404, "KV moves are off on this worker (--kv-moves false)", "kv_moves_off")
    result = await moves.pull(body.source, body.token_ids, body.cache_salt, timeout_s=body.timeout_s, whole=True)
    held = result.held_before + result.imported
    if held:
        moves.llm.pin(body.pin_id, body.token_ids[:held * moves.layout.page_size], body.pin_ttl_s, body.cache_salt)
    return JSONResponse({"held": held, "pulled": result.imported, "error": result.error})


@kv_routes.get("/internal/kv/stats")
async def kv_stats(request: Request) -> dict:
    moves: KVMoves | None = getattr(request.app.state, "kv_moves", None)
    return {"enabled": moves is not None, **(moves.stats.as_dict() if moves is not None else {})}


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": code}},
                        status_code=status)


__all__ = ["CHUNK", "KVMoveCollector", "KVMoveStats", "KVMoves", "PullResult", "kv_routes"]
