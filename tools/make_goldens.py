#!/usr/bin/env python3
"""Make the Hugging Face reference goldens that tqkv's C tests compare against.

Owns: tests/golden/{tokenizer.json, parity.json, logits.bin} (their content and format).
Must not: be imported by the product or by tests at run time; tests read only the files.
Runs where torch + transformers + tokenizers are installed (the GPU machine; it uses the
CPU in float32, which is the most exact and fully deterministic for this 28M model).

usage:
  python3 tools/make_goldens.py --model models/qwen3-code-28m \
      --text PATH/heldout-code.txt --out OUTDIR

Writes into OUTDIR:
  tokenizer.json  tokenizer golden: whole held-out file (n_tokens, crc32, per-4096 chunk
                  crc32, first 2048 ids) + 49 tricky strings with ids / pieces / decoded.
  parity.json     model golden: 3 prompts, logits at 3 positions each, 48 greedy tokens
                  each (no EOS stop), and one left-padded batched forward.
  logits.bin      float32 little-endian [n_vectors, vocab]; rows indexed by "logits_index".
"""
import argparse
import hashlib
import json
import os
import sys
import time
import unicodedata
import zlib

# ---------------------------------------------------------------- constants
CHUNK = 4096          # ids per chunk crc
HEAD = 2048           # ids stored verbatim from the start of the held-out file
N_GREEDY = 48         # greedy tokens per prompt
BATCH_PREFIX = [40, 25, 33]   # tokens of each prompt used in the left-padded batch
EXPECTED_HELDOUT_TOKENS = 440479

PROMPT_FUNC = (
    "def moving_average(values: list[float], window: int) -> list[float]:\n"
    "    \"\"\"Return the simple moving average of ``values`` over ``window`` items.\n"
    "\n"
    "    Raises ValueError if ``window`` is not positive.\n"
    "    \"\"\"\n"
)

PROMPT_CLASS = (
    "import os\n"
    "import json\n"
    "from dataclasses import dataclass, field\n"
    "from typing import Any, Dict, List, Optional\n"
    "\n"
    "\n"
    "@dataclass\n"
    "class Config:\n"
    "    \"\"\"Settings for a training run, loaded from a JSON file.\"\"\"\n"
    "\n"
    "    name: str\n"
    "    learning_rate: float = 1e-3\n"
    "    batch_size: int = 32\n"
    "    tags: List[str] = field(default_factory=list)\n"
    "    extra: Dict[str, Any] = field(default_factory=dict)\n"
    "\n"
    "    @classmethod\n"
    "    def from_file(cls, path: str) -> \"Config\":\n"
    "        with open(path, \"r\", encoding=\"utf-8\") as f:\n"
    "            data = json.load(f)\n"
    "        return cls(**data)\n"
    "\n"
    "    def get(self, key: str, default: Optional[Any] = None) -> Any:\n"
)

CHAT_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant that writes clean Python code."},
    {"role": "user", "content": "Write a Python function is_palindrome(s) that returns True when "
                                "the string reads the same forwards and backwards, ignoring case "
                                "and punctuation. Include a docstring."},
]


def tricky_cases():
    """[(name, text)] of strings that stress a byte-level BPE tokenizer."""
    cafe = "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00c5ngstr\u00f6m se\u00f1or"
    long_word = ("supercalifragilisticexpialidocious" * 15)[:500]
    return [
        ("empty", ""),
        ("space", " "),
        ("two_spaces", "  "),
        ("five_spaces", "     "),
        ("tab", "\t"),
        ("tabs_then_word", "\t\t x"),
        ("trailing_spaces_newline", "hello   \n"),
        ("trailing_spaces", "trailing spaces   "),
        ("inner_space_runs", "a  b   c    d"),
        ("three_newlines", "\n\n\n"),
        ("crlf", "line1\r\nline2\r\n\r\n"),
        ("mixed_whitespace", "x \n\n  \t\n y"),
        ("indent_newline", "    \n    \n"),
        ("newline_indent", "\n        return"),
        ("contractions", "it's don't they're we've I'm you'll he'd"),
        ("contractions_upper", "IT'S DON'T THEY'RE WE'VE I'M YOU'LL HE'D"),
        ("contraction_edges", "'s's 'S ''ll 'x '"),
        ("digits", "1234567890 3.14159 0x1F 1e-10 007"),
        ("digit_run", "12345678901234567890123"),
        ("punct_runs", "!!!??? ... --- === ((()))[]{} ;; :: -> => != <= >= **"),
        ("shebang", "#!/usr/bin/env python3\n# -*- coding: utf-8 -*-\n"),
        ("python_indent", "def foo(x, y=2):\n    if x > y:\n        return x ** 2\n    else:\n"
                          "        return [i for i in range(y)]\n"),
        ("python_tabs", "class A:\n\tdef f(self):\n\t\tpass\n"),
        ("python_strings", "print(\"Hello, world!\\n\")  # comment\nx = f'{a!r:>10}'\n"),
        ("latin_nfc", cafe),
        ("latin_nfd", unicodedata.normalize("NFD", cafe)),
        ("cjk", "\u4f60\u597d\uff0c\u4e16\u754c\uff01\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8"
                "\u3002 \ud55c\uad6d\uc5b4"),
        ("emoji", "\U0001F600 \U0001F44D\U0001F3FD ok"),
        ("emoji_zwj_family", "\U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466"),
        ("emoji_flag_zwj", "\U0001F3F3\ufe0f\u200d\U0001F308 \U0001F1FA\U0001F1F8"),
        ("emoji_skin_tones", "\U0001F44B\U0001F3FB\U0001F44B\U0001F3FF"),
        ("arabic", "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645"),
        ("lone_combining_mark", "\u0301"),
        ("space_combining", " \u0301a"),
        ("replacement_char", "bad \ufffd byte"),
        ("control_chars", "bell\x07 esc\x1b[0m del\x7f"),
        ("nbsp_zwsp", "a\u00a0b\u200bc\u2028d"),
        ("astral_math", "\U0001D518\U0001D52B\U0001D526 \U0001D7D8\U0001D7D9"),
        ("symbols", "\u2211\u222b\u221a\u221e \u2264\u2265 \u2192 \u21d2 \u00b0C \u20ac\u00a3\u00a5 \ufb01"),
        ("specials_embedded", "a<|im_start|>b<|im_end|>\n<|endoftext|>"),
        ("chatml_turn", "<|im_start|>user\nhi<|im_end|>\n"),
        ("specials_adjacent", "<|endoftext|><|endoftext|><|im_end|>"),
        ("special_spaces", "  <|endoftext|>  x"),
        ("lookalike_im_start", "<|im_start"),
        ("lookalike_endoftext", "<|endoftext|"),
        ("lookalike_variants", "<|endoftext |> <|ENDOFTEXT|> < |im_end|> <|im_end|x"),
        ("long_word", long_word),
        ("long_run_x", " " + "x" * 300),
        ("mixed_scripts", "Hello \u043c\u0438\u0440 \u4e16\u754c \u0645\u0631\u062d\u0628\u0627 "
                          "\u05e9\u05dc\u05d5\u05dd caf\u00e9 123 \U0001F600!"),
    ]


# ---------------------------------------------------------------- helpers
def crc32_ids(ids):
    # crc32 of the ids as uint32 little-endian bytes
    import struct
    return zlib.crc32(struct.pack("<%dI" % len(ids), *ids)) & 0xFFFFFFFF


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def dump_json(path, obj):
    """Top-level keys one per line; lists of dicts one element per line; else compact.
    Non-ASCII stays raw UTF-8; control characters are \\u-escaped by json."""
    def c(v):
        return json.dumps(v, ensure_ascii=False, separators=(",", ":"))
    lines = []
    keys = list(obj.keys())
    for i, k in enumerate(keys):
        v = obj[k]
        comma = "," if i + 1 < len(keys) else ""
        if isinstance(v, list) and v and all(isinstance(e, dict) for e in v):
            inner = ",\n  ".join(c(e) for e in v)
            lines.append(" %s:[\n  %s\n ]%s" % (c(k), inner, comma))
        elif isinstance(v, dict):
            sub = []
            sk = list(v.keys())
            for j, kk in enumerate(sk):
                vv = v[kk]
                cm = "," if j + 1 < len(sk) else ""
                if isinstance(vv, list) and vv and all(isinstance(e, dict) for e in vv):
                    inner = ",\n   ".join(c(e) for e in vv)
                    sub.append("  %s:[\n   %s\n  ]%s" % (c(kk), inner, cm))
                else:
                    sub.append("  %s:%s%s" % (c(kk), c(vv), cm))
            lines.append(" %s:{\n%s\n }%s" % (c(k), "\n".join(sub), comma))
        else:
            lines.append(" %s:%s%s" % (c(k), c(v), comma))
    text = "{\n" + "\n".join(lines) + "\n}\n"
    json.loads(text)  # must round-trip
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)


def log(*a):
    print(*a, flush=True)


# ---------------------------------------------------------------- tokenizer golden
def make_tokenizer_golden(tok, hf_tok, text_path, versions):
    t0 = time.time()
    raw = open(text_path, "rb").read()
    text = raw.decode("utf-8")          # bytes -> str exactly (no newline translation)
    enc = tok.encode(text, add_special_tokens=False)
    ids = list(enc.ids)
    n = len(ids)
    n_eot_text = text.count("<|endoftext|>")
    n_eot_ids = sum(1 for i in ids if i == 0)
    log("heldout: %d bytes, %d tokens (expected %d), <|endoftext|> in text %d, id 0 in ids %d, %.1fs"
        % (len(raw), n, EXPECTED_HELDOUT_TOKENS, n_eot_text, n_eot_ids, time.time() - t0))
    hf_agrees = None
    if hf_tok is not None:
        try:
            hf_ids = hf_tok(text, add_special_tokens=False)["input_ids"]
            hf_agrees = list(hf_ids) == ids
            log("heldout: AutoTokenizer agrees with tokenizers.Tokenizer:", hf_agrees)
        except Exception as e:  # noqa: BLE001
            log("heldout: AutoTokenizer check failed:", repr(e))
    # where the separators sit, as a check that they are single special tokens
    eot_positions = [i for i, t in enumerate(ids) if t == 0]
    heldout = {
        "file": os.path.basename(text_path),
        "bytes": len(raw),
        "sha256": hashlib.sha256(raw).hexdigest(),
        "n_tokens": n,
        "crc32": crc32_ids(ids),
        "chunk": CHUNK,
        "chunk_crc32": [crc32_ids(ids[i:i + CHUNK]) for i in range(0, n, CHUNK)],
        "n_endoftext_in_text": n_eot_text,
        "n_id0": n_eot_ids,
        "id0_positions_first16": eot_positions[:16],
        "head": ids[:HEAD],
    }

    cases = []
    n_disagree = 0
    for name, s in tricky_cases():
        e = tok.encode(s, add_special_tokens=False)
        cids = list(e.ids)
        case = {
            "name": name,
            "text": s,
            "utf8_hex": s.encode("utf-8").hex(),
            "ids": cids,
            "pieces": list(e.tokens),
            "decoded": tok.decode(cids, skip_special_tokens=False),
        }
        case["roundtrip"] = case["decoded"] == s
        if hf_tok is not None:
            try:
                h = list(hf_tok(s, add_special_tokens=False)["input_ids"])
                if h != cids:
                    n_disagree += 1
                    case["hf_autotokenizer_ids"] = h
            except Exception as ex:  # noqa: BLE001
                case["hf_autotokenizer_error"] = repr(ex)
        cases.append(case)
    log("cases: %d, AutoTokenizer disagreements: %d, non-roundtrip: %s"
        % (len(cases), n_disagree, [c["name"] for c in cases if not c["roundtrip"]]))

    golden = {
        "note": ("Made by tools/make_goldens.py with tokenizers.Tokenizer.from_file(tokenizer.json)"
                 ".encode(text, add_special_tokens=False) (adds nothing for this tokenizer); "
                 "special tokens written in the text (<|endoftext|>=0, <|im_start|>=1, <|im_end|>=2) "
                 "are matched as single ids before pre-tokenization, as HF does. crc32 = zlib.crc32 "
                 "of the ids as uint32 little-endian; chunk_crc32 per consecutive 4096-id chunk "
                 "(last shorter). decoded = tok.decode(ids, skip_special_tokens=False). "
                 "utf8_hex = the exact input bytes."),
        "tokenizer": "models/qwen3-code-28m/tokenizer.json",
        "tokenizer_sha256": versions["tokenizer_sha256"],
        "tokenizers": versions["tokenizers"],
        "transformers": versions["transformers"],
        "hf_autotokenizer_agrees_heldout": hf_agrees,
        "hf_autotokenizer_case_disagreements": n_disagree,
        "heldout": heldout,
        "cases": cases,
    }
    return golden


# ---------------------------------------------------------------- model golden
def greedy_manual(model, torch, ids, n_new):
    """Pure argmax loop with a DynamicCache; returns (tokens, top1-top2 margins)."""
    from transformers import DynamicCache
    cache = DynamicCache()
    x = torch.tensor([ids])
    out_tok, margins = [], []
    with torch.no_grad():
        logits = model(input_ids=x, past_key_values=cache, use_cache=True).logits[0, -1]
        for step in range(n_new):
            top2 = torch.topk(logits, 2)
            t = int(top2.indices[0])
            out_tok.append(t)
            margins.append(float(top2.values[0] - top2.values[1]))
            if step + 1 == n_new:
                break
            pos = len(ids) + step
            logits = model(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True,
                           position_ids=torch.tensor([[pos]])).logits[0, -1]
    return out_tok, margins


def greedy_generate(model, torch, ids, n_new):
    model.generation_config.eos_token_id = None   # never stop early; pure argmax
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=n_new, eos_token_id=None, pad_token_id=0)
    return [int(t) for t in out[0, len(ids):]]


def make_parity_golden(model, torch, tok, hf_tok, versions, logits_rows):
    prompts = []
    chat_text = None
    chat_template_ids = None
    chat_source = "hand-written ChatML (apply_chat_template unavailable)"
    if hf_tok is not None:
        try:
            chat_text = hf_tok.apply_chat_template(CHAT_MESSAGES, tokenize=False,
                                                   add_generation_prompt=True)
            chat_source = "AutoTokenizer.apply_chat_template(add_generation_prompt=True)"
        except Exception as e:  # noqa: BLE001
            log("apply_chat_template(tokenize=False) failed:", repr(e))
        try:
            r = hf_tok.apply_chat_template(CHAT_MESSAGES, tokenize=True, add_generation_prompt=True)
            if hasattr(r, "keys") and "input_ids" in r:
                r = r["input_ids"]
            if hasattr(r, "tolist"):
                r = r.tolist()
            if r and isinstance(r[0], list):
                r = r[0]
            chat_template_ids = [int(t) for t in r]
        except Exception as e:  # noqa: BLE001
            log("apply_chat_template(tokenize=True) failed:", repr(e))
    manual_chat = "".join("<|im_start|>%s\n%s<|im_end|>\n" % (m["role"], m["content"])
                          for m in CHAT_MESSAGES) + "<|im_start|>assistant\n"
    if chat_text is None:  # template is ChatML; same text by hand
        chat_text = manual_chat
    if chat_text != manual_chat:
        log("note: chat template text differs from hand-written ChatML: %r" % chat_text)

    specs = [("python_function_docstring", PROMPT_FUNC, None),
             ("python_class_with_imports", PROMPT_CLASS, None),
             ("chatml_chat_turn", chat_text, CHAT_MESSAGES)]
    for name, text, msgs in specs:
        ids = list(tok.encode(text, add_special_tokens=False).ids)
        n = len(ids)
        positions = [0, n // 2, n - 1]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0]  # [n, vocab]
        idx = []
        for p in positions:
            idx.append(len(logits_rows))
            logits_rows.append(logits[p].clone())
        argmax = [int(logits[p].argmax()) for p in positions]
        top5 = [[int(t) for t in torch.topk(logits[p], 5).indices] for p in positions]

        t0 = time.time()
        try:
            man, margins = greedy_manual(model, torch, ids, N_GREEDY)
        except Exception as e:  # noqa: BLE001
            log("manual greedy loop failed:", repr(e))
            man, margins = None, None
        gen, gen_err = None, None
        try:
            gen = greedy_generate(model, torch, ids, N_GREEDY)
        except Exception as e:  # noqa: BLE001
            gen_err = repr(e)
            log("generate failed:", gen_err)
        greedy = gen if (gen is not None and len(gen) == N_GREEDY) else man
        # no-cache teacher-forced check: argmax of one full forward over prompt+greedy
        with torch.no_grad():
            full = model(input_ids=torch.tensor([ids + greedy])).logits[0]
        nocache = [int(t) for t in full[n - 1:n - 1 + N_GREEDY].argmax(-1)]
        if margins is None:
            t2 = torch.topk(full[n - 1:n - 1 + N_GREEDY], 2, dim=-1).values
            margins = [float(v) for v in (t2[:, 0] - t2[:, 1])]
        entry = {
            "name": name,
            "text": text,
            "utf8_hex": text.encode("utf-8").hex(),
            "n_tokens": n,
            "ids": ids,
            "positions": positions,
            "logits_index": idx,
            "argmax": argmax,
            "top5": top5,
            "greedy": greedy,
            "greedy_text": tok.decode(greedy, skip_special_tokens=False),
            "greedy_source": "model.generate" if greedy is gen else "manual argmax loop (DynamicCache)",
            "greedy_generate_equals_manual_loop": gen == man,
            "greedy_equals_nocache_argmax": nocache == greedy,
            "greedy_top2_margin": [round(m, 5) for m in margins],
            "greedy_contains_eos": 0 in greedy,
        }
        if msgs is not None:
            entry["messages"] = msgs
            entry["chat_source"] = chat_source
            entry["chat_text_equals_plain_chatml"] = chat_text == manual_chat
            entry["chat_template_ids_equal"] = (None if chat_template_ids is None
                                                else chat_template_ids == ids)
        if gen is not None and gen != man:
            entry["greedy_generate"] = gen
            entry["greedy_manual"] = man
        if gen_err:
            entry["generate_error"] = gen_err
        prompts.append(entry)
        log("prompt %-28s n=%3d positions=%s argmax=%s greedy(gen==man:%s, ==nocache:%s, min margin %.4f) %.1fs"
            % (name, n, positions, argmax, gen == man, nocache == greedy, min(margins), time.time() - t0))
        log("   greedy_text: %r" % entry["greedy_text"])

    # ---- left-padded batch
    try:
        batch = make_batch(model, torch, prompts, logits_rows)
    except Exception as e:  # noqa: BLE001
        import traceback
        traceback.print_exc()
        batch = {"error": repr(e)}
    return prompts, batch


def make_batch(model, torch, prompts, logits_rows):
    rows = [prompts[i]["ids"][:k] for i, k in enumerate(BATCH_PREFIX)]
    L = max(len(r) for r in rows)
    input_ids = [[0] * (L - len(r)) + r for r in rows]            # [3, L]
    mask = [[0] * (L - len(r)) + [1] * len(r) for r in rows]       # [3, L]
    m = torch.tensor(mask)
    pos = (m.cumsum(-1) - 1).clamp(min=0)                          # [3, L]
    with torch.no_grad():
        bl = model(input_ids=torch.tensor(input_ids), attention_mask=m, position_ids=pos).logits
    brows = []
    for i, r in enumerate(rows):
        v = bl[i, -1]
        with torch.no_grad():
            single = model(input_ids=torch.tensor([r])).logits[0, -1]
        diff = float((v - single).abs().max())
        brows.append({"prompt": i, "n": len(r), "pad": L - len(r), "logits_index": len(logits_rows),
                      "argmax": int(v.argmax()), "max_abs_diff_vs_unpadded": diff})
        logits_rows.append(v.clone())
        log("batch row %d: n=%d pad=%d argmax=%d max|batched-unpadded|=%.3g"
            % (i, len(r), L - len(r), int(v.argmax()), diff))
    batch = {
        "note": ("prompts' first 40/25/33 ids left-padded with pad id 0 to one batch; "
                 "attention_mask 0 on pads; position_ids = clamp(cumsum(mask)-1, 0); one eager "
                 "forward; logits of each row's last position (index L-1) stored."),
        "prefix": BATCH_PREFIX,
        "pad_id": 0,
        "seq_len": L,
        "input_ids": input_ids,
        "attention_mask": mask,
        "position_ids": pos.tolist(),
        "rows": brows,
    }
    return batch


def fp64_check(model, torch, prompts, logits_rows):
    """Max |fp32 - fp64| of the stored prompt logits: HF's own float32 noise floor."""
    import copy
    m64 = copy.deepcopy(model).double()
    out = []
    with torch.no_grad():
        for p in prompts:
            l64 = m64(input_ids=torch.tensor([p["ids"]])).logits[0]
            d = max(float((logits_rows[i].double() - l64[q]).abs().max())
                    for q, i in zip(p["positions"], p["logits_index"]))
            p["fp32_vs_fp64_max_abs_diff"] = d
            out.append(d)
    del m64
    return out


# ---------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="HF model dir (tokenizer.json inside)")
    ap.add_argument("--text", required=True, help="heldout-code.txt")
    ap.add_argument("--out", required=True, help="output dir")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--tokenizer-only", action="store_true", help="skip the model goldens")
    args = ap.parse_args()
    for p in (args.model, args.text):
        if not os.path.exists(p):
            sys.exit("error: not found: %s" % p)
    tok_path = os.path.join(args.model, "tokenizer.json")
    if not os.path.isfile(tok_path):
        sys.exit("error: no tokenizer.json in %s" % args.model)
    os.makedirs(args.out, exist_ok=True)

    t_start = time.time()
    import tokenizers
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(tok_path)
    versions = {"tokenizers": tokenizers.__version__, "transformers": None, "torch": None,
                "tokenizer_sha256": sha256_file(tok_path)}
    hf_tok = None
    torch = None
    try:
        import transformers
        versions["transformers"] = transformers.__version__
        from transformers import AutoTokenizer
        hf_tok = AutoTokenizer.from_pretrained(args.model)
    except Exception as e:  # noqa: BLE001
        log("transformers unavailable:", repr(e))

    tg = make_tokenizer_golden(tok, hf_tok, args.text, versions)
    dump_json(os.path.join(args.out, "tokenizer.json"), tg)

    if args.tokenizer_only:
        log("tokenizer only; done in %.1fs" % (time.time() - t_start))
        return
    import torch  # noqa: F811
    import numpy as np
    from transformers import AutoModelForCausalLM
    versions["torch"] = torch.__version__
    torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    try:  # transformers 5 names it dtype; torch_dtype is the older spelling
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                     attn_implementation="eager")
    except TypeError:
        model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32,
                                                     attn_implementation="eager")
    if next(model.parameters()).dtype != torch.float32:
        log("note: model loaded as %s; upcasting to float32" % next(model.parameters()).dtype)
        model = model.float()
    model.eval()
    log("model: %s, attn %s, dtype %s, %.1fM params" % (
        type(model).__name__, getattr(model.config, "_attn_implementation", "?"),
        next(model.parameters()).dtype, sum(p.numel() for p in model.parameters()) / 1e6))
    vocab = int(model.config.vocab_size)

    logits_rows = []
    prompts, batch = make_parity_golden(model, torch, tok, hf_tok, versions, logits_rows)
    try:
        d64 = fp64_check(model, torch, prompts, logits_rows)
        log("fp32 vs fp64 max |logit diff| per prompt: %s" % ["%.3g" % d for d in d64])
    except Exception as e:  # noqa: BLE001
        log("fp64 check failed:", repr(e))
    arr = torch.stack(logits_rows).float().numpy().astype("<f4")   # [n_vectors, vocab]
    assert arr.shape == (len(logits_rows), vocab) and np.isfinite(arr).all()
    blob = arr.tobytes()
    with open(os.path.join(args.out, "logits.bin"), "wb") as f:
        f.write(blob)

    shards = sorted(f for f in os.listdir(args.model) if f.endswith(".safetensors"))
    parity = {
        "model": os.path.basename(os.path.normpath(args.model)),
        "model_files_sha256": {f: sha256_file(os.path.join(args.model, f)) for f in shards},
        "transformers": versions["transformers"],
        "torch": versions["torch"],
        "tokenizers": versions["tokenizers"],
        "dtype": "float32",
        "device": "cpu",
        "threads": args.threads,
        "attn_implementation": "eager",
        "vocab": vocab,
        "logits_file": "logits.bin",
        "logits_layout": "float32 little-endian, row-major [n_vectors, vocab]",
        "n_vectors": len(logits_rows),
        "logits_sha256": hashlib.sha256(blob).hexdigest(),
        "note": ("Made by tools/make_goldens.py: AutoModelForCausalLM.from_pretrained(model, "
                 "torch_dtype=float32, attn_implementation='eager') on CPU (bf16 weights upcast "
                 "exactly), one forward per prompt with no BOS; ids from tokenizers.Tokenizer"
                 ".encode(text, add_special_tokens=False). logits at 'positions' are rows "
                 "'logits_index' of logits.bin. greedy = 48 argmax tokens from "
                 "model.generate(do_sample=False, max_new_tokens=48, eos_token_id=None, default "
                 "DynamicCache), cross-checked with a manual argmax loop and a no-cache forward; "
                 "greedy_top2_margin is the top1-top2 logit gap at each step (small = near-tie). "
                 "The chat prompt is apply_chat_template(messages, add_generation_prompt=True)."),
        "prompts": prompts,
        "batch": batch,
    }
    dump_json(os.path.join(args.out, "parity.json"), parity)

    # ---- summary
    log("\n==== summary ====")
    log("versions: transformers %s torch %s tokenizers %s"
        % (versions["transformers"], versions["torch"], versions["tokenizers"]))
    h = tg["heldout"]
    log("heldout n_tokens %d (expected %d: %s) crc32 %08x chunks %d"
        % (h["n_tokens"], EXPECTED_HELDOUT_TOKENS, h["n_tokens"] == EXPECTED_HELDOUT_TOKENS,
           h["crc32"], len(h["chunk_crc32"])))
    for p in prompts:
        log("%-28s n=%d greedy=%d tokens: %r" % (p["name"], p["n_tokens"], len(p["greedy"]),
                                                 p["greedy_text"]))
    log("logits.bin %d vectors x %d = %d bytes" % (arr.shape[0], arr.shape[1], len(blob)))
    for f in sorted(os.listdir(args.out)):
        log("  %-16s %8d bytes" % (f, os.path.getsize(os.path.join(args.out, f))))
    log("done in %.1fs" % (time.time() - t_start))


if __name__ == "__main__":
    main()
