#!/usr/bin/env python3
"""cuda_make_qwen3moe30b.py - write a Qwen3-30B-A3B-shaped Qwen3-MoE checkpoint for the GPU
speed points of issue 24 (48 layers, hidden 2048, 32 query / 4 KV heads, head_dim 128, 128
experts top 8 of width 768, every layer sparse, norm_topk_prob, vocab 151936, untied head:
30.5 B parameters, 61 GB of bf16). Made on the GPU machine, never committed. No tokenizer:
`tqkv bench model` feeds token ids.

The attention, router, norm, embedding and head tensors are RANDOM (bf16 of random sign and
magnitude in [2^-7, 2^-5): windows at random offsets of a 64 MiB pool from os.urandom, so
no torch or numpy is needed and it runs at disk speed; norms ones); the experts'
tensors (mlp.experts.gate_up_proj [128, 1536, 2048] and down_proj [128, 2048, 768] per layer,
fused, 58 GB) are ZEROS left as holes of sparse files: their bytes are never written, each
shard is truncated to its full size, so the checkpoint takes about 3 GB of disk for its 61 GB.
A zero expert costs the same GEMM time as a random one (the same bytes move, the same
multiply-adds run; tensor-core time does not depend on the values), so decode speed is that of
the real shape. The routing does not see the experts: the random router spreads tokens
over experts as a trained one roughly does.

Usage: cuda_make_qwen3moe30b.py OUT_DIR [N_LAYERS]   (N_LAYERS < 48 for a quick check)"""
import json, os, sys, time

out = sys.argv[1]
L = int(sys.argv[2]) if len(sys.argv) > 2 else 48
H, V, NH, NKV, HD, E, K, I = 2048, 151936, 32, 4, 128, 128, 8, 768
os.makedirs(out, exist_ok=True)
cfg = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": H,
    "intermediate_size": 6144, "num_hidden_layers": L, "num_attention_heads": NH,
    "num_key_value_heads": NKV, "head_dim": HD, "vocab_size": V, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": False,
    "attention_bias": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
    "num_experts": E, "num_experts_per_tok": K, "moe_intermediate_size": I,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "bos_token_id": 151643, "eos_token_id": 151645,
}
json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=1)
# little-endian bf16 high byte: keep the sign, exponent 0x78 / 0x79 (the low byte's top bit)
HIGH = bytes((b & 0x80) | 0x3C for b in range(256))


POOL = bytearray(os.urandom(64 << 20))
POOL[1::2] = bytes(POOL[1::2]).translate(HIGH)
POOL = bytes(POOL)
SEED = int.from_bytes(os.urandom(4), "little")


def mat(*shape):  # random bf16 bytes, |v| in [2^-7, 2^-5)
    global SEED
    n = 2
    for d in shape:
        n *= d
    parts, left = [], n
    while left:
        SEED = (SEED * 1103515245 + 12345) & 0x7FFFFFFF
        at = (SEED % (len(POOL) // 2)) * 2  # bf16-aligned window
        take = min(left, len(POOL) - at)
        parts.append(POOL[at:at + take])
        left -= take
    return b"".join(parts)


def ones(n):  # bf16 1.0 = 0x3F80
    return b"\x80\x3f" * n


wmap, total, shards = {}, 0, []


def write_shard(tensors):
    """tensors: [(name, shape, bytes or None)]; None: zeros, left as a hole."""
    global total
    name = f"model-{len(shards) + 1:05d}.safetensors"
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for n, shape, _ in tensors:
        nb = 2
        for d in shape:
            nb *= d
        header[n] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + nb]}
        off += nb
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * ((8 - len(hb) % 8) % 8)
    base = 8 + len(hb)
    with open(os.path.join(out, name), "wb") as f:
        f.write(len(hb).to_bytes(8, "little"))
        f.write(hb)
        for n, shape, data in tensors:
            start = header[n]["data_offsets"][0]
            if data is not None:
                f.seek(base + start)
                f.write(data)
            wmap[n] = name
        f.truncate(base + off)  # the holes up to the end read as zeros
    total += off
    shards.append(name)


t0 = time.time()
write_shard([("model.embed_tokens.weight", (V, H), mat(V, H))])
for l in range(L):
    p = f"model.layers.{l}."
    write_shard([
        (p + "self_attn.q_proj.weight", (NH * HD, H), mat(NH * HD, H)),
        (p + "self_attn.k_proj.weight", (NKV * HD, H), mat(NKV * HD, H)),
        (p + "self_attn.v_proj.weight", (NKV * HD, H), mat(NKV * HD, H)),
        (p + "self_attn.o_proj.weight", (H, NH * HD), mat(H, NH * HD)),
        (p + "self_attn.q_norm.weight", (HD,), ones(HD)),
        (p + "self_attn.k_norm.weight", (HD,), ones(HD)),
        (p + "input_layernorm.weight", (H,), ones(H)),
        (p + "post_attention_layernorm.weight", (H,), ones(H)),
        (p + "mlp.gate.weight", (E, H), mat(E, H)),
        (p + "mlp.experts.gate_up_proj", (E, 2 * I, H), None),
        (p + "mlp.experts.down_proj", (E, H, I), None),
    ])
write_shard([("model.norm.weight", (H,), ones(H)), ("lm_head.weight", (V, H), mat(V, H))])
json.dump({"metadata": {"total_size": total}, "weight_map": wmap},
          open(os.path.join(out, "model.safetensors.index.json"), "w"), indent=1)
disk = sum(os.stat(os.path.join(out, s)).st_blocks * 512 for s in shards)
print(f"wrote {total / 1e9:.2f} GB of tensors ({disk / 1e9:.2f} GB on disk) in {len(shards)} "
      f"shards to {out} in {time.time() - t0:.1f} s", flush=True)
