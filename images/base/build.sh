#!/usr/bin/env bash
# Builds the local Debian 12 base image (default tag eyrie-base:bookworm) with
# debootstrap + `docker import`, for machines without a container registry.
# The production Dockerfiles take their base as a build ARG; `make images
# base=local` substitutes this one. Idempotent: does nothing when the tag exists
# (pass --force to rebuild). Needs root, debootstrap and a running Docker engine.
set -euo pipefail

tag="${EYRIE_BASE_IMAGE:-eyrie-base:bookworm}"
suite="bookworm"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
force=0
[ "${1:-}" = "--force" ] && force=1

if [ "$force" -eq 0 ] && docker image inspect "$tag" >/dev/null 2>&1; then
    echo "base image $tag exists; skipping (use --force to rebuild)"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "images/base/build.sh: debootstrap needs root; run it with sudo" >&2
    exit 1
fi
if ! command -v debootstrap >/dev/null; then
    echo "images/base/build.sh: debootstrap is missing; apt-get install debootstrap" >&2
    exit 1
fi

rootfs="$(mktemp -d /var/tmp/eyrie-base.XXXXXX)"
trap 'rm -rf "$rootfs"' EXIT

echo "debootstrap --variant=minbase $suite -> $rootfs"
debootstrap --variant=minbase "$suite" "$rootfs" "$mirror" >"$rootfs.log" 2>&1 || {
    tail -n 20 "$rootfs.log" >&2
    echo "images/base/build.sh: debootstrap failed (full log: $rootfs.log)" >&2
    exit 1
}
rm -f "$rootfs.log"

# An image needs no package cache, and apt inside a build must not try to
# start services.
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
printf '#!/bin/sh\nexit 101\n' >"$rootfs/usr/sbin/policy-rc.d"
chmod 0755 "$rootfs/usr/sbin/policy-rc.d"
cat >"$rootfs/etc/apt/sources.list" <<SOURCES
deb $mirror $suite main
deb $mirror $suite-updates main
deb http://deb.debian.org/debian-security $suite-security main
SOURCES

tar --numeric-owner -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    --message "debootstrap --variant=minbase $suite" \
    - "$tag"
echo "built base image $tag"
