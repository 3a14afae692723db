#!/usr/bin/env python3
"""Make tiny random-weight mixture-of-experts checkpoints and their transformers goldens
(tests/golden/moe/<variant>/), for the MoE graphs of issue 24.

Owns: tests/golden/moe/<variant>/{config.json, model.safetensors, goldens.json, logits.bin}
and OUTDIR/modules.txt (each variant's module tree and checkpoint keys, to check the graph
against). Must not: be imported by the product or by tests at run time.
Runs where torch + transformers are installed (the GPU machine), CPU only, float32, eager;
the forward, greedy, padded-batch and cache checks are make_graph_goldens_qwen35.py's
run_variant (same file layout). Checkpoints are written with one tensor per expert
(model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight), the layout the published
Qwen3-MoE checkpoints use, whatever layout this transformers keeps in memory; Qwen 3.5 MoE
variants are written in either layout (see EXPERT_LAYOUT): fused
(mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I], the layout the
modeling code holds) or one tensor per expert (what transformers 5.17 saves for them).

Variants: qwen3moe, qwen3moe_s2 (Qwen3MoeForCausalLM); qwen35moe, qwen35moe_split
(Qwen3_5MoeForCausalLM, model_type qwen3_5_moe_text: the Qwen 3.5 hybrid with a routed
experts block and a sigmoid-gated shared expert on every layer); gemma4moe
(Gemma4ForCausalLM with enable_moe_block: a routed GELU experts block beside every layer's
MLP; its module tree goes to modules.txt). --only picks some of them.

usage: python3 tools/make_graph_goldens_moe.py --out OUTDIR [--threads 8] [--only a,b]
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_graph_goldens_qwen35 as base  # noqa: E402

VOCAB = base.VOCAB


def variants():
    common = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=4096,
                  tie_word_embeddings=False, attention_bias=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    # Qwen3-MoE: softmax router, top-k renormalised, a dense MLP layer in between
    qwen3moe = dict(common, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                    num_hidden_layers=3, intermediate_size=128, moe_intermediate_size=32,
                    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                    decoder_sparse_step=1, mlp_only_layers=[1], output_router_logits=False)
    # the same graph with raw top-k weights and every second layer sparse
    qwen3moe_s2 = dict(common, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                       num_hidden_layers=4, intermediate_size=96, moe_intermediate_size=24,
                       num_experts=6, num_experts_per_tok=3, norm_topk_prob=False,
                       decoder_sparse_step=2, mlp_only_layers=[], output_router_logits=False)
    # Qwen 3.5 MoE: the hybrid of make_graph_goldens_qwen35.py (DeltaNet + gated attention,
    # partial RoPE) with every layer's MLP the sparse block: softmax router, top-k always
    # renormalised, a shared expert scaled by sigmoid(shared_expert_gate)
    hybrid = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=48,
                  linear_conv_kernel_dim=4, hidden_act="silu", rms_norm_eps=1e-6,
                  max_position_embeddings=4096, attention_bias=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                   "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                                   "mrope_section": [4, 2, 2]},
                  partial_rotary_factor=0.25, output_router_logits=False,
                  bos_token_id=0, eos_token_id=0, pad_token_id=0,
                  model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"])
    qwen35moe = dict(hybrid, num_hidden_layers=4, tie_word_embeddings=False,
                     layer_types=["linear_attention", "full_attention"] * 2,
                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                     shared_expert_intermediate_size=48)
    qwen35moe_split = dict(hybrid, num_hidden_layers=3, tie_word_embeddings=True,
                           layer_types=["linear_attention", "linear_attention", "full_attention"],
                           num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
                           shared_expert_intermediate_size=40)
    # Gemma 4 with MoE blocks beside every MLP (router on the residual, per-expert scale)
    gemma4moe = dict(model_type="gemma4_text", architectures=["Gemma4ForCausalLM"],
                     vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     global_head_dim=64, hidden_activation="gelu_pytorch_tanh",
                     rms_norm_eps=1e-6, max_position_embeddings=4096, sliding_window=8,
                     hidden_size_per_layer_input=0, vocab_size_per_layer_input=VOCAB,
                     num_kv_shared_layers=0, attention_k_eq_v=False,
                     final_logit_softcapping=None, tie_word_embeddings=True,
                     use_double_wide_mlp=False, enable_moe_block=True, num_experts=8,
                     top_k_experts=2, moe_intermediate_size=32,
                     rope_parameters={"full_attention": {"partial_rotary_factor": 0.25,
                                                         "rope_theta": 1000000.0,
                                                         "rope_type": "proportional"},
                                      "sliding_attention": {"rope_theta": 10000.0,
                                                            "rope_type": "default"}},
                     bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return {"qwen3moe": qwen3moe, "qwen3moe_s2": qwen3moe_s2, "qwen35moe": qwen35moe,
            "qwen35moe_split": qwen35moe_split, "gemma4moe": gemma4moe}


# how each variant's checkpoint stores its experts: "split" (one tensor per expert),
# "fused" (one [E, ...] tensor per projection), None (as this transformers saves them)
EXPERT_LAYOUT = {"qwen3moe": "split", "qwen3moe_s2": "split", "qwen35moe": "fused",
                 "qwen35moe_split": "split", "gemma4moe": None}


def split_experts(d, torch):
    """Rewrite d/model.safetensors with one tensor per expert if transformers saved fused
    expert tensors (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I])."""
    from safetensors.torch import load_file, save_file
    p = os.path.join(d, "model.safetensors")
    t = load_file(p)
    out, changed = {}, False
    for k, v in t.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            pre, I = k[: -len("gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"] = v[e, :I].contiguous()
                out[f"{pre}{e}.up_proj.weight"] = v[e, I:].contiguous()
            changed = True
        elif k.endswith("mlp.experts.down_proj"):
            pre = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{pre}{e}.down_proj.weight"] = v[e].contiguous()
            changed = True
        else:
            out[k] = v
    if changed:
        save_file(out, p, metadata={"format": "pt"})
    return sorted(out.keys()), changed


def fuse_experts(d, torch):
    """Rewrite d/model.safetensors with fused expert tensors (experts.gate_up_proj
    [E, 2I, H] = gate rows then up rows per expert, experts.down_proj [E, H, I]) if
    transformers saved one tensor per expert."""
    import re
    from safetensors.torch import load_file, save_file
    p = os.path.join(d, "model.safetensors")
    t = load_file(p)
    out, groups = {}, {}
    for k, v in t.items():
        mt = re.match(r"(.*mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$", k)
        if mt:
            groups.setdefault(mt.group(1), {})[(int(mt.group(2)), mt.group(3))] = v
        else:
            out[k] = v
    for pre, g in groups.items():
        E = 1 + max(e for e, _ in g)
        out[pre + "gate_up_proj"] = torch.stack(
            [torch.cat([g[(e, "gate")], g[(e, "up")]], 0) for e in range(E)]).contiguous()
        out[pre + "down_proj"] = torch.stack([g[(e, "down")] for e in range(E)]).contiguous()
    if groups:
        save_file(out, p, metadata={"format": "pt"})
    return sorted(out.keys()), bool(groups)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--only", default="", help="comma-separated variants (default: all)")
    args = ap.parse_args()
    only = [v for v in args.only.split(",") if v]
    import torch
    import transformers
    torch.set_num_threads(args.threads)
    t0 = time.time()
    base.log("torch", torch.__version__, "transformers", transformers.__version__)
    os.makedirs(args.out, exist_ok=True)
    info = open(os.path.join(args.out, "modules.txt"), "w")
    for name, cfg in variants().items():
        if only and name not in only:
            continue
        try:
            base.run_variant(name, dict(cfg), args.out, torch, transformers)
            d = os.path.join(args.out, name)
            layout = EXPERT_LAYOUT.get(name)
            if layout == "split":
                keys, changed = split_experts(d, torch)
            elif layout == "fused":
                keys, changed = fuse_experts(d, torch)
            else:
                from safetensors import safe_open
                with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
                    keys, changed = sorted(f.keys()), False
            from transformers import AutoModelForCausalLM
            m = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32)
            info.write(f"== {name} (experts layout {layout}, rewritten: {changed})\n{m}\n")
            info.write("\n".join(keys) + "\n")
            # the split checkpoint must load back to the same logits
            import json
            g = json.load(open(os.path.join(d, "goldens.json")))
            ids = g["prompts"][0]["ids"]
            import numpy as np
            ref = np.fromfile(os.path.join(d, "logits.bin"), dtype="<f4").reshape(-1, VOCAB)
            with torch.no_grad():
                lg = m.eval()(input_ids=torch.tensor([ids]), use_cache=False).logits[0].numpy()
            diff = float(abs(lg - ref[: len(ids)]).max())
            base.log("%s: reloaded checkpoint vs goldens: max abs diff %.3g" % (name, diff))
            g["reload_max_abs_diff"] = diff
            g["experts_layout"] = layout
            g["experts_layout_rewritten"] = changed
            json.dump(g, open(os.path.join(d, "goldens.json"), "w"), indent=1)
        except Exception as e:  # noqa: BLE001 - report and continue with the next variant
            import traceback
            traceback.print_exc()
            base.log("%s: FAILED: %r" % (name, e))
    info.close()
    base.log("done in %.1f s" % (time.time() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
