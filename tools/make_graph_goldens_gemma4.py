#!/usr/bin/env python3
"""Make tiny random-weight Gemma 4 checkpoints and their transformers fp32 goldens.

Owns: tests/golden/gemma4/<variant>/{config.json, model.safetensors, golden.json, logits.bin}.
Must not: be imported by the product or by tests at run time; tests read only the files.
Runs where torch + transformers (5.17) are installed (the GPU machine), on the CPU in float32.

usage:
  python3 tools/make_graph_goldens_gemma4.py --out OUTDIR

Variants (hidden 64, 4 query heads, sliding head_dim 32, full head_dim 64, vocab 512):
  base        S F S F S F, KV sharing (layers 4, 5 read donors 2, 3), per-layer inputs,
              window 8 (shorter than the prompts), no soft-capping
  keqv_cap    S S F F S F, attention_k_eq_v (full layers: 1 KV head, V = raw K projection),
              final_logit_softcapping 15, KV sharing (layers 4, 5 read donors 1, 3)
  plain       S F S F, no sharing, no per-layer inputs, window 4
Every weight is random (norm weights around 1, layer_scalar in [0.5, 1.5]) so that each
term of the graph changes the logits.

golden.json: {"prompts": [[ids]], "logits_offset": [row of logits.bin where prompt i's
[len, vocab] block starts], "greedy": [[12 ids]] (full recompute each step, no cache),
"vocab": V, "layers": [{type, head_dim, kv_heads, shared, window}], "inv_freq": {type: [...]}}
logits.bin: float32 little-endian [rows, vocab], every position of every prompt.
"""
import argparse
import json
import os
import sys
import traceback

import torch

N_GREEDY = 12
PROMPT_LENS = [22, 15, 9]


def base_dict(layer_types, shared, window, ple, softcap=None, k_eq_v=False):
    return {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attention_k_eq_v": k_eq_v,
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0,
        "enable_moe_block": False,
        "final_logit_softcapping": softcap,
        "head_dim": 32,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 64,
        "hidden_size_per_layer_input": ple,
        "intermediate_size": 128,
        "layer_types": layer_types,
        "max_position_embeddings": 1024,
        "num_attention_heads": 4,
        "num_hidden_layers": len(layer_types),
        "num_key_value_heads": 2,
        "num_kv_shared_layers": shared,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                               "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "sliding_window": window,
        "tie_word_embeddings": True,
        "use_double_wide_mlp": False,
        "vocab_size": 512,
        "vocab_size_per_layer_input": 512,
        "dtype": "float32",
    }


VARIANTS = {
    "base": dict(layer_types=["sliding_attention", "full_attention"] * 3, shared=2, window=8,
                 ple=16),
    "keqv_cap": dict(layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                  "full_attention", "sliding_attention", "full_attention"],
                     shared=2, window=8, ple=16, softcap=15.0, k_eq_v=True),
    "plain": dict(layer_types=["sliding_attention", "full_attention"] * 2, shared=0, window=4,
                  ple=0),
}


def import_gemma4():
    try:
        from transformers import Gemma4ForCausalLM, Gemma4TextConfig
    except ImportError:
        from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig
        from transformers.models.gemma4.modeling_gemma4 import Gemma4ForCausalLM
    return Gemma4TextConfig, Gemma4ForCausalLM


def layer_info(model):
    out = []
    for i, layer in enumerate(model.model.layers):
        a = layer.self_attn
        kv = a.k_proj.weight.shape[0] // a.head_dim if hasattr(a, "k_proj") else None
        out.append({"type": a.layer_type, "head_dim": a.head_dim, "kv_heads": kv,
                    "shared": bool(a.is_kv_shared_layer), "window": a.sliding_window,
                    "has_v_proj": getattr(a, "v_proj", None) is not None})
    return out


def build(name, spec, log):
    Cfg, Model = import_gemma4()
    d = base_dict(**spec)
    full = [i for i, t in enumerate(d["layer_types"]) if t == "full_attention"]
    attempts = []
    # (1) flat names, (2) per_layer_config as the trained fixture's config.json carries
    a1 = dict(d, global_head_dim=64)
    if spec.get("k_eq_v"):
        a1["num_global_key_value_heads"] = 1
    attempts.append(("global_head_dim", a1))
    plc = {str(i): {"head_dim": 64} for i in full}
    if spec.get("k_eq_v"):
        for i in full:
            plc[str(i)]["num_key_value_heads"] = 1
    attempts.append(("per_layer_config", dict(d, per_layer_config=plc)))
    for how, kw in attempts:
        try:
            cfg = Cfg(**kw)
            try:
                cfg._attn_implementation = "eager"
            except Exception:
                pass
            torch.manual_seed(1234)
            model = Model(cfg).float().eval()
            info = layer_info(model)
            ok = all(info[i]["head_dim"] == 64 for i in full)
            if spec.get("k_eq_v"):
                ok = ok and all(info[i]["kv_heads"] in (1, None) for i in full)
            log(f"{name}: config via {how}: layers {info} ok={ok}")
            if ok:
                return cfg, model, info
        except Exception:
            log(f"{name}: config via {how} failed:\n{traceback.format_exc()}")
    raise RuntimeError(f"{name}: no config form gave full head_dim 64")


@torch.no_grad()
def randomize(model, gen):
    for pname, p in model.named_parameters():
        if p.ndim == 1:  # norm weights
            p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
        elif "embed_tokens_per_layer" in pname:
            p.copy_(torch.randn(p.shape, generator=gen))
        elif "embed_tokens" in pname:
            p.copy_(torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / (p.shape[1] ** 0.5))
    for bname, b in model.named_buffers():
        if bname.endswith("layer_scalar"):
            b.copy_(0.5 + torch.rand(b.shape, generator=gen))


@torch.no_grad()
def logits_of(model, ids):
    x = torch.tensor([ids], dtype=torch.long)
    return model(input_ids=x, use_cache=False).logits[0].float()


def make(name, spec, out, log):
    cfg, model, info = build(name, spec, log)
    gen = torch.Generator().manual_seed(7 + len(name))
    randomize(model, gen)
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    model.save_pretrained(d, safe_serialization=True)
    for f in os.listdir(d):
        if f not in ("config.json", "model.safetensors"):
            os.remove(os.path.join(d, f))
    V = cfg.vocab_size
    prompts, offsets, greedy, blocks = [], [], [], []
    row = 0
    for i, n in enumerate(PROMPT_LENS):
        ids = torch.randint(2, V, (n,), generator=gen).tolist()
        lg = logits_of(model, ids)
        prompts.append(ids)
        offsets.append(row)
        blocks.append(lg)
        row += lg.shape[0]
        seq = list(ids)
        cont = []
        for _ in range(N_GREEDY):
            t = int(torch.argmax(logits_of(model, seq)[-1]))
            cont.append(t)
            seq.append(t)
        greedy.append(cont)
    torch.cat(blocks, 0).contiguous().numpy().astype("<f4").tofile(os.path.join(d, "logits.bin"))
    rot = model.model.rotary_emb
    inv = {}
    for t in set(cfg.layer_types):
        b = getattr(rot, f"{t}_inv_freq", None)
        if b is not None:
            inv[t] = [float(v) for v in b]
    keys = sorted(model.state_dict().keys())
    with open(os.path.join(d, "golden.json"), "w") as f:
        json.dump({"variant": name, "vocab": V, "prompts": prompts, "logits_offset": offsets,
                   "greedy": greedy, "layers": info, "inv_freq": inv, "state_keys": keys,
                   "torch": torch.__version__,
                   "transformers": __import__("transformers").__version__}, f, indent=1)
    log(f"{name}: wrote {d}: {sorted(os.listdir(d))}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default=None)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    logf = open(os.path.join(a.out, "log.txt"), "w")

    def log(s):
        print(s, file=sys.stderr, flush=True)
        logf.write(s + "\n")
        logf.flush()

    torch.set_num_threads(8)
    for name, spec in VARIANTS.items():
        if a.only and name != a.only:
            continue
        try:
            make(name, spec, a.out, log)
        except Exception:
            log(f"{name}: FAILED\n{traceback.format_exc()}")


if __name__ == "__main__":
    main()
