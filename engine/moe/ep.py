"""Expert parallelism across processes with ``torch.distributed`` (gloo on CPU, NCCL on CUDA).

Every rank runs ``ExpertParallelMoE.forward`` collectively on its own tokens
(``x [T_local, H]``, T_local may be 0). One layer step:

1. route locally (every rank holds the gate and the shared expert), choose a physical
   replica per token and expert (``LayerPlacement.choose_replica``);
2. group by destination rank: one *row* per (token, destination rank) — a token is sent
   once per destination however many of its experts live there — and one *pair*
   (row, local slot, weight) per token->expert;
3. exchange the row and pair counts with ``all_to_all_single`` (gloo's list
   ``all_to_all`` needs equal shapes), then ``all_to_all_single`` the hidden rows and
   the pair metadata with uneven splits;
4. run the local expert slots on the received rows, summing each row's weighted expert
   outputs;
5. ``all_to_all_single`` the partial sums back and add them up at the source.

``TrafficCounter`` records what crossed rank and node boundaries, from the split sizes.
``migrate`` moves expert weights to a new layout with the same primitive.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from engine.moe.config import MoEConfig, Topology
from engine.moe.layers import MoEBlock, MoERouting, SwiGLUExperts, load_expert_weights
from engine.moe.placement import LayerPlacement, PlacementPlan
from engine.moe.rebalance import migration_transfers

_META_FIELDS = 3  # (row within the source's chunk, local slot, weight bits) as int32


@dataclass(frozen=True)
class EPContext:
    """This process's place in the expert-parallel group."""

    rank: int
    topology: Topology
    group: object | None = None  # a torch.distributed ProcessGroup; None = the default group

    def __post_init__(self) -> None:
        self.topology.node_of(self.rank)  # validates the rank

    @classmethod
    def from_default_group(cls, topology: Topology) -> "EPContext":
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialised; call init_process_group first")
        if dist.get_world_size() != topology.world_size:
            raise ValueError(f"world size {dist.get_world_size()} != topology {topology.world_size}")
        return cls(dist.get_rank(), topology)


@dataclass
class TrafficCounter:
    """Cumulative dispatch traffic of one rank's tokens (dispatch + combine), from split sizes."""

    tokens: int = 0
    pairs: int = 0
    pairs_off_rank: int = 0
    pairs_off_node: int = 0
    rows_off_rank: int = 0
    rows_off_node: int = 0
    bytes_off_rank: int = 0
    bytes_off_node: int = 0
    pairs_served: int = 0  # token->expert pairs this rank's experts computed (its load)
    migration_bytes: int = 0  # expert weights this rank sent to others in ``migrate``
    extra: dict = field(default_factory=dict)

    def as_tensor(self) -> torch.Tensor:
        names = ("tokens", "pairs", "pairs_off_rank", "pairs_off_node", "rows_off_rank", "rows_off_node",
                 "bytes_off_rank", "bytes_off_node", "pairs_served", "migration_bytes")
        return torch.tensor([getattr(self, n) for n in names], dtype=torch.float64)


class ExpertParallelMoE(nn.Module):
    """One MoE layer on one expert-parallel rank: holds the gate, the shared expert and only
    this rank's ``S`` physical expert slots. ``forward`` is collective over the group."""

    def __init__(self, cfg: MoEConfig, layer: LayerPlacement, ctx: EPContext, dtype: torch.dtype = torch.float32):
        super().__init__()
        if layer.num_experts != cfg.num_experts or layer.topology != ctx.topology:
            raise ValueError("placement does not match the config's experts or the context's topology")
        self.cfg, self.layer, self.ctx = cfg, layer, ctx
        self.routing = MoERouting(cfg, dtype)
        self.local = SwiGLUExperts(layer.slots_per_rank, cfg.hidden, cfg.intermediate, dtype)
        self.traffic = TrafficCounter()

    @classmethod
    def from_block(cls, block: MoEBlock, layer: LayerPlacement, ctx: EPContext) -> "ExpertParallelMoE":
        """Take this rank's slots from a full single-process block (tests, small models)."""
        dtype = block.experts.w_gate.dtype
        ep = cls(block.cfg, layer, ctx, dtype)
        ep.routing.load_state_dict(block.routing.state_dict())
        e = block.experts
        ep.local.load_slots([(e.w_gate[i], e.w_up[i], e.w_down[i]) for i in layer.local_experts(ctx.rank)])
        return ep

    @classmethod
    def from_hf_state_dict(cls, cfg: MoEConfig, layer: LayerPlacement, ctx: EPContext,
                           state_dict: Mapping[str, torch.Tensor], layer_prefix: str,
                           dtype: torch.dtype = torch.float32) -> "ExpertParallelMoE":
        """Load gate, shared expert and this rank's slots by HF name; with a lazy
        ``state_dict`` (``checkpoint.SafetensorsDict``) only those tensors are read."""
        ep = cls(cfg, layer, ctx, dtype)
        ep.load_hf(state_dict, layer_prefix)
        return ep

    def load_hf(self, state_dict: Mapping[str, torch.Tensor], layer_prefix: str) -> None:
        """Load gate, shared expert and this rank's slots into this (allocated) layer."""
        self.routing.load_hf(state_dict, layer_prefix)
        experts = self.layer.local_experts(self.ctx.rank)
        self.local.load_slots(load_expert_weights(self.cfg, state_dict, layer_prefix, experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] this rank's tokens -> [T, H]. Collective."""
        ids, weights = self.routing.route(x)  # (T, k), (T, k)
        return self.forward_routed(x, ids, weights)

    def forward_routed(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       token_index: torch.Tensor | None = None) -> torch.Tensor:
        """Routed experts for given routing (plus the shared expert). Collective."""
        out = self._dispatch_compute_combine(x, ids, weights, token_index)
        shared = self.routing.shared_forward(x)
        return out if shared is None else out + shared

    def _dispatch_compute_combine(self, x, ids, weights, token_index) -> torch.Tensor:
        r, s, me = self.layer.world_size, self.layer.slots_per_rank, self.ctx.rank
        t, k = ids.shape
        # the placement's maps live on the CPU; the dispatch runs on x's device (gloo: CPU, NCCL: GPU)
        index = None if token_index is None else token_index.cpu()
        phys = self.layer.choose_replica(ids.cpu(), me, index).to(x.device)  # (T, k)
        dest = (phys // s).reshape(-1)  # (T*k,) destination rank of every pair
        tok = torch.arange(t, device=x.device).repeat_interleave(k)  # (T*k,)
        row_key, pair_row = torch.unique(dest * max(t, 1) + tok, return_inverse=True)  # rows sorted by (dest, token)
        row_dest, row_tok = row_key // max(t, 1), row_key % max(t, 1)  # (N_rows,)
        send_rows = torch.bincount(row_dest, minlength=r)  # (R,)
        row_start = torch.cumsum(send_rows, 0) - send_rows
        order = torch.argsort(dest, stable=True)  # pairs grouped by destination
        meta = torch.stack([
            (pair_row - row_start[dest])[order].to(torch.int32),  # row within the chunk for that destination
            (phys.reshape(-1) % s)[order].to(torch.int32),  # slot on the destination
            weights.reshape(-1).float()[order].view(torch.int32),  # fp32 weight, bit-cast
        ], dim=1)  # (T*k, 3)
        send_pairs = torch.bincount(dest, minlength=r)  # (R,)

        counts = torch.stack([send_rows, send_pairs], 1).reshape(-1)  # (R*2,)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.ctx.group)
        recv_rows, recv_pairs = recv_counts.reshape(r, 2).unbind(1)  # (R,), (R,)

        x_in = exchange(x[row_tok], send_rows, recv_rows, self.ctx.group)  # (sum recv_rows, H)
        meta_in = exchange(meta, send_pairs, recv_pairs, self.ctx.group)  # (sum recv_pairs, 3)
        chunk_start = (torch.cumsum(recv_rows, 0) - recv_rows).repeat_interleave(recv_pairs)
        rows = meta_in[:, 0].long() + chunk_start  # (P_in,) row in x_in
        y_in = self.local.weighted_sum(x_in, rows, meta_in[:, 1].long(), meta_in[:, 2].view(torch.float32))

        y_back = exchange(y_in, recv_rows, send_rows, self.ctx.group)  # (N_rows, H) in send order
        out = torch.zeros_like(x)  # (T, H)
        out.index_add_(0, row_tok, y_back)
        self._count(t, dest, send_rows, send_pairs, int(recv_pairs.sum()), x)
        return out

    def _count(self, t: int, dest: torch.Tensor, send_rows: torch.Tensor, send_pairs: torch.Tensor,
               served: int, x: torch.Tensor) -> None:
        topo, me = self.ctx.topology, self.ctx.rank
        send_rows, send_pairs = send_rows.cpu(), send_pairs.cpu()
        remote = torch.arange(topo.world_size) != me  # (R,)
        far = torch.tensor([topo.node_of(i) != topo.node_of(me) for i in range(topo.world_size)])
        row_bytes = 2 * x.shape[1] * x.element_size()  # hidden row out and partial sum back
        pair_bytes = _META_FIELDS * 4
        c = self.traffic
        c.tokens += t
        c.pairs += int(dest.numel())
        c.pairs_off_rank += int(send_pairs[remote].sum())
        c.pairs_off_node += int(send_pairs[far].sum())
        c.rows_off_rank += int(send_rows[remote].sum())
        c.rows_off_node += int(send_rows[far].sum())
        c.bytes_off_rank += int(send_rows[remote].sum()) * row_bytes + int(send_pairs[remote].sum()) * pair_bytes
        c.bytes_off_node += int(send_rows[far].sum()) * row_bytes + int(send_pairs[far].sum()) * pair_bytes
        c.pairs_served += served

    def migrate(self, new_layer: LayerPlacement) -> int:
        """Move expert weights to ``new_layer`` (collective). Slots whose expert this rank
        already holds are copied locally; the others arrive with ``all_to_all_single`` from
        the rank chosen by ``rebalance.migration_transfers``. Returns bytes this rank sent."""
        if new_layer.slots_per_rank != self.layer.slots_per_rank or new_layer.topology != self.ctx.topology:
            raise ValueError("a migration keeps the topology and the slots per rank")
        r, me, old_local = self.layer.world_size, self.ctx.rank, self.layer.local_experts(self.ctx.rank)
        transfers = migration_transfers(self.layer, new_layer)  # (src, dst, dst_slot, expert), in a fixed order
        w = self.local
        flat = lambda slot: torch.cat([w.w_gate[slot].reshape(-1), w.w_up[slot].reshape(-1), w.w_down[slot].reshape(-1)])
        mine = [tr for tr in transfers if tr[0] == me]
        send = [flat(old_local.index(e)) for _, _, _, e in mine]
        numel = self.cfg.expert_numel
        send_sizes = torch.tensor([sum(1 for tr in mine if tr[1] == d) * numel for d in range(r)])
        recv_sizes = torch.tensor([sum(1 for tr in transfers if tr[0] == src and tr[1] == me) * numel for src in range(r)])
        sendbuf = torch.cat(send) if send else w.w_gate.new_zeros(0)
        recvbuf = exchange(sendbuf, send_sizes, recv_sizes, self.ctx.group)
        incoming = sorted((tr for tr in transfers if tr[1] == me), key=lambda tr: tr[0])  # chunks arrive by source rank
        fetched = {slot: recvbuf[i * numel:(i + 1) * numel] for i, (_, _, slot, _) in enumerate(incoming)}
        h, i_ = self.cfg.hidden, self.cfg.intermediate
        new_weights = []
        for slot, e in enumerate(new_layer.local_experts(me)):
            v = fetched[slot] if slot in fetched else flat(old_local.index(e))
            new_weights.append((v[: i_ * h].view(i_, h), v[i_ * h: 2 * i_ * h].view(i_, h), v[2 * i_ * h:].view(h, i_)))
        w.load_slots(new_weights)
        self.layer = new_layer
        sent = int(sendbuf.numel()) * sendbuf.element_size()
        self.traffic.migration_bytes += sent
        return sent


def sync_plan(plan: PlacementPlan | None, like: PlacementPlan, ctx: EPContext, root: int = 0) -> PlacementPlan:
    """Broadcast ``plan`` (given on ``root``; None elsewhere) to every rank. ``like`` supplies
    the shapes, topology and replica policy (e.g. the plan in force). Collective."""
    phy = torch.stack([lp.phy2log for lp in (plan if ctx.rank == root else like).layers])  # (L, R*S)
    dist.broadcast(phy, src=root, group=ctx.group)
    policy = (plan if ctx.rank == root else like)[0].replica_policy
    policy_t = torch.tensor([0 if policy == "hash" else 1])
    dist.broadcast(policy_t, src=root, group=ctx.group)
    policy = "hash" if int(policy_t) == 0 else "locality"
    e = like[0].num_experts
    return PlacementPlan([LayerPlacement(p, e, ctx.topology, policy) for p in phy])


def exchange(t: torch.Tensor, send: torch.Tensor, recv: torch.Tensor, group=None) -> torch.Tensor:
    """all_to_all_single of ``t`` (rows grouped by destination) with uneven splits: ``send[r]``
    rows go to rank r, ``recv[r]`` rows arrive from rank r (in rank order). Collective."""
    out = t.new_empty((int(recv.sum()),) + tuple(t.shape[1:]))
    dist.all_to_all_single(out, t.contiguous(), output_split_sizes=recv.tolist(), input_split_sizes=send.tolist(), group=group)
    return out
