#!/usr/bin/env bash
# Installs what building and testing strata needs, only when it is missing:
# Debian packages with apt-get, Python packages with pip. Safe to run twice.
set -euo pipefail

DEB_PKGS=(cmake gcc make pkg-config libcjson-dev libxxhash-dev liburing-dev libmicrohttpd-dev libcurl4-openssl-dev libucx-dev clang libclang-rt-14-dev)
PY_PKGS=(numpy gguf openai)

missing=()
for p in "${DEB_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: apt-get install ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
pymissing=()
for p in "${PY_PKGS[@]}"; do
  $PY -c "import $p" 2>/dev/null || pymissing+=("$p")
done
if [ ${#pymissing[@]} -gt 0 ]; then
  echo "install-deps: pip install ${pymissing[*]}"
  $PY -m pip install -q "${pymissing[@]}"
fi
