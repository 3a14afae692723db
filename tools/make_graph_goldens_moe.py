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
Qwen3-MoE checkpoints use, whatever layout this transformers keeps in memory.

usage: python3 tools/make_graph_goldens_moe.py --out OUTDIR [--threads 8]
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
    return {"qwen3moe": qwen3moe, "qwen3moe_s2": qwen3moe_s2}


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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=8)
    args = ap.parse_args()
    import torch
    import transformers
    torch.set_num_threads(args.threads)
    t0 = time.time()
    base.log("torch", torch.__version__, "transformers", transformers.__version__)
    os.makedirs(args.out, exist_ok=True)
    info = open(os.path.join(args.out, "modules.txt"), "w")
    for name, cfg in variants().items():
        try:
            base.run_variant(name, dict(cfg), args.out, torch, transformers)
            d = os.path.join(args.out, name)
            keys, changed = split_experts(d, torch)
            from transformers import AutoModelForCausalLM
            m = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32)
            info.write(f"== {name} (fused experts split: {changed})\n{m}\n")
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
            g["experts_split_from_fused"] = changed
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
