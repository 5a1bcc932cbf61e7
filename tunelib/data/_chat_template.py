"""Jinja chat templates rendered as `transformers` renders them, and assistant-token masks."""

import contextvars
import functools
import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import numpy as np
from jaxtyping import Bool, Int

from tunelib.data._tokenizers import HFTokenizer

Message = Mapping[str, Any]
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_RECORDING: contextvars.ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = (
    contextvars.ContextVar("generation_spans", default=None)
)


class TemplateError(ValueError):
    """A chat template failed to render (its own `raise_exception`, or a Jinja error)."""


class _GenerationSpans(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body and records where it lands.

    While `_RECORDING` holds `(rendered, spans)` (set by `_render`), each block appends the
    character range of its output to `spans`; the output so far is the joined `rendered` chunks.
    """

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_record", [])
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _record(self, caller: Any) -> str:
        text = caller()
        recording = _RECORDING.get()
        if recording is not None:
            rendered, spans = recording
            start = sum(map(len, rendered))
            spans.append((start, start + len(text)))
        return text


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own `tojson` escapes HTML characters; templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's `namespace` without underscore-prefixed attributes (no reach into internals)."""

    def __init__(*args: Any, **kwargs: Any):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed.")


@functools.lru_cache(maxsize=16)
def _compiled(template: str) -> jinja2.Template:
    """`template` compiled in a sandbox with the settings and globals `transformers` uses."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationSpans, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        dict=dict,
        namespace=_Namespace,
    )
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as error:
        raise TemplateError(f"the chat template does not parse: {error}") from None


def _render(
    template: str,
    messages: Sequence[Message],
    add_generation_prompt: bool,
    variables: Mapping[str, Any],
    spans: list[tuple[int, int]] | None = None,
) -> str:
    compiled = _compiled(template)
    # As in `transformers`: a message key whose value is None is dropped.
    chat = [{k: x for k, x in m.items() if x is not None} for m in messages]
    context = {
        "messages": chat,
        "tools": None,
        "documents": None,
        "add_generation_prompt": add_generation_prompt,
        **variables,
    }
    rendered: list[str] = []
    token = _RECORDING.set(None if spans is None else (rendered, spans))
    try:
        for chunk in compiled.generate(**context):
            rendered.append(chunk)
    except TemplateError:
        raise
    except jinja2.TemplateError as error:
        raise TemplateError(f"the chat template failed: {error}") from None
    finally:
        _RECORDING.reset(token)
    return "".join(rendered)


def render_chat_template(
    template: str,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = False,
    **variables: Any,
) -> str:
    """Render a conversation with a Jinja chat template, exactly as `transformers` does.

    The template runs in Jinja's immutable sandbox with `trim_blocks` and `lstrip_blocks`,
    the `loopcontrols` extension and `{% generation %}` blocks; it sees `messages`, `tools`
    and `documents` (None), `add_generation_prompt`, the `variables` (a tokenizer's
    `bos_token`, `eos_token`, ... as `HFTokenizer.special_tokens` gives them), and the
    globals `raise_exception`, `strftime_now`, `dict` and `namespace`; `tojson` writes
    plain JSON. As in `transformers`, message keys whose value is None are dropped first.

    Args:
      template: the Jinja source.
      messages: the conversation, dicts with "role" and "content" (and whatever else the
        template reads).
      add_generation_prompt: end with the header of an assistant turn, for sampling.
      **variables: further template variables.

    Returns:
      The rendered text.

    Raises:
      TemplateError: (a `ValueError`) when the template does not parse, calls
        `raise_exception`, or fails.

    Examples:
      >>> from tunelib.data import render_chat_template
      >>> template = (
      ...     "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
      ...     "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
      ... )
      >>> messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
      >>> render_chat_template(template, messages, bos_token="<s>", eos_token="</s>")
      '<s><|user|>2+2?</s><|assistant|>4</s>'
      >>> render_chat_template(template, messages[:1], add_generation_prompt=True,
      ...                      bos_token="<s>", eos_token="</s>")
      '<s><|user|>2+2?</s><|assistant|>'
    """
    if not isinstance(template, str):
        raise TypeError(f"template must be a str, got {type(template).__name__}.")
    return _render(template, messages, add_generation_prompt, variables)


def completion_spans(
    template: str,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = False,
    prompt_length: int | None = None,
    **variables: Any,
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans a model should learn to produce.

    With `prompt_length=None` the spans are the assistant turns. A template with
    `{% generation %}` blocks marks them itself (the spans are the blocks' output, exactly
    what `transformers`' `return_assistant_tokens_mask` uses). Without such blocks, the span
    of assistant message $i$ runs from the end of the conversation before it rendered with
    the generation prompt to the end of the conversation up to it, so it holds the turn's
    content and its end-of-turn markup. That needs a template that renders conversations
    incrementally (each shorter conversation a prefix of the longer ones), which is checked.

    With `prompt_length=p`, the first `p` messages are the prompt and the rest the
    completion: the spans are the `{% generation %}` blocks after the prompt rendered with
    the generation prompt, or, without such blocks, the single span from there to the end
    (everything the completion adds, as for TRL's conversational prompt-completion records).

    Args:
      template: the Jinja source.
      messages: the conversation.
      add_generation_prompt: passed to the template for the full conversation.
      prompt_length: None, or the number of leading prompt messages.
      **variables: template variables (special tokens).

    Returns:
      `(text, spans)`: the rendered conversation and sorted `(start, end)` character ranges.

    Raises:
      TemplateError: when the template fails, or does not render the conversation
        incrementally where the spans need it to.
    """
    if _GENERATION.search(template):
        spans: list[tuple[int, int]] = []
        text = _render(template, messages, add_generation_prompt, variables, spans)
        if prompt_length is None:
            return text, spans
        start = _span(template, messages, prompt_length, len(messages), text, False, variables)[0]
        return text, [(s, e) for s, e in spans if s >= start]
    text = _render(template, messages, add_generation_prompt, variables)
    if prompt_length is not None:
        starts, ends = [prompt_length], [len(messages)]
    else:
        starts = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        ends = [i + 1 for i in starts]
    spans = [
        _span(template, messages, start, end, text, add_generation_prompt, variables)
        for start, end in zip(starts, ends, strict=True)
    ]
    return text, spans


def _span(
    template: str,
    messages: Sequence[Message],
    start: int,
    end: int,
    text: str,
    add_generation_prompt: bool,
    variables: Mapping[str, Any],
) -> tuple[int, int]:
    """Where messages `start:end` land in `text`, from renderings of the shorter conversations."""
    before = _render(template, messages[:start], True, variables)
    final = end == len(messages) and not add_generation_prompt
    upto = text if final else _render(template, messages[:end], False, variables)
    if not (upto.startswith(before) and text.startswith(upto)):
        raise TemplateError(
            f"the chat template does not render the conversation incrementally at message "
            f"{start} (the conversation before it, with the generation prompt, is not a prefix "
            "of the conversation up to it); mark the assistant turns with {% generation %} "
            "blocks."
        )
    return len(before), len(upto)


def tokens_in_spans(
    offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
) -> Bool[np.ndarray, " N"]:
    """True for each token whose `(start, end)` characters overlap one of `spans`.

    This is `transformers`' rule for assistant masks: a token cut by a span boundary counts.
    """
    tokens = np.asarray(offsets, np.int64).reshape(-1, 2)
    ranges = np.asarray(spans, np.int64).reshape(-1, 2)
    overlap = (tokens[:, :1] < ranges[None, :, 1]) & (tokens[:, 1:] > ranges[None, :, 0])
    return overlap.any(axis=1)


def encode_chat(
    tokenizer: HFTokenizer,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = False,
    prompt_length: int | None = None,
) -> tuple[Int[np.ndarray, " N"], Bool[np.ndarray, " N"]]:
    """Token ids of a conversation in the tokenizer's chat template, and its completion mask.

    The text is `render_chat_template(tokenizer.chat_template, messages, ...)` with the
    tokenizer's special tokens, encoded without adding special tokens (the template writes
    them), as `transformers`' `apply_chat_template(tokenize=True)` does. The mask is True on
    the tokens that overlap `completion_spans`: the assistant turns (only them), or with
    `prompt_length` everything after the first `prompt_length` messages.

    Args:
      tokenizer: an `HFTokenizer` with a chat template.
      messages: the conversation.
      add_generation_prompt: end with the header of an assistant turn (for a prompt to
        sample from; the mask is then all False).
      prompt_length: None, or how many leading messages are the prompt.

    Returns:
      `(ids, where)`: `[N]` int32 token ids and the `[N]` bool completion mask.

    Raises:
      ValueError: if the tokenizer has no chat template; `TemplateError` as
        `completion_spans`.

    Examples:
      >>> import tokenizers
      >>> from tokenizers import models, pre_tokenizers
      >>> from tunelib.data import HFTokenizer, encode_chat
      >>> vocab = {"<unk>": 0, "</s>": 1, "U:": 2, "A:": 3, **{c: 4 + i for i, c in
      ...          enumerate("0123456789+?")}}
      >>> inner = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
      >>> inner.pre_tokenizer = pre_tokenizers.Split("", "isolated")
      >>> _ = inner.add_special_tokens(["</s>", "U:", "A:"])
      >>> template = ("{% for m in messages %}{{ 'U:' if m['role'] == 'user' else 'A:' }}"
      ...             "{{ m['content'] }}{{ eos_token }}{% endfor %}")
      >>> tok = HFTokenizer(inner, eos_token="</s>", chat_template=template)
      >>> ids, where = encode_chat(tok, [{"role": "user", "content": "2+2?"},
      ...                                {"role": "assistant", "content": "4"}])
      >>> print(ids, where.astype(int))
      [ 2  6 14  6 15  1  3  8  1] [0 0 0 0 0 0 1 1 1]
    """
    if tokenizer.chat_template is None:
        raise ValueError("the tokenizer has no chat template (chat_template is None).")
    text, spans = completion_spans(
        tokenizer.chat_template,
        messages,
        add_generation_prompt=add_generation_prompt,
        prompt_length=prompt_length,
        **tokenizer.special_tokens,
    )
    ids, offsets = tokenizer.encode_with_offsets(text)
    return np.asarray(ids, np.int32), tokens_in_spans(offsets, spans)
