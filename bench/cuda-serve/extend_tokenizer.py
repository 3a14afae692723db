#!/usr/bin/env python3
"""extend_tokenizer.py - give a random-weight checkpoint (scripts/cuda_make_llama8b.py, no
tokenizer) the bundled model's tokenizer, padded with plain added tokens "<|xN|>" up to the
checkpoint's vocab_size, so that every id the random model samples decodes (the serving
benchmark sends token ids and counts tokens; the text is never read).
Usage: extend_tokenizer.py SRC_MODEL_DIR DST_MODEL_DIR"""
import json, os, shutil, sys

src, dst = sys.argv[1], sys.argv[2]
vocab = json.load(open(os.path.join(dst, "config.json")))["vocab_size"]
tok = json.load(open(os.path.join(src, "tokenizer.json")))
n = max(list(tok["model"]["vocab"].values()) + [a["id"] for a in tok["added_tokens"]]) + 1
for i in range(n, vocab):
    tok["added_tokens"].append({"id": i, "content": f"<|x{i}|>", "single_word": False,
                                "lstrip": False, "rstrip": False, "normalized": False,
                                "special": False})
json.dump(tok, open(os.path.join(dst, "tokenizer.json"), "w"))
for f in ("tokenizer_config.json", "chat_template.jinja"):
    if os.path.exists(os.path.join(src, f)):
        shutil.copy(os.path.join(src, f), os.path.join(dst, f))
print(f"extend_tokenizer: {n} -> {vocab} ids", file=sys.stderr)
