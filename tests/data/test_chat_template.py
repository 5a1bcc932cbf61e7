"""Chat templates and assistant masks, checked against transformers."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests._helpers import raises_naming
from tests._hf import BOS, CHAT_TEMPLATE, IM_END, PLAIN_CHAT_TEMPLATE
from tunelib.data import (
    HFTokenizer,
    TemplateError,
    completion_spans,
    encode_chat,
    encode_prompts,
    render_chat_template,
    tokens_in_spans,
)

CONVERSATIONS = [
    [{"role": "user", "content": "what is 12 + 7?"}, {"role": "assistant", "content": "19"}],
    [
        {"role": "system", "content": "answer in one word."},
        {"role": "user", "content": "hello, how are you?"},
        {"role": "assistant", "content": "fine, thank you!"},
        {"role": "user", "content": "and the fox?"},
        {"role": "assistant", "content": "the quick brown fox jumps over the lazy dog."},
    ],
    [{"role": "user", "content": "  spaces are trimmed  "}, {"role": "assistant", "content": None}],
]


@pytest.fixture(scope="module")
def tok(hf_tok):
    return hf_tok


@pytest.mark.parametrize(
    "template", [CHAT_TEMPLATE, PLAIN_CHAT_TEMPLATE], ids=["generation", "plain"]
)
@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_rendering_equals_apply_chat_template(
    transformers_tok, tok, template, index, add_generation_prompt
):
    messages = CONVERSATIONS[index]
    expected = transformers_tok.apply_chat_template(
        messages,
        chat_template=template,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )
    got = render_chat_template(
        template, messages, add_generation_prompt=add_generation_prompt, **tok.special_tokens
    )
    assert got == expected and got.startswith(BOS + "<|im_start|>")


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_ids_and_assistant_masks_equal_transformers(transformers_tok, tok, index):
    messages = CONVERSATIONS[index]
    expected = transformers_tok.apply_chat_template(
        messages, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, where = encode_chat(tok, messages)
    assert ids.tolist() == expected["input_ids"]
    assert where.astype(int).tolist() == expected["assistant_masks"]
    assert where.any()


def test_prompts_equal_apply_chat_template_with_generation_prompt(transformers_tok, tok):
    prompts = [CONVERSATIONS[1][:4], "plain text", CONVERSATIONS[0][:1]]
    tokens, where = encode_prompts(prompts, tok, max_length=128)
    for row, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            expected = transformers_tok(prompt, add_special_tokens=True)["input_ids"]
        else:
            expected = transformers_tok.apply_chat_template(prompt, add_generation_prompt=True)[
                "input_ids"
            ]
        assert tokens[row][where[row]].tolist() == expected
        assert where[row, -len(expected) :].all() and not where[row, : -len(expected)].any()
        assert (tokens[row][~where[row]] == tok.pad_id).all()


words = (
    st.text(alphabet="abcdefghij0123456789+?,. ", min_size=1, max_size=20)
    .map(str.strip)
    .filter(bool)
)


@st.composite
def conversations(draw):
    turns = draw(st.integers(1, 3))
    messages = [{"role": "system", "content": draw(words)}] if draw(st.booleans()) else []
    for _ in range(turns):
        messages += [
            {"role": "user", "content": draw(words)},
            {"role": "assistant", "content": draw(words)},
        ]
    return messages


@settings(max_examples=15)
@given(messages=conversations(), plain=st.booleans())
def test_masks_cover_exactly_the_assistant_turns(tok, messages, plain):
    """Masked tokens spell each assistant turn (content and end of turn), and nothing else."""
    template = PLAIN_CHAT_TEMPLATE if plain else CHAT_TEMPLATE
    text, spans = completion_spans(template, messages, **tok.special_tokens)
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    turn_end = IM_END + "\n\n" if plain else IM_END  # plain: up to the next turn's start
    assert [text[s:e] for s, e in spans] == [a + turn_end for a in answers]
    _, offsets = tok.encode_with_offsets(text)
    where = tokens_in_spans(offsets, spans)
    for (start, end), masked in zip(offsets, where, strict=True):
        inside = any(s <= start and end <= e for s, e in spans)
        assert masked == inside, (text[start:end], masked)
    masked_text = "".join(text[s:e] for (s, e), m in zip(offsets, where, strict=True) if m)
    assert masked_text == "".join(a + turn_end for a in answers)


def test_completion_spans_after_a_prompt(tok):
    prompt, completion = CONVERSATIONS[1][:4], CONVERSATIONS[1][4:]
    answer = completion[0]["content"]
    for template, expected_end in ((CHAT_TEMPLATE, IM_END), (PLAIN_CHAT_TEMPLATE, IM_END + "\n\n")):
        text, spans = completion_spans(
            template, prompt + completion, prompt_length=4, **tok.special_tokens
        )
        prefix = render_chat_template(
            template, prompt, add_generation_prompt=True, **tok.special_tokens
        )
        assert text.startswith(prefix) and len(spans) == 1 and spans[0][0] == len(prefix)
        assert text[slice(*spans[0])] == answer + expected_end  # generation block, or all after


def test_template_errors(tok):
    with raises_naming("unknown role tool", error=TemplateError):
        render_chat_template(
            CHAT_TEMPLATE, [{"role": "tool", "content": "x"}], **tok.special_tokens
        )
    with raises_naming("does not parse", error=TemplateError):
        render_chat_template("{% for m in messages %}", [])
    with raises_naming("failed", error=TemplateError):  # the sandbox blocks internals
        render_chat_template("{{ ''.__class__.__mro__[1].__subclasses__() }}", [])
    with raises_naming("failed", error=TemplateError):
        render_chat_template("{% set ns = namespace(_x=1) %}", [])
    counting = "{{ messages | length }}:{% for m in messages %}{{ m['content'] }};{% endfor %}"
    with raises_naming("incrementally", "message 1", "{% generation %}", error=TemplateError):
        completion_spans(counting, CONVERSATIONS[0])
    no_template = HFTokenizer(tok.tokenizer, eos_token=IM_END)
    with raises_naming("chat template", error=ValueError):
        encode_chat(no_template, CONVERSATIONS[0])
    assert render_chat_template("{{ x | tojson }}", [], x={"a": "<é>"}) == '{"a": "<é>"}'


def test_tokens_in_spans_counts_cut_tokens():
    offsets = [(0, 2), (2, 5), (5, 6), (6, 9)]
    np.testing.assert_array_equal(tokens_in_spans(offsets, [(3, 6)]), [False, True, True, False])
    np.testing.assert_array_equal(
        tokens_in_spans(offsets, [(0, 1), (9, 9)]), [True, False, False, False]
    )
