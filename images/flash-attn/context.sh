#!/usr/bin/env bash
# Prepares the flash-attn builder's build context on the host: OUT/eyrie (the
# project's wheel) and OUT/deps (every wheel the build needs for the image's
# Python, with requirements.txt pinning each), both from images/wheelhouse.sh,
# and OUT/src/flash-attn (the unpacked flash-attn sdist). The host's pip
# configuration is used here, so the image build needs no network and no
# credentials.
#
# usage: context.sh OUT PYTHON_VERSION TORCH_SPEC FLASH_ATTN_VERSION
#   TORCH_SPEC  the torch the wheel is built against, e.g. torch==2.13.0 with
#               PIP_EXTRA_INDEX_URL set to the PyTorch cu130 index
set -euo pipefail

out="$1"
python_version="$2"
torch_spec="$3"
flash_attn_version="$4"
pip="${PIP:-.venv/bin/pip}"
images="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# What flash-attn's setup.py imports (torch, packaging, psutil, ninja, wheel,
# setuptools) and installs with (einops), plus eyrie itself (no extras).
PIP="$pip" "$images/wheelhouse.sh" "$out" "$python_version" "" \
    "$torch_spec" ninja packaging psutil wheel setuptools einops

rm -rf "$out/src"
mkdir -p "$out/src"
# The sdist's metadata step runs setup.py: skip its CUDA part (no nvcc needed here).
FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE "$pip" download --quiet --no-deps --no-binary :all: \
    --no-build-isolation --dest "$out/src" "flash-attn==${flash_attn_version}"
tar -xzf "$out/src/flash_attn-${flash_attn_version}.tar.gz" -C "$out/src"
mv "$out/src/flash_attn-${flash_attn_version}" "$out/src/flash-attn"
rm "$out/src/flash_attn-${flash_attn_version}.tar.gz"
echo "flash-attn build context ready in $out"
