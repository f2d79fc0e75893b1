#!/usr/bin/env bash
# Downloads the Debian packages strata builds against into .deps/ (git-ignored),
# so they can be carried to a machine that reaches no package registry (the GPU
# machine) and unpacked there with scripts/device-env.sh. Run here, once.
set -euo pipefail
cd "$(dirname "$0")/.."
# UCX (disagg/pd_xfer): libucx0 needs libnuma1; its InfiniBand / RDMA-CM
# transports (plugins UCX loads when present) need libibverbs1, librdmacm1,
# ibverbs-providers and libnl-3-200 / libnl-route-3-200.
PKGS=(libcjson1 libcjson-dev liburing2 liburing-dev libxxhash0 libxxhash-dev libmicrohttpd12 libmicrohttpd-dev libcurl4-openssl-dev pkgconf pkgconf-bin libpkgconf3
      libucx0 libucx-dev libnuma1 libibverbs1 librdmacm1 ibverbs-providers libnl-3-200 libnl-route-3-200)
mkdir -p .deps
cd .deps
missing=()
for p in "${PKGS[@]}"; do ls "${p}"_*.deb >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  apt-get download "${missing[@]}"
fi
ls -1 *.deb
