#!/usr/bin/env bash
# Make sure the tools of the cluster tests (tests/cluster/: hosts in network namespaces) are there: ip and tc
# (iproute2), nsenter and unshare (util-linux), nft (nftables). As root, install what is missing with the
# system package manager; otherwise (or if that fails) the netns group skips, naming what it lacks.
set -euo pipefail
need=()
command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1 || need+=(iproute2)
command -v nsenter >/dev/null 2>&1 && command -v unshare >/dev/null 2>&1 || need+=(util-linux)
command -v nft >/dev/null 2>&1 || need+=(nftables)
if [ ${#need[@]} -eq 0 ]; then
    exit 0
fi
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get install -y -q "${need[@]}" >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "${need[@]}" >/dev/null 2>&1; }
fi
command -v ip >/dev/null 2>&1 && command -v nft >/dev/null 2>&1 && command -v nsenter >/dev/null 2>&1
