"""Batch-1 decode on a K-quant GGUF mix: its blocks (``quantization="gguf"``) against its weights dequantized.

    python benchmarks/kquant_decode.py --json OUT

The GGUFs agents download are mostly K-quant mixes (Q4_K_M: Q4_K layers, Q6_K for attn_v and ffn_down of half
the layers and the output). No such file of the default model ships, so this script makes one from the default
model's GGUF (``recode``): every ffn_down (1,536 inputs: whole 256-value super-blocks) as Q4_K in odd layers and
Q8_0 in even ones (standing for Q6_K: wider blocks, which the engine keeps in 8 bits either way), attn_v Q8_0 in
even layers, the rest as stored (Q4_1: 576 inputs take no Q4_K, as llama.cpp falls back for such shapes). Q4_K
blocks come from ``quantize_q4_k``, a plain encoder (llama.cpp searches its scales; these are valid blocks, not
its values).

Each side, in ABBA order over ``--repeats``: one greedy request of ``--tokens`` tokens (``ignore_eos``, speculation
off, the cache flushed before it) on an engine over that file: ``float32`` / ``bfloat16`` activations, on its
``dense`` weights (``quantization="off"``, what ``auto`` served such a file before it read K-quant blocks) or its
``gguf`` blocks. Reported: decode tok/s per side (median and range), the ``auto`` pick for the file, and each
side's quantization as built.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script: benchmarks/ importable

from benchmarks import harness  # noqa: E402

SIDES = {"float32-dense": ("float32", "off"), "float32-gguf": ("float32", "gguf"),
         "bfloat16-dense": ("bfloat16", "off"), "bfloat16-gguf": ("bfloat16", "gguf")}
PROMPT = "Write a short story about a lighthouse keeper."


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float32 (rows, cols), cols a multiple of 256 -> Q4_K blocks (rows, cols / 256 * 144) uint8: per block of
    32 its min (<= 0) and range / 15, the super-block's d and dmin the largest of those over 63, each then
    rounded to 6 bits. A plain encoder (llama.cpp's searches its scales), enough to make valid blocks."""
    rows, cols = w.shape
    x = w.reshape(-1, 8, 32).astype(np.float32)
    n = x.shape[0]
    lo = np.minimum(x.min(-1), 0)
    step = (x.max(-1) - lo) / 15
    d16, dmin16 = (step.max(-1) / 63).astype(np.float16), ((-lo).max(-1) / 63).astype(np.float16)
    d, dmin = d16.astype(np.float32)[:, None], dmin16.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(step, d, out=np.zeros_like(step), where=d > 0)), 0, 63)
    mn = np.clip(np.round(np.divide(-lo, dmin, out=np.zeros_like(lo), where=dmin > 0)), 0, 63)
    dj, mj = (d * sc)[..., None], (dmin * mn)[..., None]
    q = np.clip(np.round(np.divide(x + mj, dj, out=np.zeros_like(x), where=dj > 0)), 0, 15).astype(np.uint8)
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    scales = np.concatenate([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=1)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n, 128)                  # blocks 2g (low) and 2g + 1 (high)
    out = np.concatenate([d16.view(np.uint8).reshape(n, 2), dmin16.view(np.uint8).reshape(n, 2), scales, qs], 1)
    return out.reshape(rows, -1)


def recode(path: str, out) -> dict[str, str]:
    """The default model as a K-quant mix, as llama.cpp's Q4_K_M lays one out where shapes allow: every
    ffn_down (1536 inputs, whole super-blocks) Q4_K in odd layers and Q8_0 in even ones (standing for Q6_K:
    wider blocks), attn_v Q8_0 in even layers; the rest as stored (Q4_1; 576 inputs take no Q4_K). Returns the
    type of each recoded tensor."""
    import gguf

    from engine.loader.gguf_file import dequantize, read_gguf

    reader = gguf.GGUFReader(path)
    w = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        w.add_key_value(field.name, field.contents(), kind,
                        sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    ours = {t.name: t for t in read_gguf(path).tensors}
    types = {}
    for t in reader.tensors:
        layer = int(t.name.split(".")[1]) if t.name.startswith("blk.") else -1
        if t.name.endswith("ffn_down.weight"):
            types[t.name] = "Q4_K" if layer % 2 else "Q8_0"
        elif t.name.endswith("attn_v.weight") and layer % 2 == 0:
            types[t.name] = "Q8_0"
        if t.name not in types:
            w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
            continue
        dense = dequantize(ours[t.name]).numpy()
        kind = gguf.GGMLQuantizationType[types[t.name]]
        data = quantize_q4_k(dense) if types[t.name] == "Q4_K" else gguf.quants.quantize(dense, kind)
        w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return types


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=64, help="tokens each timed request decodes (default 64)")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {', '.join(SIDES)}")
    parser.add_argument("--file", type=Path, default=None,
                        help="where to write the K-quant mix (default: a temporary file, removed after)")
    harness.add_common_args(parser, repeats=4)
    args = parser.parse_args(argv)
    sides = [s for s in args.sides.split(",") if s]
    unknown = sorted(set(sides) - set(SIDES))
    if unknown or not sides or args.tokens < 1:
        parser.error(f"--sides: unknown {unknown}; choose from {', '.join(SIDES)}; --tokens >= 1")

    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.loader import gguf_weight_types, resolve_model
    from engine.tokenizer import encode_chat

    run = harness.Run(args, __file__, argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(args.file or Path(tmp) / "smollm2-kquant-mix.gguf")
        types = recode(resolve_model(None)[0], path)
        engines = {s: LLMEngine(EngineConfig(model=path, dtype=SIDES[s][0], quantization=SIDES[s][1],
                                             kv_cache_tokens=4096, speculative="off")) for s in sides}
        prompt = encode_chat(engines[sides[0]].tokenizer, [{"role": "user", "content": PROMPT}])
        params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
        rates: dict[str, list[float]] = {s: [] for s in sides}
        for _, side in harness.ab_order(sides, args.repeats, args.order):
            engine = engines[side]
            engine.flush_cache()
            engine.step()                                      # applies the flush: every run prefills again
            t0 = time.perf_counter()
            out = engine.generate([prompt], params)[0]
            rates[side].append(len(out.token_ids) / (time.perf_counter() - t0))
        weight_types = sorted(gguf_weight_types(path))
        auto = EngineConfig(model=path, dtype="auto").resolved_quantization(set(weight_types))
    body = {"workload": {"tokens": args.tokens, "prompt": PROMPT, "recoded": types, "weight_types": weight_types},
            "auto_quantization": auto,
            "sides": {s: {"dtype": SIDES[s][0], "quantization": engines[s].quantization,
                          "decode_tok_s": harness.spread(rates[s])} for s in sides}}
    for s in sides:
        print(f"{s}: {body['sides'][s]['decode_tok_s']['median']:.1f} tok/s", flush=True)
    print(f"auto picks {auto} for this file", flush=True)
    return run.write(body, engine=engines[sides[-1]])


if __name__ == "__main__":
    main()
