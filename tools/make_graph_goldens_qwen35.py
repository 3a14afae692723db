#!/usr/bin/env python3
"""Make tiny random-weight checkpoints and their transformers goldens for the Qwen 3.5
hybrid graph and a MiniCPM5-shaped Llama (tests/golden/qwen35/).

Owns: tests/golden/qwen35/<variant>/{config.json, model.safetensors, goldens.json, logits.bin}.
Must not: be imported by the product or by tests at run time; the C tests read the files.
Runs where torch + transformers 5.17 are installed (the GPU machine); uses only the CPU in
float32 with attn_implementation="eager". Qwen 3.5 runs through transformers' torch
fallbacks (torch_chunk_gated_delta_rule for prefill, torch_recurrent_gated_delta_rule for
cached decode, F.conv1d), which this script checks and records.

usage: python3 tools/make_graph_goldens_qwen35.py --out OUTDIR [--threads 8]

Per variant, OUTDIR/<variant>/ gets:
  config.json, model.safetensors  the checkpoint (weights rounded to bf16 and stored as bf16;
                                  the fp32 reference runs on exactly those values)
  goldens.json  prompts (random ids), logits_index of every position of every prompt (each
                prompt run alone, no cache), 24 greedy tokens of prompt 0 from generate()
                (cached: chunked prefill + recurrent decode) with top-2 margins, the
                left-padded batch check (HF padded vs alone), cache-vs-nocache check
  logits.bin    float32 little-endian [n_vectors, vocab]
"""
import argparse
import json
import os
import sys
import time

VOCAB = 256
PROMPT_LENS = [70, 23, 41]   # 70 > 64 crosses a chunk of torch_chunk_gated_delta_rule
N_GREEDY = 24
SEED = 1234


def log(*a):
    print(*a, flush=True)


def variants():
    hybrid = dict(
        model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"],
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=48,   # key dim != value dim
        linear_conv_kernel_dim=4, hidden_act="silu", rms_norm_eps=1e-6,
        max_position_embeddings=4096, tie_word_embeddings=True, attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                         "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                         "mrope_section": [4, 2, 2]},
        partial_rotary_factor=0.25, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    minicpm5 = dict(
        model_type="llama", architectures=["LlamaForCausalLM"],
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=16, num_key_value_heads=2, head_dim=32,   # 16 q / 2 kv heads
        hidden_act="silu", rms_norm_eps=1e-5, max_position_embeddings=4096,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return {"hybrid": hybrid, "minicpm5": minicpm5}


def randomize(model, torch, gen):
    """Weights large enough that logits are peaked (greedy has clear margins)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.5, 4.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.4)
            elif p.ndim == 1:
                zero_centred = type(model).__name__.startswith("Qwen3_5") and "linear_attn.norm" not in name
                base = 0.0 if zero_centred else 1.0
                p.copy_(base + torch.randn(p.shape, generator=gen) * 0.2)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / (p.shape[-1] ** 0.5))
            p.copy_(p.to(torch.bfloat16).to(torch.float32))


def run_variant(name, cfg_dict, out_dir, torch, transformers):
    from transformers import AutoConfig, AutoModelForCausalLM
    d = os.path.join(out_dir, name)
    os.makedirs(d, exist_ok=True)
    mt = cfg_dict.pop("model_type")
    archs = cfg_dict.pop("architectures")
    cfg = AutoConfig.for_model(mt, **cfg_dict)
    cfg.architectures = archs
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    log("%s: %s, %d params" % (name, type(model).__name__, sum(p.numel() for p in model.parameters())))
    gen = torch.Generator().manual_seed(SEED + 1)
    randomize(model, torch, gen)
    # the checkpoint: bf16 copy of the (already bf16-exact) fp32 weights
    import copy
    mb = copy.deepcopy(model).to(torch.bfloat16)
    mb.save_pretrained(d, safe_serialization=True)
    del mb
    for extra in ("generation_config.json",):
        p = os.path.join(d, extra)
        if os.path.exists(p):
            os.remove(p)

    g = torch.Generator().manual_seed(SEED + 2)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
    rows = []
    out_prompts = []
    with torch.no_grad():
        for ids in prompts:
            lg = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
            idx = list(range(len(rows), len(rows) + len(ids)))
            rows.extend(lg[i].clone() for i in range(len(ids)))
            out_prompts.append({"ids": ids, "logits_index_first": idx[0], "n": len(ids)})
        # left-padded batch in HF (mask + position ids) vs each prompt alone
        L = max(PROMPT_LENS)
        inp = [[0] * (L - len(r)) + r for r in prompts]
        mask = torch.tensor([[0] * (L - len(r)) + [1] * len(r) for r in prompts])
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        bl = model(input_ids=torch.tensor(inp), attention_mask=mask, position_ids=pos,
                   use_cache=False).logits
        batch_diff = 0.0
        for i, r in enumerate(prompts):
            a = bl[i, L - len(r):]
            b = torch.stack(rows[out_prompts[i]["logits_index_first"]:
                                 out_prompts[i]["logits_index_first"] + len(r)])
            batch_diff = max(batch_diff, float((a - b).abs().max()))
        log("%s: HF left-padded batch vs alone: max abs diff %.3g" % (name, batch_diff))
        # greedy with the cache (prefill + per-token decode) via generate
        model.generation_config.eos_token_id = None
        x = torch.tensor([prompts[0]])
        go = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                            max_new_tokens=N_GREEDY, eos_token_id=None, pad_token_id=0)
        greedy = [int(t) for t in go[0, len(prompts[0]):]]
        # no-cache forward over prompt + greedy: argmax must reproduce greedy, margins
        full = model(input_ids=go, use_cache=False).logits[0]
        margins, nocache_greedy = [], []
        for s in range(N_GREEDY):
            v = full[len(prompts[0]) - 1 + s]
            t2 = torch.topk(v, 2)
            nocache_greedy.append(int(t2.indices[0]))
            margins.append(float(t2.values[0] - t2.values[1]))
        log("%s: greedy %s; no-cache argmax equal: %s; min top-2 margin %.4f"
            % (name, greedy[:8], greedy == nocache_greedy, min(margins)))
        # cached decode logits vs no-cache logits (recurrent vs chunked delta rule for hybrid)
        from transformers import DynamicCache
        cache = DynamicCache(config=model.config)
        ids0 = prompts[0]
        model(input_ids=torch.tensor([ids0[:40]]), past_key_values=cache, use_cache=True)
        dec_diff = 0.0
        for j in range(40, len(ids0)):
            v = model(input_ids=torch.tensor([[ids0[j]]]), past_key_values=cache, use_cache=True,
                      position_ids=torch.tensor([[j]])).logits[0, -1]
            dec_diff = max(dec_diff, float((v - rows[j]).abs().max()))
        log("%s: cached per-token decode vs no-cache forward: max abs diff %.3g" % (name, dec_diff))

    import numpy as np
    arr = torch.stack(rows).numpy().astype("<f4")
    arr.tofile(os.path.join(d, "logits.bin"))
    meta = {
        "variant": name,
        "class": type(model).__name__,
        "vocab": VOCAB,
        "n_vectors": int(arr.shape[0]),
        "prompts": out_prompts,
        "greedy_prompt": 0,
        "greedy": greedy,
        "greedy_top2_margins": margins,
        "greedy_nocache_equal": greedy == nocache_greedy,
        "hf_batch_vs_alone_max_abs_diff": batch_diff,
        "hf_cached_decode_vs_nocache_max_abs_diff": dec_diff,
        "logits_rms": float(np.sqrt((arr.astype("f8") ** 2).mean())),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "note": ("random weights (seed %d) rounded to bf16; fp32 eager forward on CPU; logits.bin "
                 "rows: every position of every prompt run alone without cache, in order" % SEED),
    }
    if name == "hybrid":
        from transformers.utils import import_utils as iu
        fla = getattr(iu, "is_flash_linear_attention_available", None)
        meta["fla_available"] = bool(fla()) if fla else None
    with open(os.path.join(d, "goldens.json"), "w") as f:
        json.dump(meta, f, indent=1)
    log("%s: wrote %s (%d logits rows)" % (name, d, arr.shape[0]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=8)
    args = ap.parse_args()
    import torch
    import transformers
    torch.set_num_threads(args.threads)
    t0 = time.time()
    log("torch", torch.__version__, "transformers", transformers.__version__)
    for name, cfg in variants().items():
        try:
            run_variant(name, cfg, args.out, torch, transformers)
        except Exception as e:  # noqa: BLE001 - report and continue with the next variant
            import traceback
            traceback.print_exc()
            log("%s: FAILED: %r" % (name, e))
    log("done in %.1f s" % (time.time() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
