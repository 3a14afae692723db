#!/usr/bin/env python3
"""make_chat_goldens.py - expected chat-template renderings for tests/test_chat_template.c.

Owns: tests/golden/chat/goldens.json (its content and format).
Must not: be imported by the product or by tests at run time; tests read only the files.

Renders every template in tests/golden/chat/*.jinja over a fixed set of conversations, with
and without the generation prompt, the way transformers' apply_chat_template(tokenize=False)
does, and records either the text or the error message that raise_exception() gave.

Backends:
  transformers (default, needs transformers; no internet: the tokenizer is built locally
      from a tokenizer.json file) - PreTrainedTokenizerFast.apply_chat_template(conversation,
      chat_template=..., tokenize=False, add_generation_prompt=..., bos_token=..., eos_token=...)
  jinja2 (--backend jinja2; a replica of transformers' environment, for local checks only:
      goldens committed to the repository come from the transformers backend)

Usage (GPU machine, where transformers is installed):
  python3 tools/make_chat_goldens.py --tokenizer ../../models/qwen3-code-28m/tokenizer.json \
      --out $OUT/goldens.json
"""
import argparse
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATE_DIR = os.path.join(HERE, "..", "tests", "golden", "chat")

# bos / eos strings each family's tokenizer passes to its template.
TOKENS = {
    "chatml_fixture": ("", "<|endoftext|>"),
    "qwen3": ("", "<|im_end|>"),
    "qwen3.5": ("", "<|im_end|>"),
    "llama3.3": ("<|begin_of_text|>", "<|eot_id|>"),
    "gemma3": ("<bos>", "<eos>"),
    "gemma4": ("<bos>", "<eos>"),
    # breadth: other families' templates (not required by the issue)
    "extra_gemma2": ("<bos>", "<eos>"),
    "extra_mistral_nemo": ("<s>", "</s>"),
    "extra_phi3.5": ("<s>", "<|endoftext|>"),
    "extra_deepseek_r1_qwen": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
}

UNI = "Grüße, 世界! Ελληνικά — emoji 🙂👍🏽, combining é, RTL שלום"


def conversations():
    """(name, messages) pairs: system/no system, multi-turn, unicode, empty content,
    assistant last, thinking blocks, whitespace at the edges, template-like text."""
    S = {"role": "system", "content": "You are a helpful assistant."}
    return [
        ("user_only", [{"role": "user", "content": "Hello!"}]),
        ("system_user", [S, {"role": "user", "content": "What is 2+2?"}]),
        ("multi_turn", [
            S,
            {"role": "user", "content": "Write a haiku about C."},
            {"role": "assistant", "content": "Pointers in the dark\nmalloc without a free\nsegfault at midnight"},
            {"role": "user", "content": "Now one about Python."},
        ]),
        ("assistant_last", [
            {"role": "user", "content": "Say hi."},
            {"role": "assistant", "content": "Hi there."},
        ]),
        ("multi_turn_no_system", [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
            {"role": "assistant", "content": "d"},
            {"role": "user", "content": "e"},
        ]),
        ("unicode", [
            {"role": "system", "content": "Réponds en français. " + UNI},
            {"role": "user", "content": UNI},
        ]),
        ("whitespace_edges", [
            {"role": "system", "content": "  \n\tsystem with spaces\u00a0\u3000 \n"},
            {"role": "user", "content": "\n\n  padded question?  \t\n"},
            {"role": "assistant", "content": "  padded answer \n"},
            {"role": "user", "content": "\u2003em-space edges\u2003"},
        ]),
        ("empty_content", [
            {"role": "user", "content": ""},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": ""},
        ]),
        ("thinking_history", [
            {"role": "user", "content": "What is 3*7?"},
            {"role": "assistant", "content": "<think>\n3*7 = 21.\n</think>\n\n21"},
            {"role": "user", "content": "And 4*5?"},
        ]),
        ("thinking_last", [
            {"role": "user", "content": "Is 17 prime?"},
            {"role": "assistant", "content": "<think>\nCheck 2, 3: no divisors.\n</think>\n\nYes, 17 is prime."},
        ]),
        ("template_like_text", [
            {"role": "user", "content": "Explain {{ messages }} and {% if x %} and {# c #} literally."},
            {"role": "assistant", "content": "They are Jinja tags: '{{', '{%', '{#'. <|im_end|> is text here."},
            {"role": "user", "content": "Quotes: \"double\" 'single' \\ backslash"},
        ]),
        ("long_content", [
            {"role": "user", "content": ("def f(x):\n    return x * 2\n\n" * 40) + "Explain."},
        ]),
        # Gemma 3 raises on non-alternating roles; others render it.
        ("two_users", [
            {"role": "user", "content": "first"},
            {"role": "user", "content": "second"},
        ]),
        # Qwen 3.5 raises 'No user query found in messages.'
        ("system_only", [S]),
        ("tool_response_user", [
            {"role": "user", "content": "<tool_response>\n42\n</tool_response>"},
            {"role": "user", "content": "plain question"},
        ]),
    ]


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}


def extended_cases():
    """(name, messages, extra variables): what tqkv_chat_template_render_json passes on top of
    role/content - tools, tool calls and responses, reasoning_content, enable_thinking,
    content as a list of parts."""
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"id": "call12345", "type": "function",
                            "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]}
    return [
        ("thinking_off", [{"role": "user", "content": "Hi"}], {"enable_thinking": False}),
        ("thinking_on", [{"role": "user", "content": "Hi"}], {"enable_thinking": True}),
        ("tools_offered", [{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": "Weather in Paris?"}], {"tools": [WEATHER_TOOL]}),
        ("tool_round_trip", [{"role": "user", "content": "Weather in Paris?"}, call,
                             {"role": "tool", "tool_call_id": "call12345", "content": "{\"temp\": 21}"}],
         {"tools": [WEATHER_TOOL]}),
        ("reasoning_field", [{"role": "user", "content": "2+2?"},
                             {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
                             {"role": "user", "content": "3+3?"}], {}),
        ("content_parts", [{"role": "user", "content": [{"type": "text", "text": "  Describe  "},
                                                        {"type": "text", "text": "briefly."}]}], {}),
        ("date_string", [{"role": "user", "content": "Date?"}], {"date_string": "01 Jan 2026"}),
    ]


def load_templates(only):
    out = {}
    for path in sorted(glob.glob(os.path.join(TEMPLATE_DIR, "*.jinja"))):
        name = os.path.basename(path)[: -len(".jinja")]
        if only and name not in only:
            continue
        with open(path, encoding="utf-8") as f:
            out[name] = f.read()
    return out


def make_renderer(backend, tokenizer_file):
    if backend == "transformers":
        import transformers
        try:
            from transformers import PreTrainedTokenizerFast

            tok = PreTrainedTokenizerFast(tokenizer_file=tokenizer_file)

            def render(template, messages, agp, bos, eos, extra=None):
                extra = dict(extra or {})
                tools = extra.pop("tools", None)
                out = tok.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                              add_generation_prompt=agp, bos_token=bos, eos_token=eos, **extra)
                if isinstance(out, list):  # a batch of one
                    out = out[0]
                if not isinstance(out, str):
                    raise TypeError("apply_chat_template returned %r" % type(out))
                return out

            return render, ("transformers %s (PreTrainedTokenizerFast.apply_chat_template, tokenize=False)"
                            % transformers.__version__)
        except (OSError, ImportError, ValueError) as e:  # no usable tokenizer file: transformers' own environment
            print("tokenizer path unavailable (%s); using _compile_jinja_template" % e, file=sys.stderr)
            from transformers.utils.chat_template_utils import _compile_jinja_template

            cache = {}

            def render(template, messages, agp, bos, eos, extra=None):
                if template not in cache:
                    cache[template] = _compile_jinja_template(template)
                kw = {"tools": None, "documents": None}
                kw.update(extra or {})
                return cache[template].render(messages=messages, add_generation_prompt=agp, bos_token=bos,
                                              eos_token=eos, **kw)

            return render, ("transformers %s (chat_template_utils._compile_jinja_template)"
                            % transformers.__version__)

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    cache = {}

    def render(template, messages, agp, bos, eos, extra=None):
        if template not in cache:
            cache[template] = env.from_string(template)
        kw = {"tools": None, "documents": None}
        kw.update(extra or {})
        return cache[template].render(messages=messages, add_generation_prompt=agp, bos_token=bos, eos_token=eos,
                                      **kw)

    return render, "jinja2 %s replica of transformers' environment (local check only)" % jinja2.__version__


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["transformers", "jinja2"], default="transformers")
    ap.add_argument("--tokenizer", default=os.path.join(HERE, "..", "models", "qwen3-code-28m", "tokenizer.json"),
                    help="a tokenizer.json to build PreTrainedTokenizerFast from (transformers backend)")
    ap.add_argument("--only", nargs="*", help="template names (default: all)")
    ap.add_argument("--extended", action="store_true",
                    help="the extended cases (tools, tool calls, enable_thinking, ...) instead of the basic ones")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import jinja2  # the error type raise_exception() produces, in both backends

    render, generator = make_renderer(args.backend, args.tokenizer)
    replica = make_renderer("jinja2", None)[0] if args.backend == "transformers" else None
    replica_diffs = 0
    templates = load_templates(args.only)
    cases = []
    for tname, text in templates.items():
        bos, eos = TOKENS.get(tname, ("", ""))
        convs = extended_cases() if args.extended else [(c, m, {}) for c, m in conversations()]
        for cname, msgs, extra in convs:
            for agp in (False, True):
                case = {"template": tname, "conversation": cname, "add_generation_prompt": agp,
                        "bos_token": bos, "eos_token": eos, "messages": msgs}
                if extra:
                    case["extra"] = extra
                try:
                    case["expected"] = render(text, msgs, agp, bos, eos, extra)
                except jinja2.exceptions.TemplateError as e:  # raise_exception() or undefined
                    case["error"] = str(e)
                    case["error_kind"] = type(e).__name__
                except (TypeError, ValueError, KeyError, AttributeError) as e:  # Python-level failure
                    case["error"] = str(e)
                    case["error_kind"] = type(e).__name__
                if replica:  # how far the local replica is from transformers (informational)
                    try:
                        r = {"expected": replica(text, msgs, agp, bos, eos, extra)}
                    except (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
                        r = {"error": str(e)}
                    if r.get("expected") != case.get("expected") or r.get("error") != case.get("error"):
                        replica_diffs += 1
                        print("replica differs: %s %s agp=%d" % (tname, cname, agp), file=sys.stderr)
                cases.append(case)
                print("%-16s %-22s agp=%d %s" % (tname, cname, agp, "ERROR " + case["error"] if "error" in case
                                                  else "%d chars" % len(case["expected"])), file=sys.stderr)
    doc = {"generator": generator, "python": sys.version.split()[0], "jinja2": jinja2.__version__,
           "replica_mismatches": replica_diffs,
           "templates": {k: k + ".jinja" for k in templates}, "cases": cases}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print("wrote %d cases to %s (%s)" % (len(cases), args.out, generator), file=sys.stderr)


if __name__ == "__main__":
    main()
