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
# UCX with CUDA support (P-D GPU to GPU, --pd-landing-mem): Debian's UCX moves host memory
# only, so the libraries of PyPI's libucx-cu12 wheel travel too (runtime only: strata builds
# against Debian's headers; the wheel's UCX is ABI-compatible), packed as
# .deps/ucx-cu12.tar.xz (~4 MB): UCP/UCT/UCS/UCM, the CUDA and CMA transports, the CUDA
# runtime they load, and ucx_info. scripts/device-env.sh unpacks it and exports
# STRATA_UCX_CUDA_LIB (prepend it to LD_LIBRARY_PATH to use it).
if [ ! -f ucx-cu12.tar.xz ]; then
  t=$(mktemp -d)
  python3 -m pip download -q --no-deps "libucx-cu12==${LIBUCX_CU12_VERSION:-1.22.0}" -d "$t"
  (cd "$t" && python3 -m zipfile -e libucx_cu12-*.whl x)
  d="$t/ucx-cu12"
  mkdir -p "$d/libucx/lib/ucx" "$d/libucx_cu12.libs"
  for f in libucp libuct libucs libucm; do cp "$t/x/libucx/lib/$f.so.0" "$d/libucx/lib/"; done
  for f in libucm_cuda libuct_cuda libuct_cma; do
    cp "$t/x/libucx/lib/ucx/$f.so.0" "$d/libucx/lib/ucx/"
    ln -s "$f.so.0" "$d/libucx/lib/ucx/$f.so"
  done
  cp "$t"/x/libucx_cu12.libs/libcudart-*.so* "$d/libucx_cu12.libs/"
  cp "$t/x/libucx/bin/ucx_info" "$d/"
  chmod +x "$d/ucx_info"
  tar cJf ucx-cu12.tar.xz -C "$t" ucx-cu12
  rm -rf "$t"
fi
ls -la ucx-cu12.tar.xz
