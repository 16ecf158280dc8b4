#!/usr/bin/env bash
# Prepares the flash-attn builder's build context on the host: OUT/eyrie (the
# project's wheel), OUT/deps (every wheel the build needs for the image's
# Python, with requirements.txt pinning each), OUT/src/flash-attn (the
# unpacked flash-attn sdist). The host's pip configuration is used here, so
# the image build needs no network and no credentials.
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

rm -rf "$out/eyrie" "$out/deps" "$out/src"
mkdir -p "$out/eyrie" "$out/deps" "$out/src"
"$pip" wheel --quiet --no-deps --wheel-dir "$out/eyrie" .
wheel="$(find "$out/eyrie" -name 'eyrie-*.whl' | head -n1)"

platforms=()
for glibc in 2_28 2_27 2_26 2_17 2_12 2_5; do
    platforms+=(--platform "manylinux_${glibc}_x86_64")
done
# What flash-attn's setup.py imports (torch, packaging, psutil, ninja, wheel,
# setuptools) and installs with (einops), plus eyrie itself.
"$pip" download --quiet --dest "$out/deps" --only-binary=:all: \
    --python-version "$python_version" --implementation cp "${platforms[@]}" \
    "$wheel" "$torch_spec" ninja packaging psutil wheel setuptools einops
rm -f "$out"/deps/eyrie-*.whl
for file in "$out"/deps/*.whl; do
    base="$(basename "$file")"
    name="${base%%-*}"
    rest="${base#*-}"
    echo "${name}==${rest%%-*}"
done | sort >"$out/deps/requirements.txt"

# The sdist's metadata step runs setup.py: skip its CUDA part (no nvcc needed here).
FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE "$pip" download --quiet --no-deps --no-binary :all: \
    --no-build-isolation --dest "$out/src" "flash-attn==${flash_attn_version}"
tar -xzf "$out/src/flash_attn-${flash_attn_version}.tar.gz" -C "$out/src"
mv "$out/src/flash_attn-${flash_attn_version}" "$out/src/flash-attn"
rm "$out/src/flash_attn-${flash_attn_version}.tar.gz"
echo "flash-attn build context ready in $out"
