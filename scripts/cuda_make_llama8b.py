#!/usr/bin/env python3
"""cuda_make_llama8b.py - write a Llama-3.1-8B-shaped checkpoint with RANDOM weights (bf16,
N(0, 0.02) matrices, unit norms, untied lm_head, llama3 RoPE scaling) for end-to-end speed
runs of the GPU forward. Made on the GPU machine, never committed (16 GB). No tokenizer:
`tqkv bench model` feeds token ids.   Usage: cuda_make_llama8b.py OUT_DIR [N_LAYERS]"""
import json, os, sys, time
import torch
from safetensors.torch import save_file

out = sys.argv[1]
L = int(sys.argv[2]) if len(sys.argv) > 2 else 32
H, I, V, NH, NKV, HD = 4096, 14336, 128256, 32, 8, 128
os.makedirs(out, exist_ok=True)
cfg = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
    "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": NH,
    "num_key_value_heads": NKV, "head_dim": HD, "vocab_size": V, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}
json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=1)
g = torch.Generator(device="cuda").manual_seed(0)
def mat(n, k):
    return (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16).cpu()
def ones(n):
    return torch.ones(n, dtype=torch.bfloat16)
t0 = time.time()
shards, wmap, total = [], {}, 0
def flush(tensors, idx):
    global total
    name = f"model-{idx:05d}.safetensors"
    save_file(tensors, os.path.join(out, name), metadata={"format": "pt"})
    for k, v in tensors.items():
        wmap[k] = name
        total += v.numel() * 2
    shards.append(name)
cur = {"model.embed_tokens.weight": mat(V, H)}
for l in range(L):
    p = f"model.layers.{l}."
    cur.update({p + "self_attn.q_proj.weight": mat(NH * HD, H), p + "self_attn.k_proj.weight": mat(NKV * HD, H),
                p + "self_attn.v_proj.weight": mat(NKV * HD, H), p + "self_attn.o_proj.weight": mat(H, NH * HD),
                p + "mlp.gate_proj.weight": mat(I, H), p + "mlp.up_proj.weight": mat(I, H),
                p + "mlp.down_proj.weight": mat(H, I), p + "input_layernorm.weight": ones(H),
                p + "post_attention_layernorm.weight": ones(H)})
    if l % 8 == 7:
        flush(cur, len(shards) + 1)
        cur = {}
cur.update({"model.norm.weight": ones(H), "lm_head.weight": mat(V, H)})
flush(cur, len(shards) + 1)
json.dump({"metadata": {"total_size": total}, "weight_map": wmap},
          open(os.path.join(out, "model.safetensors.index.json"), "w"), indent=1)
print(f"wrote {total / 1e9:.2f} GB in {len(shards)} shards to {out} in {time.time() - t0:.1f} s", flush=True)
