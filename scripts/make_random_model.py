#!/usr/bin/env python3
"""Writes a Llama-family model with random weights in a named shape, for memory
and speed figures on shapes larger than the default model (issue 11).

    .venv-ref/bin/python scripts/make_random_model.py --shape llama-3.2-1b \
        --format gguf --type q4_0                  # -> models/random-llama-3.2-1b.Q4_0.gguf
    .venv-ref/bin/python scripts/make_random_model.py --shape llama-3-8b \
        --format hf --dtype bf16                   # -> models/random-llama-3-8b-bf16/

Weights: normal(0, 0.02) for every matrix, 1.0 for the RMSNorm weights, drawn
per tensor from a generator seeded by (--seed, tensor name), so a file is
reproducible and the GGUF and HF outputs hold the same model (the GGUF q/k rows
are permuted the way convert_hf_to_gguf.py does). RoPE is plain (rope_theta
only; no llama3 frequency scaling): the weights are random anyway.

Tokenizer: SmolLM2's (read from the default model's GGUF metadata), padded with
"<|reserved_special_token_N|>" control tokens up to the shape's vocabulary, so
loom's tokenizer loads and training text tokenizes (ids < 49152).

Streaming: tensors are generated, converted and written one at a time (the
embedding and output matrices in row chunks), so peak memory stays at about
one layer matrix, never the file's size.
"""
from __future__ import annotations

import argparse
import json
import struct
import sys
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TOKENIZER = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
STD = 0.02
CHUNK_ROWS = 8192  # rows of the embedding / output matrix generated at once
ALIGN = gguf.GGUF_DEFAULT_ALIGNMENT
SHARD_BYTES = 4 * 1000**3  # HF folders are sharded above this (transformers' default 5 GB is close)


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope_theta: float
    tied: bool
    rms_eps: float


SHAPES = {
    "llama-3.2-1b": Shape(2048, 16, 32, 8, 64, 8192, 128256, 500000.0, True, 1e-5),
    "llama-3-8b": Shape(4096, 32, 32, 8, 128, 14336, 128256, 500000.0, False, 1e-5),
    "smollm2-135m": Shape(576, 30, 9, 3, 64, 1536, 49152, 100000.0, True, 1e-5),
}

GGUF_TYPES = {"q4_0": QT.Q4_0, "q4_1": QT.Q4_1, "q8_0": QT.Q8_0, "f16": QT.F16}
FILE_TYPE = {QT.F16: 1, QT.Q4_0: 2, QT.Q4_1: 3, QT.Q8_0: 7}


# ---------------------------------------------------------------- tensors

@dataclass(frozen=True)
class TensorSpec:
    hf_name: str
    gguf_name: str
    shape: tuple[int, ...]  # HF [out, in] order
    permute_heads: int = 0  # >0: GGUF q/k row permutation with this many heads


def tensor_specs(s: Shape) -> list[TensorSpec]:
    """HF-ordered list of every tensor of the model."""
    q_rows, kv_rows = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out = [TensorSpec("model.embed_tokens.weight", "token_embd.weight", (s.vocab, s.hidden))]
    for b in range(s.layers):
        p, g = f"model.layers.{b}.", f"blk.{b}."
        out += [
            TensorSpec(p + "input_layernorm.weight", g + "attn_norm.weight", (s.hidden,)),
            TensorSpec(p + "self_attn.q_proj.weight", g + "attn_q.weight", (q_rows, s.hidden), s.heads),
            TensorSpec(p + "self_attn.k_proj.weight", g + "attn_k.weight", (kv_rows, s.hidden), s.kv_heads),
            TensorSpec(p + "self_attn.v_proj.weight", g + "attn_v.weight", (kv_rows, s.hidden)),
            TensorSpec(p + "self_attn.o_proj.weight", g + "attn_output.weight", (s.hidden, q_rows)),
            TensorSpec(p + "post_attention_layernorm.weight", g + "ffn_norm.weight", (s.hidden,)),
            TensorSpec(p + "mlp.gate_proj.weight", g + "ffn_gate.weight", (s.ffn, s.hidden)),
            TensorSpec(p + "mlp.up_proj.weight", g + "ffn_up.weight", (s.ffn, s.hidden)),
            TensorSpec(p + "mlp.down_proj.weight", g + "ffn_down.weight", (s.hidden, s.ffn)),
        ]
    out.append(TensorSpec("model.norm.weight", "output_norm.weight", (s.hidden,)))
    if not s.tied:
        out.append(TensorSpec("lm_head.weight", "output.weight", (s.vocab, s.hidden)))
    return out


def row_chunks(spec: TensorSpec, seed: int):
    """Yields the tensor's f32 values (HF layout) in row chunks; 1-D tensors are ones.

    The generator is seeded by (seed, name) and the chunk size is fixed, so the
    values do not depend on the output format."""
    if len(spec.shape) == 1:
        yield np.ones(spec.shape, dtype=np.float32)
        return
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, zlib.crc32(spec.hf_name.encode())])))
    rows, cols = spec.shape
    step = rows if spec.permute_heads else CHUNK_ROWS  # q/k: whole (small) matrix, for the permutation
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        w = rng.standard_normal((n, cols), dtype=np.float32)
        w *= np.float32(STD)
        yield w


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF -> GGUF q/k row order (llama.cpp's LlamaModel.permute)."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------- tokenizer

@dataclass
class Vocab:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    bos: int
    eos: int
    unk: int
    pad: int
    pre: str
    chat_template: str | None


def _field(r: gguf.GGUFReader, key: str):
    f = r.fields.get(key)
    return None if f is None else f.contents()


def load_vocab(path: Path, vocab_size: int) -> Vocab:
    if not path.is_file():
        sys.exit(f"error: tokenizer source {path}: no such file (run scripts/fetch_model, or pass --tokenizer)")
    r = gguf.GGUFReader(path)
    tokens = list(_field(r, "tokenizer.ggml.tokens"))
    types = [int(t) for t in _field(r, "tokenizer.ggml.token_type")]
    if len(tokens) > vocab_size:
        sys.exit(f"error: tokenizer source {path} has {len(tokens)} tokens, more than the shape's vocab {vocab_size}")
    n0 = len(tokens)
    for i in range(vocab_size - n0):  # Llama-3 spells its spare ids this way
        tokens.append(f"<|reserved_special_token_{i}|>")
        types.append(3)  # CONTROL
    return Vocab(tokens, types, list(_field(r, "tokenizer.ggml.merges")),
                 int(_field(r, "tokenizer.ggml.bos_token_id")), int(_field(r, "tokenizer.ggml.eos_token_id")),
                 int(_field(r, "tokenizer.ggml.unknown_token_id")), int(_field(r, "tokenizer.ggml.padding_token_id")),
                 str(_field(r, "tokenizer.ggml.pre")), _field(r, "tokenizer.chat_template"))


# ---------------------------------------------------------------- GGUF

def gguf_type_of(spec: TensorSpec, big: QT) -> QT:
    if len(spec.shape) == 1:
        return QT.F32
    block = gguf.GGML_QUANT_SIZES[big][0]
    return big if spec.shape[1] % block == 0 else QT.F16  # as llama-quantize falls back


def gguf_nbytes(spec: TensorSpec, qt: QT) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qt]
    n = int(np.prod(spec.shape))
    return n // block * size


def encode_gguf(w: np.ndarray, qt: QT) -> np.ndarray:
    if qt == QT.F32:
        return w.astype(np.float32, copy=False)
    if qt == QT.F16:
        return w.astype(np.float16)
    return gguf.quants.quantize(w, qt)


def write_gguf(path: Path, name: str, s: Shape, vocab: Vocab, big: QT, seed: int, context: int) -> None:
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(name)
    w.add_block_count(s.layers)
    w.add_context_length(context)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_file_type(FILE_TYPE[big])
    w.add_vocab_size(s.vocab)
    if big != QT.F16:
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    w.add_token_merges(vocab.merges)
    w.add_bos_token_id(vocab.bos)
    w.add_eos_token_id(vocab.eos)
    w.add_unk_token_id(vocab.unk)
    w.add_pad_token_id(vocab.pad)
    w.add_add_bos_token(False)
    if vocab.chat_template:
        w.add_chat_template(vocab.chat_template)

    specs = tensor_specs(s)
    for spec in specs:  # tensor infos first: the data is streamed after the header
        qt = gguf_type_of(spec, big)
        w.add_tensor_info(spec.gguf_name, spec.shape, np.dtype(np.float32), gguf_nbytes(spec, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    for i, spec in enumerate(specs):
        qt = gguf_type_of(spec, big)
        w.write_padding(fout, fout.tell())
        written = 0
        for chunk in row_chunks(spec, seed):
            if spec.permute_heads:
                chunk = permute_rows(chunk, spec.permute_heads)
            data = encode_gguf(chunk, qt)
            data.tofile(fout)
            written += data.nbytes
        assert written == gguf_nbytes(spec, qt), spec.gguf_name
        w.write_padding(fout, written)
        progress(i, len(specs), spec.gguf_name)
    w.close()


# ---------------------------------------------------------------- HF folder

def to_bf16_bits(w: np.ndarray) -> np.ndarray:
    """f32 -> bf16 (round to nearest even) as uint16 bit patterns."""
    b = w.view(np.uint32)
    rounded = b + (np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1)))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def encode_hf(w: np.ndarray, dtype: str) -> np.ndarray:
    return w.astype(np.float16) if dtype == "f16" else to_bf16_bits(w)


def shard_plan(specs: list[TensorSpec], elem: int) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nb = int(np.prod(spec.shape)) * elem
        if shards[-1] and size + nb > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nb
    return shards


def write_safetensors(path: Path, specs: list[TensorSpec], dtype: str, seed: int) -> None:
    st_dtype = {"bf16": "BF16", "f16": "F16"}[dtype]
    header: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for spec in specs:
        nb = int(np.prod(spec.shape)) * 2
        header[spec.hf_name] = {"dtype": st_dtype, "shape": list(spec.shape), "data_offsets": [off, off + nb]}
        off += nb
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * (-len(hj) % 8)  # the data starts 8-aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for spec in specs:
            for chunk in row_chunks(spec, seed):
                encode_hf(chunk, dtype).tofile(f)


def hf_config(s: Shape, vocab: Vocab, dtype: str, context: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": s.hidden, "intermediate_size": s.ffn, "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim,
        "hidden_act": "silu", "rms_norm_eps": s.rms_eps, "rope_theta": s.rope_theta, "rope_scaling": None,
        "max_position_embeddings": context, "vocab_size": s.vocab, "tie_word_embeddings": s.tied,
        "attention_bias": False, "mlp_bias": False,
        "torch_dtype": {"bf16": "bfloat16", "f16": "float16"}[dtype],
        "bos_token_id": vocab.bos, "eos_token_id": vocab.eos,
    }


def tokenizer_json(vocab: Vocab) -> dict:
    """HF `tokenizers` document for SmolLM2's byte-level BPE plus the padding tokens."""
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True}
             for i, (t, ty) in enumerate(zip(vocab.tokens, vocab.types)) if ty == 3]
    if vocab.pre != "smollm":
        sys.exit(f"error: tokenizer source pre-tokenizer {vocab.pre!r}: only 'smollm' is written to tokenizer.json")
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, byte_level]},
        "post_processor": dict(byte_level, trim_offsets=False),
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(vocab.tokens)},
                  "merges": [m.split(" ", 1) for m in vocab.merges]},
    }


def write_hf(out: Path, s: Shape, vocab: Vocab, dtype: str, seed: int, context: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    specs = tensor_specs(s)
    shards = shard_plan(specs, 2)
    n = len(shards)
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = "model.safetensors" if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        write_safetensors(out / fname, shard, dtype, seed)
        weight_map.update({spec.hf_name: fname for spec in shard})
        progress(k, n, fname)
    if n > 1:
        total = sum(int(np.prod(sp.shape)) * 2 for sp in specs)
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(hf_config(s, vocab, dtype, context), indent=1))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": vocab.bos, "eos_token_id": vocab.eos}, indent=1))
    (out / "tokenizer.json").write_text(json.dumps(tokenizer_json(vocab), ensure_ascii=False))
    tok_cfg = {"bos_token": vocab.tokens[vocab.bos], "eos_token": vocab.tokens[vocab.eos],
               "pad_token": vocab.tokens[vocab.pad], "unk_token": vocab.tokens[vocab.unk],
               "add_bos_token": False, "model_max_length": context,
               "tokenizer_class": "GPT2Tokenizer"}
    if vocab.chat_template:
        tok_cfg["chat_template"] = vocab.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1, ensure_ascii=False))


# ---------------------------------------------------------------- main

def progress(i: int, n: int, what: str) -> None:
    if sys.stderr.isatty() or i + 1 == n or i % 16 == 0:
        print(f"  [{i + 1}/{n}] {what}", file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, help="override the shape's layer count")
    ap.add_argument("--format", choices=["gguf", "hf"], default="gguf")
    ap.add_argument("--type", choices=sorted(GGUF_TYPES), default="q4_0", help="GGUF matrix type")
    ap.add_argument("--dtype", choices=["bf16", "f16"], default="bf16", help="HF folder dtype")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--context", type=int, default=8192, help="context_length written (default 8192)")
    ap.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER, help="GGUF whose tokenizer is reused")
    ap.add_argument("--out", type=Path, help="output file (gguf) or folder (hf); default under models/")
    a = ap.parse_args()

    shape = SHAPES[a.shape]
    if a.layers is not None:
        if a.layers < 1:
            ap.error(f"--layers {a.layers}: must be at least 1")
        shape = replace(shape, layers=a.layers)
    if a.context < 1:
        ap.error(f"--context {a.context}: must be at least 1")
    stem = f"random-{a.shape}" + (f"-{shape.layers}l" if a.layers is not None else "")
    vocab = load_vocab(a.tokenizer, shape.vocab)
    if a.format == "gguf":
        out = a.out or ROOT / "models" / f"{stem}.{a.type.upper()}.gguf"
        out.parent.mkdir(parents=True, exist_ok=True)
        write_gguf(out, stem, shape, vocab, GGUF_TYPES[a.type], a.seed, a.context)
    else:
        out = a.out or ROOT / "models" / f"{stem}-{a.dtype}"
        write_hf(out, shape, vocab, a.dtype, a.seed, a.context)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
