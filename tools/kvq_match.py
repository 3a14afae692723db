"""kvq_match.py - the transformers KV-quantization simulation of ../shared/tools
(kvq_reference.py / kvq_graphs.py), corrected so that it can be compared with tqkv run for run
(issue 23, item 1: the Gemma 4 gap).

What differs from the shared copy, and why:
  * the rotation can be tqkv's own: `--rot tqkv:S` builds layer l's sign vector exactly as the
    codec does (src/codec/rotation.c: splitmix64 from seed ^ (dim * 0xD1B54A32D192ED03), seed
    = S + l), and a KV-shared layer (Gemma 4's last num_kv_shared_layers) uses its source
    layer's rotation, because tqkv reads the source layer's cache there. `--rot sim:G` is the
    shared script's rotation (one sign vector per head_dim from torch generator seed G; G = 7
    there), so several generator seeds measure the simulation's own seed spread. Two more
    separate the sign source from the per-layer choice: `tqkv1:S` (tqkv's signs of seed S
    for every layer) and `simL:G` (torch generator signs drawn per layer, in layer order);
  * several rotations and K/V specs in one process, on the same windows, with KLD and top-1
    agreement against the f32 pass (tqkv ppl --kld reports the same three);
  * `--per-layer`: on window 0 of the f32 pass, each layer's relative MSE of K and V
    (sum ||x - x^||^2 / sum ||x||^2, as `tqkv kv-error` prints) and of the attention output
    when only that layer's K/V are quantized, for every rotation and spec.
Quantizer (unchanged): x = n u, u rotated, nearest Lloyd-Max centroid / sqrt(d) per value, scale
n / ||c|| rounded to fp16 (tqkv's tq formats). Windows: the whole file tokenized without BOS,
window i = tokens [2048 i, 2048 (i + 1)), as `tqkv ppl`.

usage: python3 kvq_match.py MODEL_DIR TEXT_FILE WINDOWS [--rot sim:7,tqkv:0,...]
                            [--specs tq4/tq4,tq3/tq3] [--per-layer] [--json OUT]
Runs on the GPU machine (PyTorch + transformers).
"""
import argparse, json, math, sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

SEQ = 2048
DEV = "cuda"
LM = {2: [0.45278003463649200941, 1.5104176084990954024],  # src/codec/codebook.c
      3: [0.24509417894422166819, 0.75600528120587727482, 1.3439092785049998752,
          2.1519457045369872853],
      4: [0.12839502985114701005, 0.38804829949029019659, 0.65675911853246338086,
          0.94234045648696137093, 1.2562311973471771525, 1.6180463860218826272,
          2.0690172265313865796, 2.7325895709951630690]}
M64 = (1 << 64) - 1


# ---------------------------------------------------------------------------
# rotations
# ---------------------------------------------------------------------------

def splitmix_signs(seed, dim):
    """tqkv's codec_make_signs: -1 where bit j of word w is set, coordinate 64 w + j."""
    s = (seed ^ (dim * 0xD1B54A32D192ED03)) & M64
    out = []
    for i in range(dim):
        if i % 64 == 0:
            s = (s + 0x9E3779B97F4A7C15) & M64
            z = s
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
            w = z ^ (z >> 31)
        out.append(-1.0 if (w >> (i % 64)) & 1 else 1.0)
    return torch.tensor(out)


def hadamard(d):
    H = torch.ones(1, 1)
    while H.shape[0] < d:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return H / math.sqrt(d)


class Rotation:
    """R(layer, d): x -> (x * signs) H / sqrt(d), the form both tqkv and the simulation use."""

    def __init__(self, spec, src_layer):
        kind, val = spec.split(":")
        self.kind, self.val, self.src, self.cache = kind, int(val), src_layer, {}
        self.gen = torch.Generator().manual_seed(self.val) if kind.startswith("sim") else None

    def __call__(self, layer, d):
        per_layer = self.kind in ("tqkv", "simL")
        key = (self.src(layer) if per_layer else 0, d)
        if key not in self.cache:
            if self.kind in ("tqkv", "tqkv1"):  # tqkv1: seed S for every layer
                s = splitmix_signs(self.val + key[0], d)
            else:  # kvq_reference.rot: randint(0, 2) * 2 - 1 from one generator, in first-use order
                s = (torch.randint(0, 2, (d,), generator=self.gen) * 2 - 1).float()
            self.cache[key] = (s[:, None] * hadamard(d)).to(DEV)
        return self.cache[key]


def codebook(bits, d):
    h = torch.tensor(LM[bits], dtype=torch.float64)
    return (torch.cat([-h.flip(0), h]) / math.sqrt(d)).float().to(DEV)


def tq(x, bits, R):
    d = x.shape[-1]
    n = x.norm(dim=-1, keepdim=True)
    u = (x / n.clamp_min(1e-30)) @ R
    cb = codebook(bits, d)
    c = cb[(u[..., None] - cb).abs().argmin(-1)]
    scale = (n / c.norm(dim=-1, keepdim=True).clamp_min(1e-30)).half().float()
    return (c @ R.T) * scale


def fmt(x, spec, R):
    if spec == "f32":
        return x
    if spec.startswith("tq"):
        return tq(x, int(spec[2:]), R)
    raise ValueError(spec)


# ---------------------------------------------------------------------------
# the attention hook
# ---------------------------------------------------------------------------

STATE = {"k": "f32", "v": "f32", "rot": None, "only": None, "probe": None}


def attn(module, query, key, value, attention_mask, **kw):
    li = module.layer_idx
    rot, probe = STATE["rot"], STATE["probe"]
    if probe is not None:  # f32 pass, window 0: per-layer errors, output unchanged
        out = sdpa_attention_forward(module, query, key, value, attention_mask, **kw)
        probe(li, module, query, key, value, attention_mask, out, kw)
        return out
    if rot is not None and STATE["only"] in (None, li):
        R = rot(li, key.shape[-1])
        key = fmt(key.float(), STATE["k"], R).to(query.dtype)
        value = fmt(value.float(), STATE["v"], R).to(query.dtype)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)


AttentionInterface.register("kvmatch", attn)


def source_layer_map(cfg):
    """layer -> the layer whose cache it reads (Gemma 4's KV-shared layers; else itself)."""
    L = cfg.num_hidden_layers
    shared = getattr(cfg, "num_kv_shared_layers", 0) or 0
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * L
    first = L - shared
    def src(l):
        if l < first:
            return l
        return max(j for j in range(first) if types[j] == types[l])
    return src


# ---------------------------------------------------------------------------
# runs
# ---------------------------------------------------------------------------

def score(model, ids, n, ref):
    nll, cnt, kl, agree = 0.0, 0, 0.0, 0
    with torch.no_grad():
        for i in range(n):
            x = ids[i * SEQ:(i + 1) * SEQ][None]
            y = ids[i * SEQ + 1:(i + 1) * SEQ + 1]
            lp = torch.log_softmax(model(input_ids=x).logits[0].float(), -1)
            nll -= lp.gather(1, y[:, None]).sum().item()
            cnt += y.numel()
            if len(ref) < n:
                ref.append(lp.cpu())
            else:
                r = ref[i].to(DEV)
                kl += (r.exp() * (r - lp)).sum().item()
                agree += (r.argmax(-1) == lp.argmax(-1)).sum().item()
    return math.exp(nll / cnt), kl / cnt, agree / cnt


def per_layer(model, ids, rots, specs):
    rows = []

    def probe(li, module, q, k, v, mask, out, kw):
        for rs, rot in rots.items():
            R = rot(li, k.shape[-1])
            for sp in specs:
                ks, vs = sp.split("/")
                kq = fmt(k.float(), ks, R).to(q.dtype)
                vq = fmt(v.float(), vs, R).to(q.dtype)
                o = sdpa_attention_forward(module, q, kq, vq, mask, **kw)[0]
                rel = lambda a, b: ((a.float() - b.float()).pow(2).sum() / b.float().pow(2).sum()).item()
                rows.append({"layer": li, "rot": rs, "spec": sp, "head_dim": k.shape[-1],
                             "tokens": k.shape[-2], "k_rel_mse": rel(kq, k), "v_rel_mse": rel(vq, v),
                             "attn_out_rel_mse": rel(o, out[0])})
    STATE["probe"] = probe
    with torch.no_grad():
        model(input_ids=ids[:SEQ][None])
    STATE["probe"] = None
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model"), ap.add_argument("text"), ap.add_argument("windows", type=int)
    ap.add_argument("--rot", default="sim:7,tqkv:0")
    ap.add_argument("--specs", default="tq4/tq4")
    ap.add_argument("--per-layer", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32,
                                                 attn_implementation="kvmatch").to(DEV).eval()
    ids = torch.tensor(tok(open(a.text, encoding="utf-8").read()).input_ids, device=DEV)
    n = min(a.windows, (ids.numel() - 1) // SEQ)
    src = source_layer_map(model.config)
    rots = {r: Rotation(r, src) for r in a.rot.split(",")}
    specs = a.specs.split(",")
    name = a.model.rstrip("/").split("/")[-1]
    ref, out = [], {"model": name, "windows": n, "runs": []}
    STATE.update(rot=None)
    base, _, _ = score(model, ids, n, ref)
    out["f32_ppl"] = base
    print(f"{name} windows {n}: f32 ppl {base:.4f}", flush=True)
    for rs, rot in rots.items():
        for sp in specs:
            k, v = sp.split("/")
            STATE.update(k=k, v=v, rot=rot)
            p, kl, t1 = score(model, ids, n, ref)
            out["runs"].append({"rot": rs, "spec": sp, "ppl": p, "delta_pct": 100 * (p / base - 1),
                                "kld": kl, "top1": t1})
            print(f"  rot {rs:8s} K {k:4s} V {v:4s} ppl {p:.4f} ({100*(p/base-1):+.3f}%) "
                  f"KLD {kl:.5f} top1 {t1:.4f}", flush=True)
    STATE.update(rot=None)
    if a.per_layer:
        out["layers"] = per_layer(model, ids, rots, specs)
        for r in out["layers"]:
            print(f"  L{r['layer']} d{r['head_dim']} {r['rot']:8s} {r['spec']:8s} K {r['k_rel_mse']:.5f} "
                  f"V {r['v_rel_mse']:.5f} attn {r['attn_out_rel_mse']:.5f}", flush=True)
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
