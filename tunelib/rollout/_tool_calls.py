"""Tool calls in the Hermes / Qwen format: the parser, tool responses rendered by a chat template,
a safe calculator, and a ready tool environment."""

import ast
import json
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

from tunelib.data import HFTokenizer, TemplateError, render_chat_template
from tunelib.rollout._environments import Step, Turn

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
Malformed = Literal["report", "ignore"]
# A stand-in for an assistant turn's content, to find where it lands in a rendered template.
_CONTENT_MARK = "\u2063tunelib-assistant-content\u2063"
_UNCLOSED = f"the tool call has no closing {TOOL_CALL_CLOSE} tag"


class ToolCall(NamedTuple):
    """One `<tool_call>...</tool_call>` block of a model's turn.

    Attributes:
      name: the tool's name, or None when the call is malformed.
      arguments: the call's arguments (a dict), or None when the call is malformed.
      error: None for a well-formed call; otherwise why it is malformed, in words that an
        observation can pass back to the model.
    """

    name: str | None
    arguments: dict[str, Any] | None
    error: str | None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls of a model's turn, in the Hermes / Qwen format, malformed ones included.

    Each call is a JSON object between `<tool_call>` and `</tool_call>` (whitespace around
    it allowed), `{"name": "<tool>", "arguments": {...}}`, as Qwen2.5 / Qwen3 chat templates
    teach it; `arguments` may also be a JSON string holding that object (as the OpenAI format
    writes it). The JSON is read by a JSON decoder, not a pattern, so nested objects and a
    `</tool_call>` inside a string are read right. Text outside the blocks is ignored.

    A block that is not a well-formed call gives a `ToolCall` with `error` set and no name:
    invalid JSON, JSON that is not an object with a string `name` and an object `arguments`,
    text between the object and the closing tag, or no closing tag before the end of the
    turn. The parsers of Tunix (`QwenToolParser`, which skips such a call) and TRL
    (`parse_response`, which then reads the whole turn as plain text, without calls) drop
    them silently; `ToolEnvironment` reports them to the model instead (its `malformed`
    option).

    Args:
      text: a model's turn, decoded.

    Returns:
      The calls in order of appearance.

    Examples:
      >>> from tunelib.rollout import parse_tool_calls
      >>> text = ('Let me compute. <tool_call>{"name": "calculator", "arguments": '
      ...         '{"expression": "2 * (3 + 4)"}}</tool_call>')
      >>> parse_tool_calls(text)
      [ToolCall(name='calculator', arguments={'expression': '2 * (3 + 4)'}, error=None)]
      >>> print(parse_tool_calls('<tool_call>{"name": "calculator"</tool_call>')[0].error)
      the tool call is not valid JSON: Expecting ',' delimiter at character 21
      >>> print(parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}')[0].error)
      the tool call has no closing </tool_call> tag

    References:
      Qwen Team, "Qwen2.5 Technical Report" (function calling in the Hermes format), 2024,
      https://arxiv.org/abs/2412.15115.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}.")
    decoder = json.JSONDecoder()
    calls = []
    position = text.find(TOOL_CALL_OPEN)
    while position >= 0:
        start = _skip_space(text, position + len(TOOL_CALL_OPEN))
        close = text.find(TOOL_CALL_CLOSE, start)
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError as error:
            reason = (
                f"the tool call is not valid JSON: {error.msg} at character {error.pos - start}"
            )
            calls.append(ToolCall(None, None, _UNCLOSED if close < 0 else reason))
        else:
            end = _skip_space(text, end)
            if text.startswith(TOOL_CALL_CLOSE, end):
                close = end
                calls.append(_call(value))
            elif close < 0:
                calls.append(ToolCall(None, None, _UNCLOSED))
            else:
                after = text[end:close][:40]
                calls.append(
                    ToolCall(None, None, f"the tool call has text after its JSON: {after!r}")
                )
        if close < 0:
            break
        position = text.find(TOOL_CALL_OPEN, close + len(TOOL_CALL_CLOSE))
    return calls


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position


def _call(value: Any) -> ToolCall:
    """A parsed JSON value as a call, or the reason it is not one."""
    if not isinstance(value, dict):
        return ToolCall(None, None, f"the tool call must be a JSON object, got {value!r:.40}")
    name, arguments = value.get("name"), value.get("arguments")
    if not isinstance(name, str) or not name:
        return ToolCall(None, None, 'the tool call has no "name" string')
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(arguments, dict):
        return ToolCall(None, None, f'the call of {name!r} has no "arguments" object')
    return ToolCall(name, arguments, None)


class Tool(NamedTuple):
    """A function the model may call, with the JSON schema that describes it to the model.

    Attributes:
      name: the name the model calls it by.
      description: what it does, for the model.
      parameters: the JSON schema of its arguments (an object schema).
      function: the Python function, called with the call's arguments as keywords; its
        result is sent back as `str(result)`, and an exception it raises as an error.
    """

    name: str
    description: str
    parameters: Mapping[str, Any]
    function: Callable[..., Any]

    def schema(self) -> dict[str, Any]:
        """The tool in the OpenAI function format that chat templates take as `tools`."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }


_OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_SIGNS: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPRESSION = 1000


def calculator(expression: str) -> int | float:
    """The value of an arithmetic expression of numbers, `+ - * /` and parentheses.

    The expression is parsed with Python's `ast` and only numbers (int or float literals),
    the four operators, unary signs and parentheses are evaluated; anything else (names,
    calls, powers, attributes, ...) is a `ValueError`. Nothing is passed to `eval`. Integer
    arithmetic is exact and `/` is true division. At most 1,000 characters.

    Args:
      expression: e.g. `"2 * (3 + 4) - 5 / 2"`.

    Returns:
      The value, an int, or a float after a division or with a float literal.

    Raises:
      ValueError: for an expression outside this grammar, too long, or whose value is not
        finite; `ZeroDivisionError` for a division by zero.

    Examples:
      >>> from tunelib.rollout import calculator
      >>> calculator("2 * (3 + 4) - 5 / 2")
      11.5
      >>> calculator("-(12 - 4) * 3")
      -24
      >>> calculator("__import__('os')")
      Traceback (most recent call last):
      ...
      ValueError: only numbers, + - * / and parentheses are allowed, got Call
    """
    if not isinstance(expression, str):
        raise ValueError(f"the expression must be a string, got {expression!r:.40}")
    if len(expression) > _MAX_EXPRESSION:
        raise ValueError(f"the expression is longer than {_MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise ValueError(f"the expression does not parse: {error.msg}") from None
    value = _evaluate(tree.body)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the value is not finite")
    return value


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _SIGNS:
        return _SIGNS[type(node.op)](_evaluate(node.operand))
    kind = type(node.op if isinstance(node, (ast.BinOp, ast.UnaryOp)) else node).__name__
    raise ValueError(f"only numbers, + - * / and parentheses are allowed, got {kind}")


CALCULATOR = Tool(
    name="calculator",
    description="Evaluate an arithmetic expression of numbers, + - * / and parentheses.",
    parameters={
        "type": "object",
        "properties": {
            "expression": {"type": "string", "description": 'for example "2 * (3 + 4)"'}
        },
        "required": ["expression"],
    },
    function=calculator,
)


def tool_response_tokens(
    tokenizer: HFTokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    after: str | None = None,
) -> list[int]:
    """The token ids a chat template puts after an assistant turn: tool messages, then the
    header of the next assistant turn.

    The template renders a conversation of a user message, an assistant message and
    `messages` (the `{"role": "tool", ...}` messages answering the turn) with the
    generation prompt; the observation is the text after the assistant's content, encoded.
    `after` is the end-of-turn text the model has already sampled (its stop token, such as
    `"<|im_end|>"`): the observation starts after the first `after` that the template writes
    there. With None (the turn ended at a closing tag such as `</tool_call>`, without its
    stop token) or when the template writes no `after`, the observation starts right after
    the content and so holds the template's end-of-turn markup. Only the tool messages reach
    the observation; TRL's tool loop builds its tool suffix the same way, with an example
    conversation, cutting at the end-of-turn token.

    The prompt, the sampled turns and these observations tokenize back to the conversation
    the template renders when the template writes assistant content as it is and the cuts
    fall where tokens end, as after a special token (true of Qwen2.5's template for turns
    without `<think>` blocks; Qwen3's template rewrites the reasoning of earlier turns).

    Args:
      tokenizer: an `HFTokenizer` with a chat template.
      messages: the tool messages, dicts with "role" "tool", "content" and, for templates
        that use it, "name".
      after: the end-of-turn text the model sampled, or None.

    Returns:
      The observation's token ids.

    Raises:
      ValueError: when the tokenizer has no chat template; `tunelib.data.TemplateError`
        when the template fails or does not write an assistant message's content.
    """
    if tokenizer.chat_template is None:
        raise ValueError("the tokenizer has no chat template (chat_template is None).")
    head = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _CONTENT_MARK}]
    text = render_chat_template(
        tokenizer.chat_template,
        [*head, *messages],
        add_generation_prompt=True,
        **tokenizer.special_tokens,
    )
    cut = text.find(_CONTENT_MARK)
    if cut < 0:
        raise TemplateError("the chat template does not write an assistant message's content.")
    cut += len(_CONTENT_MARK)
    if after:
        end = text.find(after, cut)
        if end >= 0 and not text[cut:end].strip():
            cut = end + len(after)
    return tokenizer.encode(text[cut:])


class ToolEnvironment:
    r"""An `Environment` in which the model calls tools until it answers without a call.

    Each `step` decodes the turn (its `Turn.text`, or `tokenizer.decode` of its tokens) and
    parses its tool calls (`parse_tool_calls`). Without calls, the turn is the final answer:
    the episode is done, with reward `reward_fn(text)` (0 without a `reward_fn`). Otherwise
    each call runs, and the observation is the tool messages of the results rendered by the
    tokenizer's chat template (`tool_response_tokens`), with reward 0. As TRL's tool loop
    does, a call's result becomes `str(result)` and a failure (an unknown tool, bad
    arguments, an exception in the tool) the JSON `{"error": "..."}`; a malformed call is
    reported the same way (`malformed="report"`, the default), or dropped
    (`malformed="ignore"`: Tunix's Qwen parser skips it, TRL reads such a turn as plain text;
    a turn whose calls are all malformed is then a final answer).

    `messages` records the conversation after the prompt: each turn as an assistant message
    whose content is the decoded turn, and the tool messages; the prompt's messages followed
    by these render the episode.

    Args:
      tokenizer: an `HFTokenizer` whose chat template renders `"tool"` messages.
      tools: the tools the model may call.
      reward_fn: the reward of the final answer, from its text; None gives 0.
      malformed: "report" (default) or "ignore", as above.

    Examples:
      >>> import string, tokenizers
      >>> from tokenizers import decoders, models, pre_tokenizers
      >>> from tunelib.data import HFTokenizer
      >>> from tunelib.rollout import CALCULATOR, ToolEnvironment, Turn
      >>> tags = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
      >>> vocab = {t: i for i, t in enumerate(tags + list("\n" + string.printable[:95]))}
      >>> inner = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="?"))
      >>> inner.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one token a character
      >>> inner.decoder = decoders.Fuse()
      >>> _ = inner.add_special_tokens(tags[:2]), inner.add_tokens(tags[2:])
      >>> template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
      ...             "<|im_end|>\n{% endfor %}"
      ...             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
      >>> tok = HFTokenizer(inner, eos_token="<|im_end|>", chat_template=template)
      >>> env = ToolEnvironment(tok, [CALCULATOR], reward_fn=lambda text: float(text == "14"))
      >>> env.reset(())
      >>> call = ('<tool_call>{"name": "calculator", "arguments": {"expression": "2 * 7"}}'
      ...         '</tool_call>')
      >>> step = env.step(Turn(tuple(tok.encode(call + "<|im_end|>")), None, False))
      >>> print(repr(tok.decode(step.observation, stop_at_eos=False)), step.reward, step.done)
      '\ntool\n14\nassistant\n' 0.0 False
      >>> env.step(Turn(tuple(tok.encode("14<|im_end|>")), None, False))
      Step(observation=(), reward=1.0, done=True)
    """

    def __init__(
        self,
        tokenizer: HFTokenizer,
        tools: Sequence[Tool],
        *,
        reward_fn: Callable[[str], float] | None = None,
        malformed: Malformed = "report",
    ):
        if malformed not in ("report", "ignore"):
            raise ValueError(f"malformed must be 'report' or 'ignore', got {malformed!r}.")
        if tokenizer.chat_template is None:
            raise ValueError("the tokenizer has no chat template (chat_template is None).")
        self.tokenizer, self.reward_fn, self.malformed = tokenizer, reward_fn, malformed
        self.tools = {tool.name: tool for tool in tools}
        self.messages: list[dict[str, Any]] = []

    def reset(self, prompt: tuple[int, ...]) -> None:
        """Start an episode: forget the previous conversation."""
        self.messages = []

    def step(self, turn: Turn) -> Step:
        """Run the turn's tool calls, or score its final answer."""
        text = turn.text if turn.text is not None else self.tokenizer.decode(turn.tokens)
        self.messages.append({"role": "assistant", "content": text})
        calls = parse_tool_calls(text)
        if self.malformed == "ignore":
            calls = [call for call in calls if call.error is None]
        if not calls:
            reward = 0.0 if self.reward_fn is None else float(self.reward_fn(text))
            return Step((), reward, True)
        responses = [
            {"role": "tool", "name": call.name or "invalid", "content": self._run(call)}
            for call in calls
        ]
        self.messages.extend(responses)
        last = turn.tokens[-1] if turn.tokens else None
        stopped = last is not None and last in self.tokenizer.stop_ids
        after = self.tokenizer.tokenizer.id_to_token(last) if stopped else None
        return Step(tool_response_tokens(self.tokenizer, responses, after=after), 0.0, False)

    def _run(self, call: ToolCall) -> str:
        if call.error is not None:
            return _error(call.error)
        tool = self.tools.get(call.name)
        if tool is None:
            return _error(f"unknown tool {call.name!r}; the tools are {sorted(self.tools)}")
        try:
            return str(tool.function(**call.arguments))
        except Exception as error:  # the model's call failed: it reads why
            return _error(f"{type(error).__name__}: {error}")


def _error(message: str) -> str:
    return json.dumps({"error": message})
