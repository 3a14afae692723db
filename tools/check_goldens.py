#!/usr/bin/env python3
"""Check the checked-in goldens (tests/golden/) for shape and, where the `regex` module is
installed, re-tokenize them with an independent pure-Python byte-level BPE.

Owns: nothing the product uses; a developer's sanity check of tests/golden/*.
Must not: need torch, transformers or tokenizers (runs on a plain CPU machine).

usage: python3 tools/check_goldens.py [--golden tests/golden] [--model models/qwen3-code-28m]
                                      [--text PATH/heldout-code.txt]
"""
import argparse
import json
import os
import struct
import sys
import zlib


# ---------------------------------------------------------------- reference BPE
def bytes_to_unicode():
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1))
          + list(range(ord("\u00ae"), ord("\u00ff") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class RefBPE:
    """GPT-2 style byte-level BPE: special tokens split first, GPT-2 regex, byte map, merges."""
    PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

    def __init__(self, path):
        import regex
        t = json.load(open(path, encoding="utf-8"))
        self.vocab = t["model"]["vocab"]
        self.inv = {v: k for k, v in self.vocab.items()}
        merges = t["model"]["merges"]
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]
        self.ranks = {m: i for i, m in enumerate(merges)}
        self.special = {a["content"]: a["id"] for a in t["added_tokens"]}
        for a in t["added_tokens"]:
            self.inv[a["id"]] = a["content"]
        self.pat = regex.compile(self.PAT)
        alts = sorted(self.special, key=len, reverse=True)
        self.spat = regex.compile("(" + "|".join(regex.escape(s) for s in alts) + ")")
        self.b2u = bytes_to_unicode()
        self.u2b = {v: k for k, v in self.b2u.items()}
        self.cache = {}

    def _bpe(self, word):
        if word in self.cache:
            return self.cache[word]
        parts = list(word)
        while len(parts) > 1:
            best, bi = None, -1
            for i in range(len(parts) - 1):
                r = self.ranks.get((parts[i], parts[i + 1]))
                if r is not None and (best is None or r < best):
                    best, bi = r, i
            if best is None:
                break
            parts[bi:bi + 2] = [parts[bi] + parts[bi + 1]]
        ids = [self.vocab[p] for p in parts]
        self.cache[word] = ids
        return ids

    def encode(self, text):
        out = []
        for seg in self.spat.split(text):
            if not seg:
                continue
            if seg in self.special:
                out.append(self.special[seg])
                continue
            for w in self.pat.findall(seg):
                out.extend(self._bpe("".join(self.b2u[b] for b in w.encode("utf-8"))))
        return out

    def decode(self, ids):
        bs = bytearray()
        for i in ids:
            s = self.inv[i]
            if s in self.special:
                bs += s.encode("utf-8")
            else:
                bs += bytes(self.u2b[c] for c in s)
        return bs.decode("utf-8", errors="replace")


def crc32_ids(ids):
    return zlib.crc32(struct.pack("<%dI" % len(ids), *ids)) & 0xFFFFFFFF


# ---------------------------------------------------------------- checks
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--golden", default="tests/golden")
    ap.add_argument("--model", default="models/qwen3-code-28m")
    ap.add_argument("--text", default=None, help="heldout-code.txt (optional; full re-tokenize)")
    a = ap.parse_args()
    bad = []

    def check(cond, msg):
        print(("ok   " if cond else "FAIL ") + msg)
        if not cond:
            bad.append(msg)

    tg = json.load(open(os.path.join(a.golden, "tokenizer.json"), encoding="utf-8"))
    pg = json.load(open(os.path.join(a.golden, "parity.json"), encoding="utf-8"))
    lsize = os.path.getsize(os.path.join(a.golden, "logits.bin"))
    h = tg["heldout"]
    check(h["n_tokens"] == 440479, "heldout n_tokens %d == 440479" % h["n_tokens"])
    check(len(h["head"]) == 2048, "head has 2048 ids")
    check(len(h["chunk_crc32"]) == (h["n_tokens"] + h["chunk"] - 1) // h["chunk"], "chunk count")
    check(h["n_id0"] == h["n_endoftext_in_text"], "every <|endoftext|> in the text is id 0")
    check(len(tg["cases"]) >= 40, "%d tokenizer cases" % len(tg["cases"]))
    for c in tg["cases"]:
        check(bytes.fromhex(c["utf8_hex"]).decode("utf-8") == c["text"],
              "case %s utf8_hex matches text" % c["name"])
    V, n = pg["vocab"], pg["n_vectors"]
    check(V == 8192, "vocab 8192")
    check(lsize == n * V * 4, "logits.bin %d bytes == %d x %d x 4" % (lsize, n, V))
    used = []
    for p in pg["prompts"]:
        check(len(p["greedy"]) == 48, "%s greedy is 48 long" % p["name"])
        check(p["positions"] == [0, p["n_tokens"] // 2, p["n_tokens"] - 1], "%s positions" % p["name"])
        check(len(p["ids"]) == p["n_tokens"], "%s ids length" % p["name"])
        used += p["logits_index"]
    used += [r["logits_index"] for r in pg["batch"]["rows"]]
    check(sorted(used) == list(range(n)), "logits_index covers 0..%d once each" % (n - 1))

    # independent re-tokenization
    try:
        bpe = RefBPE(os.path.join(a.model, "tokenizer.json"))
    except ImportError:
        print("skip reference BPE: python module `regex` not installed")
        bpe = None
    if bpe is not None:
        nd = 0
        for c in tg["cases"]:
            ids = bpe.encode(c["text"])
            if ids != c["ids"]:
                nd += 1
                print("  case %s: ref %s\n          hf  %s" % (c["name"], ids, c["ids"]))
            if bpe.decode(c["ids"]) != c["decoded"]:
                nd += 1
                print("  case %s: decode differs: %r vs %r" % (c["name"], bpe.decode(c["ids"]),
                                                                c["decoded"]))
        check(nd == 0, "reference BPE agrees on all %d cases (ids and decode)" % len(tg["cases"]))
        for p in pg["prompts"]:
            check(bpe.encode(p["text"]) == p["ids"], "reference BPE agrees on prompt %s" % p["name"])
            check(bpe.decode(p["greedy"]) == p["greedy_text"], "greedy_text decodes (%s)" % p["name"])
        if a.text:
            text = open(a.text, "rb").read().decode("utf-8")
            ids = bpe.encode(text)
            check(len(ids) == h["n_tokens"] and crc32_ids(ids) == h["crc32"],
                  "reference BPE on whole heldout: %d tokens, crc32 %08x" % (len(ids), crc32_ids(ids)))
            check(ids[:2048] == h["head"], "head matches")
            cc = [crc32_ids(ids[i:i + h["chunk"]]) for i in range(0, len(ids), h["chunk"])]
            check(cc == h["chunk_crc32"], "chunk crcs match")
    print("%d failures" % len(bad))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
