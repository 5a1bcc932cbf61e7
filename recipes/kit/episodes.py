"""Tool-use episodes for a recipe: the task, its tokenizer, demonstrations and environments.

The task is multiplication of operands of up to `--max-digits` digits, asked in a chat
("<|im_start|>user\\n123*456<|im_end|>\\n<|im_start|>assistant\\n"): hard to do in the head
for a small model, easy with the `calculator` tool of `tunelib.rollout`. The recipes' own
models read it with a character tokenizer that has a chat template (`chat_tokenizer`): one
token a character, plus the chat markup `<|im_start|>`, `<|im_end|>` and the Hermes tags
`<tool_call>`, `</tool_call>` as single tokens. Episodes run in `tunelib.rollout`'s
`ToolEnvironment`, so the tool calls, the tool messages and the reward are the library's.

A demonstration is an episode written out by hand and observed through the same environment
(`demonstrations`): with the tool, a call of the calculator on the problem, the tool's
answer, then the answer; without it, the answer alone. Its arrays have the layout of a
`tunelib.rollout.Episode` (`tokens`, `where` on model tokens, `context_where`), so SFT on
demonstrations and GRPO on sampled episodes score the same rows the same way.
"""

import dataclasses
import json
import string

import numpy as np

from tunelib.data import arithmetic_split, encode_prompts, render_chat_template
from tunelib.rollout import CALCULATOR, ToolEnvironment, Turn, parse_tool_calls

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
TOOL_TAGS = ("<tool_call>", "</tool_call>")


def chat_tokenizer():
    """One token a character (newline and the 95 printable ASCII characters), the chat
    markup and the tool-call tags as single tokens, and `TEMPLATE`; EOS is `<|im_end|>`."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    from tunelib.data import HFTokenizer

    tags = [*CHAT_TOKENS, *TOOL_TAGS]
    vocab = {t: i for i, t in enumerate(tags + list("\n" + string.printable[:95]))}
    inner = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="?"))
    inner.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    inner.decoder = decoders.Fuse()
    inner.add_special_tokens(list(CHAT_TOKENS))
    inner.add_tokens(list(TOOL_TAGS))
    return HFTokenizer(inner, eos_token="<|im_end|>", chat_template=TEMPLATE)


def tool_call(expression: str) -> str:
    """A call of the calculator in the Hermes / Qwen format."""
    arguments = {"name": "calculator", "arguments": {"expression": expression}}
    return f"{TOOL_TAGS[0]}{json.dumps(arguments, separators=(',', ':'))}{TOOL_TAGS[1]}"


@dataclasses.dataclass(frozen=True)
class ToolTask:
    """Problems as chat prompts, and how long a turn, an observation and an episode may be.

    Attributes:
      tokenizer: `chat_tokenizer()`, or a model's own with a chat template.
      train, heldout: records `{"prompt": <rendered chat>, "problem": "123*456",
        "answer": "56088"}`.
      tool: whether the model has the calculator (else it answers in one turn).
      max_turns: model turns per episode (1 without the tool).
      prompt_length: tokens of a (left-padded) prompt.
      turn_tokens: the most tokens of one model turn.
      observation_tokens: the most tokens of one observation.
    """

    tokenizer: object
    train: list[dict]
    heldout: list[dict]
    tool: bool
    max_turns: int
    prompt_length: int
    turn_tokens: int
    observation_tokens: int

    @property
    def episode_tokens(self) -> int:
        """The token budget of an episode after its prompt."""
        return self.max_turns * self.turn_tokens + (self.max_turns - 1) * self.observation_tokens


def load_task(config, tokenizer, *, tool: bool, max_turns: int) -> ToolTask:
    """`--num-train` and `--num-heldout` problems of `--operations` on up to `--max-digits`
    digits (`tunelib.data.arithmetic_split` of `--seed`), as chat prompts."""

    train, heldout = arithmetic_split(
        seed=config.seed, num_train=config.num_train, num_heldout=config.num_heldout,
        max_digits=config.max_digits, operations=tuple(config.operations),
    )  # fmt: skip

    def chat(records):
        out = []
        for r in records:
            problem = r["prompt"].rstrip("=")
            messages = [{"role": "user", "content": problem}]
            prompt = render_chat_template(
                tokenizer.chat_template, messages, add_generation_prompt=True,
                **tokenizer.special_tokens,
            )  # fmt: skip
            out.append({"prompt": prompt, "problem": problem, "answer": r["answer"]})
        return out

    train, heldout = chat(train), chat(heldout)
    prompt_length = max(len(tokenizer.encode(r["prompt"])) for r in train + heldout)
    longest = max(train + heldout, key=lambda r: len(r["problem"]))
    call = len(tokenizer.encode(tool_call(longest["problem"])))
    answer = max(len(tokenizer.encode(r["answer"])) for r in train + heldout)
    turn_tokens = (call if tool else answer) + 8  # room to write a little more, and EOS
    return ToolTask(
        tokenizer, train, heldout, tool, max_turns if tool else 1, prompt_length,
        turn_tokens, observation_tokens=64,
    )  # fmt: skip


def environments(task: ToolTask, records: list[dict], group_size: int) -> list:
    """A `ToolEnvironment` per episode (`group_size` per record, in order): the calculator
    when the task has the tool, none otherwise; reward 1 for a final answer that is exactly
    the record's, else 0."""

    def make(answer: str):
        return ToolEnvironment(
            task.tokenizer, [CALCULATOR] if task.tool else [],
            reward_fn=lambda text: float(text.strip() == answer),
        )  # fmt: skip

    return [make(r["answer"]) for r in records for _ in range(group_size)]


def demonstrations(task: ToolTask, records: list[dict]) -> dict:
    """Demonstration episodes of `records`, observed through `environments`: NumPy arrays
    `prompt_tokens`, `prompt_where` `[B, P]` and `tokens`, `where` (model tokens),
    `context_where` (model and observation tokens) `[B, T]`, as `run_episodes` lays out an
    `Episode`."""

    tok = task.tokenizer
    width = task.episode_tokens
    tokens = np.full((len(records), width), tok.pad_id, np.int32)
    where = np.zeros((len(records), width), bool)
    context = np.zeros((len(records), width), bool)
    for row, (record, env) in enumerate(zip(records, environments(task, records, 1), strict=True)):
        turns = [tool_call(record["problem"])] if task.tool else []
        env.reset(())
        position = 0
        for text in [*turns, record["answer"]]:
            ids = [*tok.encode(text), tok.eos_id]
            tokens[row, position : position + len(ids)] = ids
            where[row, position : position + len(ids)] = True
            position += len(ids)
            step = env.step(Turn(tuple(ids), None, False))
            observation = list(step.observation)
            tokens[row, position : position + len(observation)] = observation
            position += len(observation)
        if step.reward != 1.0 or position > width:
            raise ValueError(f"the demonstration of {record['problem']} does not fit or is wrong")
        context[row, :position] = True
    prompt_tokens, prompt_where = encode_prompts(
        [r["prompt"] for r in records], tok, max_length=task.prompt_length
    )
    return {
        "prompt_tokens": np.asarray(prompt_tokens), "prompt_where": np.asarray(prompt_where),
        "tokens": tokens, "where": where, "context_where": context,
    }  # fmt: skip


def tool_use(environments: list, num_turns) -> dict:
    """What the episodes of `environments` did with the tool, from their conversations:
    `tool_call_rate` (the share of episodes with at least one `<tool_call>` block),
    `malformed_rate` (the share of those blocks that do not parse as a call) and `turns`
    (model turns per episode)."""

    calls = [
        [
            c
            for m in env.messages
            if m["role"] == "assistant"
            for c in parse_tool_calls(m["content"])
        ]
        for env in environments
    ]
    blocks = sum(len(c) for c in calls)
    malformed = sum(call.error is not None for c in calls for call in c)
    return {
        "tool_call_rate": float(np.mean([bool(c) for c in calls])),
        "malformed_rate": malformed / blocks if blocks else 0.0,
        "turns": float(np.mean(num_turns)),
    }
