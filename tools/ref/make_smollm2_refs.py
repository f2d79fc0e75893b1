#!/usr/bin/env python3
"""Reference outputs of HF transformers for the default model, loaded from the
same GGUF file strata reads (SmolLM2-135M-Instruct.Q4_1.gguf, transformers
dequantizes it to float32 on load).

    python3 tools/ref/make_smollm2_refs.py GGUF_PATH OUT_DIR

Writes OUT_DIR/smollm2_refs.json:
  prompt_ids      64 token ids of a fixed English text (HF tokenizer, no BOS)
  logits_pos      positions whose full logits row is stored
  logits          {pos: [vocab floats]} float32 logits at those positions
  argmax          argmax of the logits at every one of the 64 positions
  greedy          {name: {"prompt_ids": [...], "tokens": [32 greedy ids], "text": ...}}
and OUT_DIR/smollm2_logits.f32: float32 [len(logits_pos), vocab].
"""
import json
import os
import sys

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined movable metal type, oil-based inks and a wooden press adapted from "
        "those used to make wine. Within fifty years presses were working in more than two "
        "hundred cities across Europe, and the price of books fell so far that reading spread "
        "from monasteries and courts to merchants, artisans and students.")
POSITIONS = [0, 1, 15, 31, 47, 63]


def main():
    path, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    d, f = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    kw = {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": torch.float32}
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, attn_implementation="eager", **kw).eval()
    ids = tok(TEXT, add_special_tokens=False)["input_ids"][:64]
    assert len(ids) == 64, len(ids)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float().numpy()
    res = dict(transformers=transformers.__version__, torch=torch.__version__, gguf=f,
               prompt_ids=ids, logits_pos=POSITIONS, argmax=logits.argmax(1).tolist(), greedy={})
    np.ascontiguousarray(logits[POSITIONS], dtype="<f4").tofile(os.path.join(out, "smollm2_logits.f32"))
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   tokenize=False, add_generation_prompt=True)
    for name, text, special in (("raw", "Once upon a time, in a small village", False),
                                ("chat", chat, False)):
        p = tok(text, add_special_tokens=special)["input_ids"]
        with torch.no_grad():
            g = model.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, repetition_penalty=1.0,
                               attention_mask=torch.ones(1, len(p), dtype=torch.long))
        new = g[0, len(p):].tolist()
        res["greedy"][name] = dict(text_in=text, prompt_ids=p, tokens=new,
                                   text=tok.decode(new, skip_special_tokens=False))
        print(name, repr(res["greedy"][name]["text"]), flush=True)
    with open(os.path.join(out, "smollm2_refs.json"), "w") as fp:
        json.dump(res, fp, indent=1)


if __name__ == "__main__":
    main()
