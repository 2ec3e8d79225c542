"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flattened token batch.

Every request's new tokens of this step are concatenated into one ``[T]`` batch
(vLLM style): linear layers see ``[T, d]``; attention is the backend's job, which
reads and writes the paged KV cache using per-step metadata.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import LayerAttention
from engine.loader.model_config import ModelConfig
from engine.models.rope import RopeTable, RotaryEmbedding

log = logging.getLogger(__name__)

# activations ``LlamaModel._forward_fused`` runs (engine/models/cpu_ops.py DTYPES): bfloat16, and float32 where
# the CPU has no native bf16 (there the unfused norm was ~8 torch calls, 61 a step); the engine turns them on
# for float32 only on quantized weights, so float32 on dense weights keeps torch's elementwise ops
FUSED_DTYPES = (torch.bfloat16, torch.float32)


class RMSNorm(nn.Module):
    """Normalised in float32, whatever the activations' dtype. ``keep_float32_norms`` stores the weights
    in float32 once loaded (exactly the bf16 values), so a step does not convert them 61 times."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w.dtype == torch.float32:   # one fused op (x * rsqrt(mean(x^2) + eps) * w): 3 calls a norm, not 8
            return F.rms_norm(x.float(), w.shape, w, self.eps).to(x.dtype)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * w.float()).to(x.dtype)


def keep_float32_norms(model: nn.Module) -> None:
    """Every RMSNorm's weight as float32 (a lossless widening of what was loaded)."""
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.weight.data = m.weight.data.float()


class Attention(nn.Module):
    """q, k and v come from one fused projection (``qkv_proj``: one matmul instead of three, the
    loader stacks the checkpoint's q_proj / k_proj / v_proj rows, ``FUSED``)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, o_bias: bool = False) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.nh + 2 * self.nkv) * self.hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=o_bias)   # gpt-oss: o_bias
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, rope: "RopeTable", attn) -> torch.Tensor:
        T = x.shape[0]
        nq, nkv = self.nh, self.nkv
        qkv = self.qkv_proj(x).view(T, nq + 2 * nkv, self.hd)  # (T, Hq + 2 Hkv, D)
        if self.q_norm is None:
            # the backend's fused RoPE + KV write (it rotates whole heads: not for a partial rotary)
            q = None if rope.partial else attn.rotate_and_store(self.layer_idx, qkv, rope)
            if q is not None:
                return self.o_proj(attn.forward(self.layer_idx, q, None, None).reshape(T, nq * self.hd))
            qk = rope.apply(qkv[:, :nq + nkv])                 # q and k rotated together, (T, Hq + Hkv, D)
            q, k = qk[:, :nq].contiguous(), qk[:, nq:]         # backends view q as (T, Hkv, G, D)
        else:
            q = rope.apply(self.q_norm(qkv[:, :nq]))           # (T, Hq, D)
            k = rope.apply(self.k_norm(qkv[:, nq:nq + nkv]))   # (T, Hkv, D)
        v = qkv[:, nq + nkv:]                                  # (T, Hkv, D)
        out = attn.forward(self.layer_idx, q, k, v)            # (T, Hq, D)
        return self.o_proj(out.reshape(T, nq * self.hd))


class MLP(nn.Module):
    """SwiGLU with gate and up in one fused projection (``gate_up_proj``: [gate; up] rows)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)   # (T, I) each
        return self.down_proj(F.silu(gate) * up)

    def forward_fused(self, x: torch.Tensor, ops) -> torch.Tensor:
        """``forward`` through the C layer ops (``LlamaModel._forward_fused``): on GGUF blocks
        (engine/models/qlinear.py) a float32 decode step's whole MLP is one kernel call, else SiLU-multiply
        is one call between the projections."""
        swiglu = getattr(self.gate_up_proj, "swiglu", None)
        y = swiglu(self.down_proj, x) if swiglu is not None else None
        if y is None:
            y = self.down_proj(ops.silu_mul(self.gate_up_proj(x).contiguous()))
        return y


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp if mlp is not None else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, rope: RopeTable, attn):
        x = x + self.self_attn(self.input_layernorm(x), rope, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Decoder stack + LM head. ``mlp_factory(layer_idx)`` lets MoE models swap the MLP."""

    def __init__(self, cfg: ModelConfig, mlp_factory=None) -> None:
        super().__init__()
        self.cfg = cfg
        # no random init: weights are always loaded, and nn.Embedding's normal_ on the meta device imports
        # torch._dynamo (3 s of every engine start)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, mlp_factory(i) if mlp_factory else None) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg)
        if self.rope.partial:
            log.info("RoPE on %d of %d dimensions a head (partial_rotary_factor %s): RoPE and the K/V write run "
                     "in torch, not the C rope_store kernel (it rotates whole heads)",
                     self.rope.rotary_dim, cfg.head_dim, cfg.partial_rotary_factor)

    # set by the engine (``use_cpu_ops``): the residual add and the next RMSNorm, and SwiGLU's activation,
    # each as one C call (engine/models/cpu_ops.py) when the activations are bfloat16 or float32 on the CPU;
    # None: the plain layers
    cpu_ops = None
    # set by the engine (``use_decode_step``): bf16 / float32 decode steps on 4-bit blocks run their layers in one C
    # call (engine/models/decode_step.py), the same calls as ``_forward_fused``'s; None: that path
    decode_step = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """input_ids, positions: (T,) -> final hidden states (T, d)."""
        x = self.embed_tokens(input_ids)
        rope = self.rope.table(positions, x.dtype)
        if self.cpu_ops is not None and x.dtype in FUSED_DTYPES and x.dim() == 2:
            return self._forward_fused(x, rope, attn)
        for layer in self.layers:
            x = layer(x, rope, attn)
        return self.norm(x)

    def _forward_fused(self, x: torch.Tensor, rope: "RopeTable", attn) -> torch.Tensor:
        """The layers' ``x + f(norm(x))`` with each add and the norm after it in one call (x updated in
        place), and a plain MLP's ``silu(gate) * up`` in one: the same sums and roundings as the plain
        layers, in fewer operations."""
        x = x.contiguous()
        if self.decode_step is not None:                     # a decode step's layers in one C call
            h = self.decode_step(x, rope, attn)
            if h is not None:
                return h
        ops, layers = self.cpu_ops, self.layers
        norm = ops.add_rms_norm
        h = norm(x, None, layers[0].input_layernorm.weight, layers[0].input_layernorm.eps)
        for i, layer in enumerate(layers):
            post = layer.post_attention_layernorm
            h = norm(x, layer.self_attn(h, rope, attn).contiguous(), post.weight, post.eps)
            mlp = layer.mlp
            if type(mlp) is MLP:
                d = mlp.forward_fused(h, ops)
            else:                                             # an MoE block, say
                d = mlp(h)
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm
            h = norm(x, d.contiguous(), nxt.weight, nxt.eps)
        return h

    def use_cpu_ops(self, enabled: bool) -> bool:
        """Run bfloat16 and float32 steps through the C layer operations where they build and fit (float32
        norm weights); returns whether they are on."""
        self.cpu_ops = None
        if enabled and all(isinstance(m, RMSNorm) and m.weight.dtype == torch.float32 for m in self._norms()):
            from engine.models.cpu_ops import MAX_HIDDEN, load
            if self.cfg.hidden_size <= MAX_HIDDEN and self.embed_tokens.weight.device.type == "cpu":
                self.cpu_ops = load()
        return self.cpu_ops is not None

    def use_decode_step(self, enabled: bool, attn) -> bool:
        """Run the decode steps ``decode_step.DecodeStep`` takes in one C call (the C layer ops on, bfloat16 or
        float32 activations, 4-bit blocks, ``attn`` the torch backend with the C decode kernel); returns whether on."""
        self.decode_step = None
        plain = type(self) is LlamaModel and all(type(layer.mlp) is MLP for layer in self.layers)
        if enabled and plain and self.cpu_ops is not None and hasattr(attn, "c_decode_rows"):
            from engine.models.decode_step import load
            step = load(self, attn)
            self.decode_step = step if step is not None and step.supports(attn.kv) else None
        return self.decode_step is not None

    def _norms(self):
        for layer in self.layers:
            yield layer.input_layernorm
            yield layer.post_attention_layernorm
        yield self.norm

    def layer_attention(self) -> list[LayerAttention]:
        """Each layer's attention, for ``AttentionBackend.set_layer_attention``: the config's sliding
        window (Mistral), else plain."""
        return [LayerAttention(window=w) for w in self.cfg.sliding_windows or (None,) * self.cfg.num_layers]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, d) -> (B, vocab) in float32."""
        if self.lm_head is None:
            return (hidden @ self.embed_tokens.weight.t()).float()
        return self.lm_head(hidden).float()

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load weights named as in Hugging Face checkpoints (``model.layers.N...``)."""
        copy_hf_weights(self, state)


# fused module -> the checkpoint's modules whose output rows it stacks, in order
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def hf_sources(name: str) -> list[str]:
    """The checkpoint (Hugging Face) names of one of our parameters: ``layers.0.self_attn.qkv_proj.weight``
    is ``model.layers.0.self_attn.{q,k,v}_proj.weight`` stacked."""
    prefix = "" if name.startswith("lm_head") else "model."
    for fused, parts in FUSED.items():
        head, sep, kind = name.rpartition(f".{fused}.")
        if sep:
            return [f"{prefix}{head}.{part}.{kind}" for part in parts]
    return [prefix + name]


def copy_hf_weights(module: nn.Module, state, skip: tuple[str, ...] = ()) -> None:
    """Load every parameter and buffer of ``module`` (but those whose names start with one of ``skip``)
    from a checkpoint in HF names; a missing weight or a shape that differs is a ``ValueError``. A checkpoint
    tensor that is already what the parameter holds (one part, same dtype and device, contiguous, alone in its
    storage) becomes the parameter, not copied: the model and the checkpoint then share it, which only reads
    its weights (the embedding, o_proj, down_proj: half the default model's bytes not copied, not faulted in
    twice). Fused parameters get their parts copied into their rows. A weight the checkpoint holds as a ``meta``
    tensor (every part of it: the loader's ``dense_blocks=False``) is left as it was, unloaded."""
    missing: list[str] = []
    weights = module.state_dict()
    owners = Counter(t.data_ptr() for t in weights.values())
    for name, tensor in weights.items():
        if skip and name.startswith(skip):
            continue
        parts = hf_weight_parts(state, name, missing)
        if parts is None:
            continue
        shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
        if any(p.shape[1:] != parts[0].shape[1:] for p in parts) or shape != tensor.shape:
            raise ValueError(f"weight {name}: shape {tuple(shape)} != expected {tuple(tensor.shape)}")
        unloaded = [p.is_meta for p in parts]
        if any(unloaded):
            if not all(unloaded):
                raise ValueError(f"weight {name}: some of its parts were not loaded (meta), so none can be")
            continue
        if len(parts) == 1 and owners[tensor.data_ptr()] == 1 and _shareable(parts[0], tensor):
            _set_weight(module, name, parts[0])
            continue
        row = 0
        for p in parts:            # a fused weight's parts straight into their rows: no stacked copy first
            tensor[row:row + p.shape[0]].copy_(p)
            row += p.shape[0]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")


def _shareable(value: torch.Tensor, like: torch.Tensor) -> bool:
    return (value.dtype == like.dtype and value.device == like.device and value.is_contiguous()
            and not value.requires_grad and value.untyped_storage().nbytes() == value.numel() * value.element_size())


def _set_weight(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """``module``'s parameter or buffer ``name`` (dotted) replaced by ``value``."""
    path, _, leaf = name.rpartition(".")
    owner = module.get_submodule(path)
    if leaf in owner._parameters:
        owner._parameters[leaf] = nn.Parameter(value, requires_grad=owner._parameters[leaf].requires_grad)
    else:
        owner._buffers[leaf] = value


def hf_weight_parts(state, name: str, missing: list[str]) -> list[torch.Tensor] | None:
    """Our parameter ``name`` from a checkpoint in HF names: its parts, stacked along the first dimension
    (one part unless fused); None (and the names appended to ``missing``) when the checkpoint lacks it."""
    if name.rpartition(".")[0].endswith(tuple(FUSED)) and "model." + name in state:
        return [state["model." + name]]    # stored fused (Phi-3's qkv_proj, gate_up_proj)
    sources = hf_sources(name)
    absent = [s for s in sources if s not in state]
    if absent:
        missing.extend(absent)
        return None
    return [state[s] for s in sources]
