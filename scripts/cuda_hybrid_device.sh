#!/bin/bash
# cuda_hybrid_device.sh - the Qwen 3.5 device run (docs/CUDA.md, "Qwen 3.5 on the device"),
# in a scripts/cuda_pack.sh folder that also holds qwen35.tar.xz (the fixture, made on the
# build host: tar cJf PACK/qwen35.tar.xz -C ../shared/models qwen35-code-hybrid-30m) and
# heldout-150k.txt. Unpacks the fixture to ./shared/models and runs cuda_model_device.sh on
# it: test_cuda_hybrid, test_cuda_model on the hybrid, ppl on the GPU and the CPU, greedy
# continuations, bench model, memcheck.   Usage: cd PACK && ./cuda_hybrid_device.sh
set -u
mkdir -p shared/models && tar xJf qwen35.tar.xz -C shared/models || exit 1
export TQKV_SHARED=$PWD/shared CPU_PPL=1
exec ./cuda_model_device.sh shared/models/qwen35-code-hybrid-30m heldout-150k.txt
