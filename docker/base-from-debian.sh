#!/bin/sh
# Build a Debian bookworm base image with python3 and python3-venv from Debian packages, for sites that
# cannot pull from a container registry. The result can be passed to docker/Dockerfile as BASE_IMAGE.
#
#   sudo docker/base-from-debian.sh [TAG]        (default TAG: dissoc-base:bookworm)
#
# Environment:
#   DEBIAN_MIRROR    Debian archive to bootstrap from (default http://deb.debian.org/debian)
#   DEBIAN_SUITE     suite (default bookworm; the project needs Python >= 3.11)
#   EXTRA_PACKAGES   comma-separated packages to add (default none)
#
# Needs root (debootstrap), debootstrap itself and a docker daemon that answers.
set -eu

TAG="${1:-dissoc-base:bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SUITE="${DEBIAN_SUITE:-bookworm}"
PACKAGES="python3,python3-venv,ca-certificates"
if [ -n "${EXTRA_PACKAGES:-}" ]; then
    PACKAGES="$PACKAGES,$EXTRA_PACKAGES"
fi

command -v debootstrap >/dev/null || { echo "base-from-debian.sh: debootstrap is not installed" >&2; exit 2; }
command -v docker >/dev/null || { echo "base-from-debian.sh: docker is not installed" >&2; exit 2; }

ROOT="$(mktemp -d "${TMPDIR:-/tmp}/dissoc-base.XXXXXX")"
cleanup() { rm -rf "$ROOT"; }
trap cleanup EXIT INT TERM

debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOT" "$MIRROR"

# Make the root small and reproducible-ish: no package caches, no apt lists, no machine id.
chroot "$ROOT" apt-get clean
rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/cache/apt/*.bin "$ROOT"/var/log/* "$ROOT"/tmp/* \
    "$ROOT"/usr/share/doc/* "$ROOT"/usr/share/man/* "$ROOT"/usr/share/info/*
: > "$ROOT/etc/machine-id"
# The image's apt talks to the same archive it was made from.
printf 'deb %s %s main\n' "$MIRROR" "$SUITE" > "$ROOT/etc/apt/sources.list"

tar --numeric-owner -C "$ROOT" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    - "$TAG"
docker run --rm --network host "$TAG" python3 -c 'import sys, venv, ssl; print(sys.version)'
echo "$TAG"
