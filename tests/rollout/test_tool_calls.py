"""Tool calls: the Hermes / Qwen parser, the calculator, tool responses in a chat template and
the tool environment."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import raises_naming
from tests.rollout._chat import chat_tokenizer
from tunelib.data import HFTokenizer, TemplateError, render_chat_template
from tunelib.rollout import (
    CALCULATOR,
    Environment,
    Step,
    Tool,
    ToolCall,
    ToolEnvironment,
    Turn,
    calculator,
    parse_tool_calls,
    tool_response_tokens,
)

# JSON values nested a few levels deep: the arguments of a call.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
arguments = st.dictionaries(st.text(max_size=6), json_values, max_size=3)
calls = st.tuples(st.text(min_size=1, max_size=10), arguments)
# Text between calls, which never opens one.
prose = st.text(max_size=12).filter(lambda s: "<tool_call>" not in s)


def block(name, arguments, *, space="\n"):
    body = json.dumps({"name": name, "arguments": arguments})
    return f"<tool_call>{space}{body}{space}</tool_call>"


@given(st.lists(st.tuples(prose, calls), max_size=3), prose, st.sampled_from(["", "\n", " \n "]))
def test_parser_reads_back_every_call_in_order(pieces, tail, space):
    text = "".join(before + block(*call, space=space) for before, call in pieces) + tail
    expected = [ToolCall(name, arguments, None) for _, (name, arguments) in pieces]
    assert parse_tool_calls(text) == expected


def test_parser_reads_nested_json_and_tags_inside_strings():
    arguments = {"a": {"b": [1, {"c": "}"}]}, "note": "ends with </tool_call> here"}
    text = "Thinking.\n" + block("f", arguments) + " and " + block("g", {})
    assert parse_tool_calls(text) == [ToolCall("f", arguments, None), ToolCall("g", {}, None)]
    # OpenAI's layout: the arguments as a JSON string.
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": [1, 2]}"}</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("f", {"x": [1, 2]}, None)]
    assert parse_tool_calls("no call here </tool_call>") == []


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('<tool_call>{"name": "f", "arguments": {}}', "no closing </tool_call>"),
        ('<tool_call>{"name": "f", "argu', "no closing </tool_call>"),
        ('<tool_call>{"name": "f", "arguments": {}</tool_call>', "not valid JSON"),
        ("<tool_call>calculator(2)</tool_call>", "not valid JSON: Expecting value at character 0"),
        ('<tool_call>["f", {}]</tool_call>', "must be a JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'no "name" string'),
        ('<tool_call>{"name": "", "arguments": {}}</tool_call>', 'no "name" string'),
        ('<tool_call>{"name": "f"}</tool_call>', "the call of 'f' has no \"arguments\" object"),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', 'no "arguments" object'),
        ('<tool_call>{"name": "f", "arguments": "{oops"}</tool_call>', 'no "arguments" object'),
        ('<tool_call>{"name": "f", "arguments": {}} x</tool_call>', "text after its JSON: 'x'"),
    ],
)  # fmt: skip
def test_malformed_calls_say_why(text, reason):
    (call,) = parse_tool_calls(text)
    assert call.name is None and call.arguments is None and reason in call.error


def test_a_malformed_call_does_not_hide_the_next_one():
    text = '<tool_call>{"name": </tool_call> then ' + block("g", {"x": 1}) + "<tool_call>{"
    parsed = parse_tool_calls(text)
    assert [c.name for c in parsed] == [None, "g", None]
    assert "not valid JSON" in parsed[0].error and "no closing" in parsed[2].error


@given(
    st.recursive(
        st.integers(0, 10**4) | st.floats(0.01, 100, allow_nan=False).map(lambda x: round(x, 2)),
        lambda inner: (
            st.tuples(inner, st.sampled_from("+-*/"), inner).map(
                lambda t: f"({t[0]} {t[1]} {t[2]})"
            )
            | inner.map(lambda x: f"-{x}")
        ),
        max_leaves=6,
    )
)
def test_calculator_agrees_with_python_arithmetic(expression):
    expression = str(expression)
    try:
        expected = eval(expression, {"__builtins__": {}})  # the oracle, on generated arithmetic
    except ZeroDivisionError:
        with pytest.raises(ZeroDivisionError):
            calculator(expression)
        return
    assert calculator(expression) == expected
    assert type(calculator(expression)) is type(expected)


@pytest.mark.parametrize(
    ("expression", "names"),
    [
        ("__import__('os').system('true')", ("Call",)),
        ("x + 1", ("Name",)),
        ("2 ** 10", ("Pow",)),
        ("7 // 2", ("FloorDiv",)),
        ("7 % 2", ("Mod",)),
        ("True + 1", ("Constant",)),
        ("1j * 2", ("Constant",)),
        ("'a' * 3", ("Constant",)),
        ("(1).real", ("Attribute",)),
        ("[1, 2]", ("List",)),
        ("not 1", ("Not",)),
        ("1 +", ("does not parse",)),
        ("1e308 * 10", ("not finite",)),
        ("1" * 1001, ("longer than 1000",)),
    ],
)
def test_calculator_refuses_everything_else(expression, names):
    with raises_naming(*names, error=ValueError):
        calculator(expression)


def test_calculator_values():
    assert calculator(" 2 * (3 + 4) - 5 / 2 ") == 11.5
    assert calculator("-(12 - 4) * +3") == -24 and type(calculator("6 * 7")) is int
    assert calculator("123456789123456789 * 10") == 1234567891234567890  # exact integers
    with pytest.raises(ZeroDivisionError):
        calculator("1 / (2 - 2)")
    assert CALCULATOR.function is calculator
    schema = CALCULATOR.schema()
    assert schema["type"] == "function" and schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]


def render(messages, **kwargs):
    tok = chat_tokenizer()
    return render_chat_template(tok.chat_template, messages, **kwargs, **tok.special_tokens)


def test_tool_responses_are_what_the_template_writes_after_the_turn():
    tok = chat_tokenizer()
    answers = [{"role": "tool", "name": "calculator", "content": "14"},
               {"role": "tool", "name": "calculator", "content": "-1.5"}]  # fmt: skip
    expected = (
        "\n<|im_start|>user\n<tool_response>\n14\n</tool_response>\n<tool_response>\n-1.5\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert tool_response_tokens(tok, answers, after="<|im_end|>") == tok.encode(expected)
    # A turn that ended at its closing tag: the template's end of turn comes first.
    assert tool_response_tokens(tok, answers) == tok.encode("<|im_end|>" + expected)
    # Checked against the conversation the template renders, by ids.
    head = [{"role": "user", "content": "2?"}, {"role": "assistant", "content": "ab"}]
    whole = tok.encode(render([*head, *answers], add_generation_prompt=True))
    before = tok.encode(render([*head]))
    cut = before.index(tok.eos_id, len(before) - 2) + 1  # after the turn's <|im_end|>
    assert whole[:cut] == before[:cut] and whole[cut:] == tool_response_tokens(
        tok, answers, after="<|im_end|>"
    )


def test_tool_responses_need_a_template_that_writes_content():
    tok = chat_tokenizer()
    silent = HFTokenizer(tok.tokenizer, eos_token="<|im_end|>", chat_template="{{ 'x' }}")
    with raises_naming("content", error=TemplateError):
        tool_response_tokens(silent, [{"role": "tool", "content": "1"}])
    bare = HFTokenizer(tok.tokenizer, eos_token="<|im_end|>")
    with raises_naming("chat template"):
        tool_response_tokens(bare, [{"role": "tool", "content": "1"}])
    with raises_naming("chat template"):
        ToolEnvironment(bare, [CALCULATOR])


def turn_of(text, *, end="<|im_end|>"):
    tok = chat_tokenizer()
    ids = tuple(tok.encode(text + end))
    return Turn(ids, None, truncated=not end)


def test_tool_environment_runs_calls_and_scores_the_answer():
    tok = chat_tokenizer()
    env = ToolEnvironment(tok, [CALCULATOR], reward_fn=lambda text: float(text.strip() == "14"))
    assert isinstance(env, Environment)
    env.reset((1, 2, 3))
    call = block("calculator", {"expression": "2 * (3 + 4)"})
    step = env.step(turn_of("Let me compute." + call))
    assert isinstance(step, Step) and step.reward == 0.0 and not step.done
    assert tok.decode(step.observation, stop_at_eos=False) == (
        "\nuser\n<tool_response>\n14\n</tool_response>\nassistant\n"
    )
    assert env.step(turn_of("14")) == Step((), 1.0, True)
    assert env.step(turn_of("15")) == Step((), 0.0, True)
    assert [m["role"] for m in env.messages] == ["assistant", "tool", "assistant", "assistant"]
    assert env.messages[1] == {"role": "tool", "name": "calculator", "content": "14"}
    env.reset(())
    assert env.messages == []


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (block("calculator", {"expression": "1 / 0"}), "ZeroDivisionError: division by zero"),
        (block("calculator", {"expression": "2 ** 8"}), "ValueError: only numbers"),
        (block("calculator", {"expr": "1"}), "TypeError"),
        (block("search", {"q": "x"}), "unknown tool 'search'; the tools are ['calculator']"),
        ('<tool_call>{"name": calculator}</tool_call>', "the tool call is not valid JSON"),
        ('<tool_call>{"name": "calculator", "arguments": {}}', "no closing </tool_call> tag"),
    ],
)
def test_failed_and_malformed_calls_become_error_observations(call, error):
    tok = chat_tokenizer()
    env = ToolEnvironment(tok, [CALCULATOR])
    env.reset(())
    step = env.step(turn_of(call))
    assert not step.done and step.reward == 0.0
    content = env.messages[-1]["content"]
    assert error in json.loads(content)["error"]
    assert tok.encode(content)[:3] == tok.encode('{"e')
    assert set(tok.encode(content)) <= set(step.observation)  # the error reaches the model


def test_ignored_malformed_calls_leave_a_final_answer():
    tok = chat_tokenizer()
    env = ToolEnvironment(tok, [CALCULATOR], reward_fn=len, malformed="ignore")
    env.reset(())
    text = '<tool_call>{"name": </tool_call>'
    assert env.step(turn_of(text)) == Step((), float(len(tok.decode(tok.encode(text)))), True)
    with raises_naming("malformed", "'skip'"):
        ToolEnvironment(tok, [CALCULATOR], malformed="skip")


@pytest.mark.parametrize("end", ["<|im_end|>", ""])
def test_an_episode_renders_back_to_its_ids(end):
    """Prompt, turns and observations, concatenated, are the ids of the conversation that the
    environment records, rendered by the template: whether a turn ends with the stop token or
    at its closing tag (the observation then carries the template's end of turn)."""
    tok = chat_tokenizer()
    prompt = [{"role": "user", "content": "What is 2 * (3 + 4)?"}]
    tools = [CALCULATOR.schema()]
    ids = tok.encode(render(prompt, tools=tools, add_generation_prompt=True))
    env = ToolEnvironment(tok, [CALCULATOR, Tool("half", "x / 2", {}, lambda x: x / 2)])
    env.reset(tuple(ids))
    turns = [
        "I will use the tools. " + block("calculator", {"expression": "2 * (3 + 4)"}),
        block("half", {"x": 14}) + "\n" + block("calculator", {"expression": "oops"}),
        "The answer is 14.",
    ]
    for i, text in enumerate(turns):
        turn = turn_of(text, end="<|im_end|>" if i == len(turns) - 1 else end)
        step = env.step(turn)
        ids += list(turn.tokens) + list(step.observation)
    assert step.done
    rendered = tok.encode(render(prompt + env.messages, tools=tools))
    assert rendered[: len(ids)] == ids
    assert tok.decode(rendered[len(ids) :], stop_at_eos=False) == "\n"  # after the last stop
    roles = [m["role"] for m in env.messages]
    assert roles == ["assistant", "tool", "assistant", "tool", "tool", "assistant"]
    assert env.messages[3]["content"] == "7.0"
    assert "ValueError" in json.loads(env.messages[4]["content"])["error"]
