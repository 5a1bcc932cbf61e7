"""A tiny Qwen-style chat tokenizer for the episode and tool-call tests.

One token per character, plus the chat and tool tags as whole tokens. The characters `<`, `>`
and `|` have no token of their own (they are read as `<unk>`), so every sequence of ids a model
samples is the tokenizer's own encoding of its text: decoding and encoding again gives back
the same ids, which is what the round trips through the chat template check.
"""

import functools
import string

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from tunelib.data import HFTokenizer

SPECIAL = ("<pad>", "<unk>", "<|im_start|>", "<|im_end|>")
TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
CHARACTERS = "\n" + "".join(c for c in string.printable[:95] if c not in "<>|\t\n\r\x0b\x0c")

# Qwen2.5's layout: tools in the system turn, tool messages inside a user turn, each in a
# <tool_response> block.
TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@functools.cache
def chat_tokenizer() -> HFTokenizer:
    vocab = {token: i for i, token in enumerate((*SPECIAL, *TAGS, *CHARACTERS))}
    inner = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    inner.decoder = decoders.Fuse()
    inner.add_special_tokens(list(SPECIAL))
    inner.add_tokens(list(TAGS))
    return HFTokenizer(
        inner, eos_token="<|im_end|>", pad_token="<pad>", unk_token="<unk>", chat_template=TEMPLATE
    )
