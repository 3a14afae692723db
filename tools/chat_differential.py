#!/usr/bin/env python3
"""chat_differential.py - random differential test of the C chat-template engine against
jinja2 set up as transformers sets it up (trim_blocks, lstrip_blocks, loopcontrols, its
tojson and raise_exception).

Owns: a random generator of small templates (expressions over ints, floats, strings with
Unicode and whitespace, lists, dicts, none, undefined; operators, filters, tests, methods,
slices, if / for / set / macro), and the comparison: both engines render the same text, or
both fail. Messages of failures are not compared.
Must not: be run by CI (it needs jinja2 and the built CLI); tests read only committed goldens.

Usage: python3 tools/chat_differential.py --tqkv build/tqkv [--cases 2000] [--seed N]
Exit status 1 if any case differs (each is printed with both results).
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_chat_goldens import make_renderer  # noqa: E402

VARS = {
    "i": 3, "j": -7, "z": 0, "f": 2.5, "h": -0.125,
    "s": "Hello World", "e": "", "u8": "héllo wörld 你好 🙂", "ws": "  \t pad \n\u00a0",
    "csv": "a,b,,c", "think": "<think>\nr\n</think>\n\nanswer",
    "lst": [1, 2, 3], "sl": ["b", "a", "C"], "mix": [1, "a", None, True], "empty": [],
    "d": {"a": 1, "b": "x", "k": [1, 2]}, "ed": {},
    "msgs": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " yo "}],
    "t": True, "fa": False, "n": None,
}
NUM = ["i", "j", "z", "f", "h", "1", "2", "0", "-1", "0.5", "3.0", "1e3", "true"]
STR = ["s", "e", "u8", "ws", "csv", "think", "'a'", "''", "'x y'", "'\\n'", "'é'", "\"q'\""]
SEQ = ["lst", "sl", "mix", "empty", "[1, 'a']", "[]", "msgs", "(1, 2)"]
MAP = ["d", "ed", "{'a': 1, 'b': [2]}", "msgs[0]"]
OTHER = ["t", "fa", "n", "none", "true", "false", "nope"]
FILTERS0 = ["trim", "length", "first", "last", "string", "upper", "lower", "capitalize", "title", "list",
            "tojson", "items", "dictsort", "reverse", "int", "float", "abs", "safe", "count"]
TESTS0 = ["defined", "undefined", "none", "string", "mapping", "iterable", "sequence", "number",
          "integer", "float", "boolean", "true", "false", "odd", "even", "lower", "upper", "callable"]
METHODS = ["upper()", "lower()", "strip()", "lstrip()", "rstrip()", "strip('H')", "split()", "split(',')",
           "split(',', 1)", "startswith('H')", "endswith(('d', 'x'))", "replace('l', 'L')", "replace('l', '', 1)",
           "find('o')", "count('l')", "title()", "capitalize()", "items()", "keys()", "values()", "get('a')",
           "get('zz', 5)", "join(['x', 'y'])"]


def atom(r):
    pool = r.choice([NUM, STR, SEQ, MAP, OTHER])
    return r.choice(pool)


def expr(r, depth=0):
    if depth > 3 or r.random() < 0.3:
        return atom(r)
    k = r.randrange(14)
    a = lambda: expr(r, depth + 1)  # noqa: E731
    if k == 0:
        return "(%s %s %s)" % (a(), r.choice(["+", "-", "*", "/", "//", "%", "~"]), a())
    if k == 1:
        return "(%s %s %s)" % (a(), r.choice(["==", "!=", "<", "<=", ">", ">="]), a())
    if k == 2:
        return "(%s %s %s)" % (a(), r.choice(["and", "or"]), a())
    if k == 3:
        return "(not %s)" % a()
    if k == 4:
        return "(%s if %s else %s)" % (a(), a(), a())
    if k == 5:
        return "(%s %s %s)" % (a(), r.choice(["in", "not in"]), r.choice(STR + SEQ + MAP))
    if k == 6:
        return "(%s|%s)" % (a(), r.choice(FILTERS0))
    if k == 7:
        f = r.choice(["default('D')", "default('D', true)", "join('-')", "join(', ')", "replace('a', 'A')",
                      "trim('H')", "map('upper')|list", "select|list", "reject|list", "select('odd')|list",
                      "reject('equalto', 'a')|list", "selectattr('role', 'equalto', 'user')|list",
                      "map(attribute='role')|list", "tojson(indent=2)", "tojson(sort_keys=true)",
                      "dictsort(reverse=true)", "dictsort(by='value')", "int(7)", "float(1.5)"])
        return "(%s|%s)" % (a(), f)
    if k == 8:
        return "(%s is %s%s)" % (a(), r.choice(["", "not "]), r.choice(TESTS0))
    if k == 9:
        return "(%s is %s)" % (a(), r.choice(["divisibleby 3", "eq 1", "equalto 'a'", "in [1, 'a']", "gt 0",
                                            "sameas none", "ne 2"]))
    if k == 10:
        parts = [r.choice(["", "1", "-1", "2", "-2", "0", "10"]) for _ in range(3)]
        if r.random() < 0.5:
            return "%s[%s:%s]" % (r.choice(STR + SEQ), parts[0], parts[1])
        return "%s[%s:%s:%s]" % (r.choice(STR + SEQ), parts[0], parts[1], r.choice(["1", "-1", "2", "-2", ""]))
    if k == 11:
        return "%s[%s]" % (r.choice(STR + SEQ + MAP), r.choice(["0", "-1", "1", "5", "'a'", "'k'", "i"]))
    if k == 12:
        return "%s.%s" % (r.choice(STR + MAP + ["msgs[1]"]), r.choice(METHODS + ["a", "role", "content", "zz"]))
    return "[%s, %s]" % (a(), a())


def template(r):
    k = r.randrange(8)
    e = expr(r)
    if k == 0:
        return "{%% for x in %s %%}{{ loop.index0 }}{{ loop.first }}{{ loop.last }}:{{ x }};{%% else %%}E{%% endfor %%}" % e
    if k == 1:
        return "{%% if %s %%}Y{%% elif %s %%}M{%% else %%}N{%% endif %%}" % (e, expr(r))
    if k == 2:
        return "{%% set v = %s %%}[{{ v }}]{%% set ns = namespace(c=0) %%}{%% for q in [1, 2] %%}{%% set ns.c = ns.c + 1 %%}{%% endfor %%}{{ ns.c }}" % e
    if k == 3:
        return "{%% macro m(a, b='B') %%}<{{ a }}|{{ b }}>{%% endmacro %%}{{ m(%s) }}{{ m(1, b=%s)|trim }}" % (e, expr(r))
    if k == 4:
        return "{%% for k, v in %s|items %%}{{ k }}={{ v }},{%% endfor %%}" % r.choice(MAP)
    if k == 5:
        return "  {%% if true %%}\n  {{ %s }}\n  {%%- endif %%}\n{# c #}\n x {{- 'y' -}} \n" % e
    return "{{ %s }}" % e


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tqkv", required=True, help="path of the built tqkv CLI")
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    print("seed=%d" % seed, file=sys.stderr)
    r = random.Random(seed)
    render, _ = make_renderer("jinja2", None)
    extra = json.dumps(VARS)
    bad = 0
    tdir = tempfile.mkdtemp(prefix="tqkv_diff_")
    tfile = os.path.join(tdir, "t.jinja")
    for c in range(args.cases):
        tpl = template(r)
        try:
            ref = render(tpl, [{"role": "user", "content": "p"}], False, "<s>", "</s>", dict(VARS))
            ref_ok = True
        except Exception as e:  # any failure of the reference counts as "fails"
            ref, ref_ok = "%s: %s" % (type(e).__name__, e), False
        with open(tfile, "w", encoding="utf-8") as f:
            f.write(tpl)
        p = subprocess.run([args.tqkv, "chat-template", "--template", tfile, "--prompt", "p", "--bos", "<s>",
                            "--eos", "</s>", "--extra", extra, "--json"], capture_output=True)
        got_ok = p.returncode == 0
        got = json.loads(p.stdout)["text"] if got_ok else p.stderr.decode("utf-8", "replace").strip()
        if got_ok != ref_ok or (got_ok and got != ref):
            bad += 1
            print("DIFF #%d %r\n  jinja2: %s %r\n  tqkv  : %s %r" % (c, tpl, "ok" if ref_ok else "fails", ref,
                                                                    "ok" if got_ok else "fails", got))
    os.remove(tfile)
    os.rmdir(tdir)
    print("%d cases, %d differences (seed %d)" % (args.cases, bad, seed), file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
