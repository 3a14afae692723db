#!/bin/bash
# sass_local.sh - the SASS of this build's sm_90 kernels, here, without a GPU or a CUDA 13
# disassembler: nvcc 13 writes cubins in ELF ABI 8, which Debian's nvdisasm (CUDA 11.8,
# package nvidia-cuda-toolkit in bookworm's non-free, never installed by the project)
# reads once the header is put back in the ABI 7 form (ABI version, sm_90 flags). Use it to
# count a kernel loop's instructions before spending device time (docs/CUDA.md "Device runs").
#   scripts/sass_local.sh SRC.cu [NVDISASM] > out.sass   (compiled with the build's flags)
# Get nvdisasm (this adds Debian's non-free source to apt, then downloads and unpacks the
# package without installing it):
#   echo 'Types: deb
#   URIs: http://deb.debian.org/debian
#   Suites: bookworm
#   Components: non-free
#   Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg' > /etc/apt/sources.list.d/nonfree.sources
#   apt-get update && apt-get download nvidia-cuda-toolkit && dpkg -x nvidia-cuda-toolkit_*.deb x
#   -> x/usr/bin/nvdisasm
set -eu
SRC=${1:?source .cu}; DIS=${2:-nvdisasm}; BUILD=${BUILD:-build}
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
nvcc -DTQKV_HAVE_CUDA=1 --options-file "$BUILD/CMakeFiles/tqkv_cuda_objs.dir/includes_CUDA.rsp" -O3 -DNDEBUG \
  -arch=sm_90 -D_GNU_SOURCE -std=c++17 -cubin -o "$T/k.cubin" "$SRC"
python3 - "$T/k.cubin" <<'PY'
import struct, sys
b = bytearray(open(sys.argv[1], 'rb').read())
b[7], b[8] = 0x33, 7                          # OS/ABI and ABI version of CUDA <= 12 cubins
struct.pack_into('<I', b, 0x30, 0x5a055a)     # e_flags: sm_90, virtual sm_90
open(sys.argv[1], 'wb').write(b)
PY
"$DIS" -c "$T/k.cubin"
