#!/bin/sh
# make_manpage.sh TQKV_BINARY OUT VERSION - write the tqkv(1) man page from the binary's
# own --help texts (`tqkv --help` lists the commands; each `tqkv CMD --help` its options),
# so the page cannot drift from the options the program accepts.
set -eu
bin="$1" out="$2" version="$3"
tmp="$out.tmp"
esc() { sed -e 's/\\/\\e/g' -e 's/^\./\\\&./' -e "s/^'/\\\\\\&'/"; }
{
  echo ".TH TQKV 1 \"\" \"tqkv $version\" \"User Commands\""
  echo ".SH NAME"
  echo "tqkv \\- TurboQuant-compressed KV cache: run, evaluate and benchmark language models"
  echo ".SH SYNOPSIS"
  echo ".B tqkv"
  echo ".I command"
  echo "[options]"
  echo ".SH DESCRIPTION"
  echo "tqkv runs Hugging Face checkpoints (Qwen3, Qwen2, Llama) on the CPU with a KV cache"
  echo "compressed by TurboQuant (randomized Hadamard rotation + Lloyd-Max codebooks, 2-4 bits"
  echo "per value) that attention reads in place. Every command that prints figures takes"
  echo ".BR \\-\\-json ."
  echo "KV formats: f32, f16, q8, q4, tq2, tq3, tq4, or K/V such as tq4/tq3."
  echo ".SH COMMANDS"
  "$bin" --help | sed -n '/^commands:/,$p' | sed 1d | grep -E '^  [a-z]' |
  while IFS= read -r line; do
    name=$(printf '%s\n' "$line" | sed -E 's/^  ([a-z-]+( [a-z-]+)?)  +.*/\1/')
    desc=$(printf '%s\n' "$line" | sed -E 's/^  [a-z-]+( [a-z-]+)?  +//')
    echo ".SS tqkv $name"
    printf '%s\n' "$desc" | esc
    echo ".PP"
    echo ".nf"
    # shellcheck disable=SC2086
    "$bin" $name --help | esc
    echo ".fi"
  done
  echo ".SH EXIT STATUS"
  echo "0 on success, 1 when a command fails (the message is on stderr), 2 on a usage error."
  echo ".SH ENVIRONMENT"
  echo ".TP"
  echo ".B TQKV_NO_SIMD=1"
  echo "use the scalar kernels instead of AVX2."
  echo ".SH SEE ALSO"
  echo "The library: tqkv.h, tqkv_model.h, tqkv_tokenizer.h; pkg-config tqkv, tqkv-model;"
  echo "CMake find_package(tqkv)."
} > "$tmp"
mv "$tmp" "$out"
