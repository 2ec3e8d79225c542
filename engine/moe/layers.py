"""The MoE block: router gate, routed SwiGLU experts, optional shared expert.

``MoEBlock.forward`` is the single-process path (a loop over the experts that were
hit); ``MoEBlock.reference_forward`` is the plain dense oracle (gather each token's
expert weights and einsum, gpt-fast style). ``ExpertParallelMoE`` (ep.py) reuses
``route``, ``SwiGLUExperts`` and ``shared_forward`` so all paths share one routing rule.

Hugging Face weight names (``layer_prefix`` is e.g. ``"model.layers.3."``):
- Mixtral: ``block_sparse_moe.gate.weight``, ``block_sparse_moe.experts.{i}.w1|w3|w2.weight``
  (w1 = gate, w3 = up, w2 = down).
- Qwen2-MoE / Qwen3-MoE: ``mlp.gate.weight``, ``mlp.experts.{i}.gate_proj|up_proj|down_proj.weight``;
  Qwen2-MoE also ``mlp.shared_expert.{gate,up,down}_proj.weight`` and ``mlp.shared_expert_gate.weight``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.moe.config import MoEConfig


def moe_prefix(cfg: MoEConfig, layer_prefix: str) -> str:
    """Prefix of the MoE block's tensors inside a decoder layer."""
    return layer_prefix + ("block_sparse_moe." if cfg.family == "mixtral" else "mlp.")


def expert_weight_names(cfg: MoEConfig, layer_prefix: str, expert: int) -> tuple[str, str, str]:
    """HF names of (gate, up, down) weights of routed expert ``expert``."""
    p = f"{moe_prefix(cfg, layer_prefix)}experts.{expert}."
    if cfg.family == "mixtral":
        return p + "w1.weight", p + "w3.weight", p + "w2.weight"
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


class SwiGLUExperts(nn.Module):
    """``n`` SwiGLU experts stacked: down(silu(gate(x)) * up(x)) per expert.

    Index ``i`` is a slot: in the dense block slot i is expert i; on an expert-parallel
    rank slot i holds whichever logical expert the placement put there.
    """

    def __init__(self, n: int, hidden: int, intermediate: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(n, intermediate, hidden, dtype=dtype), requires_grad=False)
        self.w_up = nn.Parameter(torch.empty(n, intermediate, hidden, dtype=dtype), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(n, hidden, intermediate, dtype=dtype), requires_grad=False)

    @property
    def num_slots(self) -> int:
        return self.w_gate.shape[0]

    def expert(self, slot: int, x: torch.Tensor) -> torch.Tensor:
        """Run slot ``slot`` on ``x`` [N, H] -> [N, H]."""
        h = F.silu(x @ self.w_gate[slot].T) * (x @ self.w_up[slot].T)  # (N, I)
        return h @ self.w_down[slot].T  # (N, H)

    def weighted_sum(self, x: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """out[rows[j]] += weights[j] * expert_{slots[j]}(x[rows[j]]) over all pairs j.

        x [N, H]; rows, slots [P] int64; weights [P] fp32. Returns [N, H] in x's dtype.
        """
        out = torch.zeros_like(x)  # (N, H)
        for slot in torch.unique(slots).tolist():
            sel = (slots == slot).nonzero(as_tuple=True)[0]  # (p,)
            r = rows[sel]
            y = self.expert(slot, x[r]) * weights[sel, None].to(x.dtype)  # (p, H)
            out.index_add_(0, r, y)
        return out

    def load_slots(self, tensors: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """Copy (gate [I, H], up [I, H], down [H, I]) for every slot, in slot order."""
        if len(tensors) != self.num_slots:
            raise ValueError(f"expected weights for {self.num_slots} slots, got {len(tensors)}")
        with torch.no_grad():
            for i, (g, u, d) in enumerate(tensors):
                self.w_gate[i].copy_(g)
                self.w_up[i].copy_(u)
                self.w_down[i].copy_(d)


class SwiGLU(nn.Module):
    """A dense SwiGLU MLP with HF names (gate_proj, up_proj, down_proj): the shared expert."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoERouting(nn.Module):
    """Router gate plus the optional shared expert: everything of a block except the
    routed experts. Every expert-parallel rank holds a full copy of it."""

    def __init__(self, cfg: MoEConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(cfg.hidden, cfg.num_experts, bias=False, dtype=dtype)
        self.shared_expert = SwiGLU(cfg.hidden, cfg.shared_expert_intermediate, dtype) if cfg.has_shared_expert else None
        self.shared_expert_gate = nn.Linear(cfg.hidden, 1, bias=False, dtype=dtype) if cfg.has_shared_expert else None
        self.requires_grad_(False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_ids [T, k] int64, topk_weights [T, k] fp32), exactly as HF:
        softmax (in fp32) over all E logits, top-k, renormalise (Mixtral always; Qwen if
        ``norm_topk_prob``)."""
        logits = self.gate(x)  # (T, E)
        probs = torch.softmax(logits.float(), dim=-1)  # (T, E)
        weights, ids = torch.topk(probs, self.cfg.top_k, dim=-1)  # (T, k)
        if self.cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights

    def shared_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """sigmoid(shared_expert_gate(x)) * shared_expert(x) [T, H], or None without one."""
        if self.shared_expert is None:
            return None
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def load_hf(self, state_dict: Mapping[str, torch.Tensor], layer_prefix: str) -> None:
        """Load gate (and shared expert) weights from HF names under ``layer_prefix``."""
        p = moe_prefix(self.cfg, layer_prefix)
        with torch.no_grad():
            self.gate.weight.copy_(_get(state_dict, p + "gate.weight", self.gate.weight.shape))
            if self.shared_expert is not None:
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    w = getattr(self.shared_expert, proj).weight
                    w.copy_(_get(state_dict, f"{p}shared_expert.{proj}.weight", w.shape))
                w = self.shared_expert_gate.weight
                w.copy_(_get(state_dict, p + "shared_expert_gate.weight", w.shape))


class MoEBlock(nn.Module):
    """A full MoE block in one process: [T, H] -> [T, H] (the engine flattens tokens)."""

    def __init__(self, cfg: MoEConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg = cfg
        self.routing = MoERouting(cfg, dtype)
        self.experts = SwiGLUExperts(cfg.num_experts, cfg.hidden, cfg.intermediate, dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.routing.route(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)  # (T, k), (T, k)
        return self.forward_routed(x, ids, weights)

    def forward_routed(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Experts (sparse loop over those hit) plus the shared expert, for given routing."""
        t, k = ids.shape
        rows = torch.arange(t).repeat_interleave(k)  # (T*k,) token of each pair
        out = self.experts.weighted_sum(x, rows, ids.reshape(-1), weights.reshape(-1))  # (T, H)
        shared = self.routing.shared_forward(x)
        return out if shared is None else out + shared

    def reference_forward(self, x: torch.Tensor, ids: torch.Tensor | None = None, weights: torch.Tensor | None = None) -> torch.Tensor:
        """The dense oracle: gather every token's k experts' weights and einsum."""
        if ids is None:
            ids, weights = self.route(x)  # (T, k), (T, k)
        e = self.experts
        w1, w3, w2 = e.w_gate[ids], e.w_up[ids], e.w_down[ids]  # (T, k, I, H), (T, k, I, H), (T, k, H, I)
        h = F.silu(torch.einsum("th,tkih->tki", x, w1)) * torch.einsum("th,tkih->tki", x, w3)  # (T, k, I)
        y = torch.einsum("tki,tkhi->tkh", h, w2)  # (T, k, H)
        out = torch.einsum("tkh,tk->th", y, weights.to(x.dtype))  # (T, H)
        shared = self.routing.shared_forward(x)
        return out if shared is None else out + shared

    def load_hf(self, state_dict: Mapping[str, torch.Tensor], layer_prefix: str) -> None:
        """Load every weight of the block from HF names under ``layer_prefix`` ("model.layers.N.")."""
        self.routing.load_hf(state_dict, layer_prefix)
        self.experts.load_slots(load_expert_weights(self.cfg, state_dict, layer_prefix, range(self.cfg.num_experts)))

    @classmethod
    def from_hf_state_dict(cls, cfg: MoEConfig, state_dict: Mapping[str, torch.Tensor], layer_prefix: str,
                           dtype: torch.dtype = torch.float32) -> "MoEBlock":
        block = cls(cfg, dtype)
        block.load_hf(state_dict, layer_prefix)
        return block


def load_expert_weights(cfg: MoEConfig, state_dict: Mapping[str, torch.Tensor], layer_prefix: str,
                        experts: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(gate, up, down) of the listed logical experts, read by HF name. ``state_dict`` may be
    lazy (e.g. ``checkpoint.SafetensorsDict``) so a rank reads only its own slots."""
    h, i = cfg.hidden, cfg.intermediate
    out = []
    for e in experts:
        g, u, d = expert_weight_names(cfg, layer_prefix, int(e))
        out.append((_get(state_dict, g, (i, h)), _get(state_dict, u, (i, h)), _get(state_dict, d, (h, i))))
    return out


def _get(state_dict: Mapping[str, torch.Tensor], name: str, shape: Sequence[int]) -> torch.Tensor:
    if name not in state_dict:
        raise ValueError(f"checkpoint has no tensor {name!r}")
    t = state_dict[name]
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    return t
