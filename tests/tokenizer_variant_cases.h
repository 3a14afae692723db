/*
 * tokenizer_variant_cases.h - expected outputs for test_tokenizer.c's variants of the
 * bundled tokenizer.json (qwen2, llama3, added, splits, norms, tiny*; built by
 * load_variant() there), as produced by HF tokenizers 0.23.2.
 * Owns: data only. Must not: hold code or be included by anything but test_tokenizer.c.
 */
#ifndef TQKV_TOKENIZER_VARIANT_CASES_H
#define TQKV_TOKENIZER_VARIANT_CASES_H

#include <stdint.h>

typedef struct {
    const char *variant, *text;
    int32_t     ids[40];
    int         n;
    const char *decoded, *decoded_skip;
} variant_case;

/* Made by HF tokenizers 0.23.2 (encode(text, add_special_tokens=False), decode(ids,
 * skip_special_tokens=False / True)) on the same variant JSON. */
static const variant_case VARIANT_CASES[] = {
    {"qwen2", "Hello world's 12345 'LL\x0d\x0a\x0a  x  ", {6742, 313, 8167, 1229, 223, 19, 20, 21, 22, 23, 381, 4025, 204, 423, 223, 455, 259}, 17, "Hello world's 12345 'LL\x0d\x0a\x0a  x  ", "Hello world's 12345 'LL\x0d\x0a\x0a  x  "},
    {"qwen2", "caf\xc3\xa9 na\xc3\xafve \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e \xf0\x9f\x91\x8d\xf0\x9f\x8f\xbd", {601, 72, 130, 105, 5471, 130, 110, 402, 223, 165, 248, 101, 165, 253, 108, 167, 106, 255, 223, 789, 242, 238, 789, 240, 124}, 25, "caf\xc3\xa9 na\xc3\xafve \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e \xf0\x9f\x91\x8d\xf0\x9f\x8f\xbd", "caf\xc3\xa9 na\xc3\xafve \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e \xf0\x9f\x91\x8d\xf0\x9f\x8f\xbd"},
    {"qwen2", "def f(x):\x0a    return x**2  # hi\x0a", {330, 286, 10, 90, 321, 201, 261, 372, 455, 638, 20, 223, 326, 466, 75, 201}, 16, "def f(x):\x0a    return x**2  # hi\x0a", "def f(x):\x0a    return x**2  # hi\x0a"},
    {"qwen2", "a\xc2\x85""b  \xe3\x80\x80""c", {67, 129, 230, 68, 259, 162, 225, 225, 69}, 9, "a\xc2\x85""b  \xe3\x80\x80""c", "a\xc2\x85""b  \xe3\x80\x80""c"},
    {"llama3", "HELLO World's 1234567 \xce\x9f\xce\x94\xce\x9f\xce\xa3 \xc4\xb0stanbul \xef\xac\x81le \xef\xbc\x91\xef\xbc\x92\xef\xbc\x93", {1468, 78, 313, 8167, 381, 85, 223, 1716, 21, 624, 2123, 1179, 223, 141, 126, 141, 115, 141, 126, 142, 228, 280, 223, 139, 232, 555, 68, 335, 922, 223, 1716, 21}, 32, " hello world 's  123 456 7 \xce\xbf\xce\xb4\xce\xbf\xcf\x83 i \xcc\x87stanbul file  123", " hello world 's  123 456 7 \xce\xbf\xce\xb4\xce\xbf\xcf\x83 i \xcc\x87stanbul file  123"},
    {"llama3", "  <|im_start|>user\x0ahi<|im_end|>", {259, 1, 2211, 223, 201, 466, 75, 2}, 8, "  <|im_start|> user \x0a hi<|im_end|>", "   user \x0a hi"},
    {"llama3", "x\xc2\xb2 Cafe\xcc\x81", {455, 406, 1266, 72, 130, 105}, 6, " x 2 caf\xc3\xa9", " x 2 caf\xc3\xa9"},
    {"added", " <tool>  x", {8192, 90}, 2, "<tool>x", "<tool>x"},
    {"added", "fn fnx _fn fn_ (fn) \xc3\xa9""fn fn\xc3\xa9", {1230, 286, 1688, 383, 1230, 2566, 65, 325, 1230, 11, 223, 130, 105, 1230, 2566, 130, 105}, 17, "fn fnx _fn fn_ (fn) \xc3\xa9""fn fn\xc3\xa9", "fn fnx _fn fn_ (fn) \xc3\xa9""fn fn\xc3\xa9"},
    {"added", "Hello HELLO hello", {8193, 223, 8193, 223, 8193}, 5, "hello hello hello", "hello hello hello"},
    {"added", "<|sys|>x <|sys|>y", {8195, 223, 8194, 91}, 4, "<|sys|>x <|sys|>y", " y"},
    {"added", "a<tool>b\x0a<tool>\x0a", {67, 8192, 68, 8192}, 4, "a<tool>b<tool>", "a<tool>b<tool>"},
    {"added", "<|endoftext|>fn", {0, 1230}, 2, "<|endoftext|>fn", "fn"},
    {"splits", "a_b_c 123 __init__ x\xc2\xb2y", {67, 65, 68, 65, 69, 223, 19, 20, 21, 223, 65, 65, 597, 65, 65, 223, 90, 129, 113, 91}, 20, "a_b_c 123 __init__ x\xc2\xb2y", "a_b_c 123 __init__ x\xc2\xb2y"},
    {"splits", "foo  bar\x09""baz\x0a\x0aqux", {2369, 259, 1828, 200, 1509, 92, 423, 405, 90}, 9, "foo  bar\x09""baz\x0a\x0aqux", "foo  bar\x09""baz\x0a\x0aqux"},
    {"splits", "\xef\xbc\x91\xef\xbc\x92\xef\xbc\x93""abc", {174, 123, 242, 174, 123, 243, 174, 123, 244, 2235}, 10, "\xef\xbc\x91\xef\xbc\x92\xef\xbc\x93""abc", "\xef\xbc\x91\xef\xbc\x92\xef\xbc\x93""abc"},
    {"norms", "a\xc2\x85""b c\xe2\x80\xa8""d\xc2\xa0""e", {6790, 67, 312, 287, 346, 318}, 6, " ^a b c d e", " ^a b c d e"},
    {"norms", "  Caf\xc3\xa9  123 na\xc3\xafve x\xc2\xb2  ", {6790, 37, 2172, 326, 5471, 581, 455, 223, 129, 113}, 10, " ^Cafe # naive x \xc2\xb2", " ^Cafe # naive x \xc2\xb2"},
    {"norms", "\xc3\x85NGSTR\xc3\x96M  0x1F", {6790, 1374, 41, 1500, 2187, 47, 326, 90, 5, 40}, 10, " ^ANGSTROM #x#F", " ^ANGSTROM #x#F"},
    {"norms", "   ", {}, 0, "", ""},
    {"tiny", "ab abc abd cab \xc3\xa9""d a b", {3, 11, 3, 0, 6, 12, 4, 7, 8, 0, 1, 2}, 12, "ab abc ab <unk> c ##a ##b <0xC3> <0xA9> <unk> a b", "ab abc ab <unk> c ##a ##b <0xC3> <0xA9> <unk> a b"},
    {"tiny", "abcabc zz", {11, 12, 4, 10, 0, 0}, 6, "abc ##a ##b ##c <unk> <unk>", "abc ##a ##b ##c <unk> <unk>"},
    {"tinyunk", "ab abc abd cab \xc3\xa9""d a b", {3, 11, 3, 0, 6, 12, 4, 0, 1, 2}, 10, "ab abc ab <unk> c ##a ##b <unk> a b", "ab abc ab <unk> c ##a ##b <unk> a b"},
    {"tinyunk", "xxab zzy", {0, 12, 4, 0}, 4, "<unk> ##a ##b <unk>", "<unk> ##a ##b <unk>"},
    {"tinynounk", "ab abc abd cab \xc3\xa9""d a b", {3, 11, 3, 6, 12, 4, 1, 2}, 8, "ab abc ab c ##a ##b a b", "ab abc ab c ##a ##b a b"},
    {"tinynounk", "xxab zzy", {12, 4}, 2, "##a ##b", "##a ##b"},
};

#endif
