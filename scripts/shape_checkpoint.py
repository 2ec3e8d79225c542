"""A model's shape without its weights, for machines the weights cannot reach.

The GPU check runs on a machine that cannot download anything and takes at most a few tens of
megabytes along, less than the default model's GGUF file. Attention kernels and decode speed
depend on the model's shape, not on its trained values, so this carries the shape:

    # here, where the model is installed
    python scripts/shape_checkpoint.py export OUT_DIR [--model PATH]
    # there: random weights of exactly that shape (seeded), written once
    python scripts/shape_checkpoint.py fill OUT_DIR [--seed 0]

``export`` writes an HF-style directory: config.json, tokenizer.json, tokenizer_config.json
(the chat template) and shapes.json (every tensor's name and shape). ``fill`` adds
model.safetensors in bf16 with normal(0, 0.02) matrices and unit norm weights, so the engine
loads the directory like any Hugging Face model (engine/loader/hf_loader.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def export(out_dir: str, model: str | None) -> None:
    import torch

    from engine.loader import load_model_files

    cfg, state, tok, model_id, _ = load_model_files(model, torch.float32)
    if cfg.moe:
        raise SystemExit("export writes dense Llama-family shapes only")
    os.makedirs(out_dir, exist_ok=True)
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}[cfg.architecture]
    hf_cfg = {"architectures": [arch], "model_type": cfg.architecture, "vocab_size": cfg.vocab_size,
              "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
              "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
              "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
              "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
              "max_position_embeddings": cfg.max_position_embeddings,
              "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.attention_bias,
              "bos_token_id": tok.bos_token_id, "eos_token_id": list(tok.eos_token_ids),
              "shape_of": model_id}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=1)
    tok.hf.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": tok.chat_template, "add_bos_token": tok.add_bos}, f)
    with open(os.path.join(out_dir, "shapes.json"), "w") as f:
        json.dump({name: list(t.shape) for name, t in state.items()}, f, indent=0)
    print(f"{out_dir}: shape of {model_id}, {len(state)} tensors, "
          f"{sum(t.numel() for t in state.values()) / 1e6:.1f}M parameters")


def fill(out_dir: str, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    with open(os.path.join(out_dir, "shapes.json")) as f:
        shapes = json.load(f)
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in sorted(shapes.items()):
        if len(shape) == 1:  # norm weights (and biases, which stay small)
            t = torch.ones(shape) if name.endswith("norm.weight") else torch.zeros(shape)
        else:
            t = torch.randn(shape, generator=gen) * 0.02
        state[name] = t.to(torch.bfloat16).contiguous()
    save_file(state, os.path.join(out_dir, "model.safetensors"))
    print(f"{out_dir}: random weights (seed {seed}), {len(state)} tensors")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("out_dir")
    e.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded model)")
    fl = sub.add_parser("fill")
    fl.add_argument("out_dir")
    fl.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.cmd == "export":
        export(args.out_dir, args.model)
    else:
        fill(args.out_dir, args.seed)


if __name__ == "__main__":
    main()
