#!/usr/bin/env bash
# Prepares the pipeline image's build context on the host: OUT/eyrie holds the
# project's wheel, OUT/deps every dependency wheel for the image's Python plus
# requirements.txt pinning each one (name==version). The host's pip
# configuration (index, CA bundle, proxy, local wheels) is used here, so the
# image build itself needs no network and no credentials.
#
# usage: wheelhouse.sh OUT PYTHON_VERSION TORCH_SPEC [EXTRA_WHEEL_DIR]
#   TORCH_SPEC       e.g. torch==2.13.0 (CUDA, with PIP_EXTRA_INDEX_URL set to the
#                    PyTorch cu130 index) or torch==2.13.0+cpu
#   EXTRA_WHEEL_DIR  a folder whose flash_attn-*.whl is added when present
set -euo pipefail

out="$1"
python_version="$2"
torch_spec="$3"
extra_dir="${4:-}"
pip="${PIP:-.venv/bin/pip}"
extras="ml,generate,docker"

rm -rf "$out/eyrie" "$out/deps"
mkdir -p "$out/eyrie" "$out/deps"
"$pip" wheel --quiet --no-deps --wheel-dir "$out/eyrie" .
wheel="$(find "$out/eyrie" -name 'eyrie-*.whl' | head -n1)"

extra=()
if [ -n "$extra_dir" ] && compgen -G "$extra_dir/flash_attn-*.whl" >/dev/null; then
    extra=("$extra_dir"/flash_attn-*.whl)
    echo "wheelhouse: adding ${extra[*]}"
else
    echo "wheelhouse: no flash-attn wheel in ${extra_dir:-(none given)}; the image is built without flash-attn"
fi

# Binary wheels for the image's interpreter and glibc, whatever the host runs.
platforms=()
for glibc in 2_28 2_27 2_26 2_17 2_12 2_5; do
    platforms+=(--platform "manylinux_${glibc}_x86_64")
done
"$pip" download --quiet --dest "$out/deps" --only-binary=:all: \
    --python-version "$python_version" --implementation cp "${platforms[@]}" \
    "$wheel[$extras]" "$torch_spec" "${extra[@]}"
rm -f "$out"/deps/eyrie-*.whl

# One pinned line per wheel: wheel file names are name-version-tags.whl.
for file in "$out"/deps/*.whl; do
    base="$(basename "$file")"
    name="${base%%-*}"
    rest="${base#*-}"
    echo "${name}==${rest%%-*}"
done | sort >"$out/deps/requirements.txt"
echo "wheelhouse: $(wc -l <"$out/deps/requirements.txt") pinned wheels in $out/deps ($(du -sh "$out/deps" | cut -f1))"
