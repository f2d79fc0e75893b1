#!/usr/bin/env python3
"""Builds small random-initialised Llama models with HF transformers and writes
reference logits that strata's tests compare against.

Run where torch and transformers exist (the GPU machine has both):
    python3 tools/ref/make_refs.py OUT_DIR
then copy OUT_DIR/models and OUT_DIR/refs under tests/data/.

For each model NAME:
  models/NAME/            save_pretrained() output (config.json, model.safetensors
                          or sharded model-0000x-of-0000y.safetensors + index)
  refs/NAME.tokens        the token ids, space-separated, one line
  refs/NAME.logits.f32    float32 little-endian [n_tokens, vocab], no header:
                          HF logits computed in float32 from the saved weights
                          (bf16 weights are upcast exactly, so this is the math
                          without activation rounding)
  refs/NAME.hfbf16.logits.f32  (bf16 models only) HF's logits when it runs in
                          bfloat16 as a user would, for the looser comparison
  refs/manifest.json      per model: dtype, tokens file, tolerances, versions
Everything is seeded, so re-running gives the same files.
"""
import json
import os
import shutil
import sys

import numpy as np
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

V5 = int(transformers.__version__.split(".")[0]) >= 5

MODELS = [
    # name, dtype, config overrides, extra
    dict(name="gqa_f32", dtype="float32",
         cfg=dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)),
    dict(name="mha_tied_f32", dtype="float32",
         cfg=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)),
    dict(name="headdim_f32", dtype="float32",
         cfg=dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  tie_word_embeddings=False)),
    dict(name="llama3_f32", dtype="float32", rope="llama3",
         cfg=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                  rope_theta=500000.0, max_position_embeddings=512)),
    # bf16 + llama3 scaling, config rewritten to the transformers v4 `rope_scaling` form
    dict(name="llama3_bf16", dtype="bfloat16", rope="llama3", v4_config=True,
         cfg=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                  rope_theta=500000.0, max_position_embeddings=512)),
    dict(name="gqa_tied_bf16", dtype="bfloat16",
         cfg=dict(vocab_size=256, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True)),
    # sharded checkpoint (model.safetensors.index.json)
    dict(name="gqa_sharded_f32", dtype="float32", shard="60KB",
         cfg=dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)),
]

# --big: a Llama-3-8B-shaped model with 4 layers (bf16, ~3.9 GB), for the GPU
# machine only (never committed).
BIG = [dict(name="llama3_8b_4layers_bf16", dtype="bfloat16", rope="llama3", init_std=0.02,
            cfg=dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
                     rope_theta=500000.0, max_position_embeddings=8192))]
BIG_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192)

LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)
N_TOKENS = 40
INIT_STD = 0.15   # default 0.02 gives nearly flat logits on models this small


def build(spec, seed):
    cfg = dict(spec["cfg"])
    cfg.update(rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=[2, 3],
               initializer_range=spec.get("init_std", INIT_STD))
    cfg.setdefault("rope_theta", 10000.0)
    cfg.setdefault("max_position_embeddings", 256)
    if spec.get("rope") == "llama3":
        rope = BIG_ROPE if spec in BIG else LLAMA3_ROPE
        if V5:
            cfg["rope_parameters"] = dict(rope, rope_theta=cfg["rope_theta"])
        else:
            cfg["rope_scaling"] = dict(rope)
    elif V5:
        cfg["rope_parameters"] = dict(rope_type="default", rope_theta=cfg["rope_theta"])
    config = LlamaConfig(**cfg)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    if spec in BIG and torch.cuda.is_available():
        with torch.device("cuda"):
            model = LlamaForCausalLM(config).eval()
        model = model.to(getattr(torch, spec["dtype"])).cpu()
    else:
        model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # make norm weights matter
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model


def to_v4_config(path):
    with open(path) as f:
        c = json.load(f)
    rp = c.pop("rope_parameters", None)
    if rp is not None:
        c["rope_theta"] = rp.pop("rope_theta", c.get("rope_theta", 10000.0))
        c["rope_scaling"] = rp if rp.get("rope_type", "default") != "default" else None
    with open(path, "w") as f:
        json.dump(c, f, indent=2)


def logits_of(model_dir, dtype, tokens):
    kw = {"dtype" if V5 else "torch_dtype": dtype}
    m = LlamaForCausalLM.from_pretrained(model_dir, attn_implementation="eager", **kw).eval()
    dev = "cuda" if BIG_RUN and torch.cuda.is_available() else "cpu"
    m = m.to(dev)
    with torch.no_grad():
        out = m(torch.tensor([tokens], device=dev)).logits[0].float().cpu().numpy()
    return np.ascontiguousarray(out, dtype="<f4")


BIG_RUN = False


def main():
    global BIG_RUN, MODELS
    args = [a for a in sys.argv[1:] if a != "--big"]
    if "--big" in sys.argv:
        BIG_RUN, MODELS = True, BIG
    out = args[0] if args else "refs_out"
    os.makedirs(os.path.join(out, "models"), exist_ok=True)
    os.makedirs(os.path.join(out, "refs"), exist_ok=True)
    manifest = dict(transformers=transformers.__version__, torch=torch.__version__, models={})
    for i, spec in enumerate(MODELS):
        name = spec["name"]
        mdir = os.path.join(out, "models", name)
        shutil.rmtree(mdir, ignore_errors=True)
        model = build(spec, seed=1234 + i)
        tdtype = getattr(torch, spec["dtype"])
        model = model.to(tdtype)
        kw = dict(safe_serialization=True)
        if "shard" in spec:
            kw["max_shard_size"] = spec["shard"]
        model.save_pretrained(mdir, **kw)
        for extra in ("generation_config.json",):
            p = os.path.join(mdir, extra)
            if os.path.exists(p):
                os.remove(p)
        if spec.get("v4_config"):
            to_v4_config(os.path.join(mdir, "config.json"))
        rng = np.random.default_rng(99 + i)
        vocab = spec["cfg"]["vocab_size"]
        tokens = [1] + rng.integers(0, vocab, N_TOKENS - 1).tolist()
        ref = logits_of(mdir, torch.float32, tokens)
        base = os.path.join(out, "refs", name)
        with open(base + ".tokens", "w") as f:
            f.write(" ".join(map(str, tokens)) + "\n")
        ref.tofile(base + ".logits.f32")
        entry = dict(dtype=spec["dtype"], n_tokens=len(tokens), vocab=vocab,
                     logits_std=float(ref.std()),
                     top1_margin_min=float(np.min(np.sort(ref, axis=1)[:, -1] - np.sort(ref, axis=1)[:, -2])))
        if spec["dtype"] == "bfloat16":
            lb = logits_of(mdir, torch.bfloat16, tokens)
            lb.tofile(base + ".hfbf16.logits.f32")
            entry["hf_bf16_vs_f32_rel"] = float(np.abs(lb - ref).max() / np.abs(ref).max())
        manifest["models"][name] = entry
        print(name, entry, flush=True)
    with open(os.path.join(out, "refs", "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)


if __name__ == "__main__":
    main()
