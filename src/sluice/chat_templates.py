"""Chat templates for model files that ship without one.

A GGUF converted from a base (pretrained) checkpoint often carries no
`tokenizer.chat_template`; llama.cpp then falls back to the template its architecture is
known to use. We do the same, by the GGUF's `general.architecture`, with the template of
that family's instruction-tuned checkpoints (a base model may follow it less well, but a
chat request is rendered the way the family's tools expect rather than refused).
"""
from __future__ import annotations

# Gemma 2 and 3 (google/gemma-3-*-it's tokenizer_config.json, text parts): a system
# message is folded into the first user turn; the assistant's role is "model".
GEMMA = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

BY_ARCHITECTURE = {"gemma2": GEMMA, "gemma3": GEMMA}

# Tokens that end a turn in some family's chat format (llama.cpp's end-of-generation list).
# One of them stops a generation, beside the tokenizer's EOS, where the model's chat
# template writes it: Gemma's checkpoints name <eos> as EOS, but a reply ends with <end_of_turn>.
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|end|>", "<|endoftext|>", "<EOT>",
                      "<|end_of_text|>", "<｜end▁of▁sentence｜>")


def builtin_template(architecture: str | None) -> str | None:
    return BY_ARCHITECTURE.get(architecture or "")
