"""The demo's agent conversation and its byte-level tokenizer.

The model is randomly initialised, so a real tokenizer would add a download and nothing else:
each UTF-8 byte is one token, and five special tokens mark the roles. The conversation is an
agent session whose tool outputs (a test log, a file listing) dominate the prompt, as in real
agent traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

SPECIAL_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>")
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
_SPECIAL_IDS = {name: 256 + index for index, name in enumerate(SPECIAL_TOKENS)}


def encode(role: str, text: str) -> list[int]:
    """One message: the role's special token, the text's UTF-8 bytes, ``<|end|>``."""
    return [_SPECIAL_IDS[f"<|{role}|>"], *text.encode("utf-8"), _SPECIAL_IDS["<|end|>"]]


@dataclass(frozen=True)
class Message:
    role: str
    text: str

    @property
    def tokens(self) -> list[int]:
        return encode(self.role, self.text)

    def summary(self, width: int = 60) -> str:
        first_line = self.text.splitlines()[0] if self.text else ""
        if len(first_line) > width:
            first_line = first_line[: width - 3] + "..."
        return f"{self.role:<9} {len(self.tokens):>5} tokens  {first_line}"


SYSTEM_PROMPT = (
    "You are a coding agent working in a checked-out repository. You can call tools:\n"
    "  run_tests(path)   run the test suite and return its log\n"
    "  read_file(path)   return a file's contents\n"
    "  list_files(dir)   list a directory\n"
    "Think step by step, call one tool at a time, and quote the lines you rely on. "
    "Never invent tool output. When the task is done, reply with a short summary."
)


def _test_log(num_tests: int, failing: int) -> str:
    lines = ["$ pytest -q tests/", f"collected {num_tests} items", ""]
    for index in range(num_tests):
        outcome = "FAILED" if index == failing else "PASSED"
        lines.append(f"tests/test_parser.py::test_case_{index:03d} {outcome}")
    lines += [
        "",
        f"FAILED tests/test_parser.py::test_case_{failing:03d} - AssertionError: "
        "expected ['a', 'b'] but parse() returned ['a']",
        f"1 failed, {num_tests - 1} passed in 0.42s",
    ]
    return "\n".join(lines)


def _source_file(num_functions: int) -> str:
    lines = ['"""A small tokenizer for the configuration language."""', ""]
    for index in range(num_functions):
        lines += [
            f"def rule_{index:02d}(text: str) -> list[str]:",
            f"    return [part for part in text.split(',') if part][:{index + 1}]",
            "",
        ]
    lines += ["def parse(text: str) -> list[str]:", "    return rule_00(text)"]
    return "\n".join(lines)


def first_turn(size: int) -> list[Message]:
    """System prompt, the user's task, the agent's tool call and a long test log."""
    return [
        Message("system", SYSTEM_PROMPT),
        Message("user", "tests/test_parser.py fails since yesterday's merge. Find out why."),
        Message("assistant", "Calling run_tests('tests/')."),
        Message("tool", _test_log(num_tests=size, failing=size // 3)),
    ]


def second_turn(size: int) -> list[Message]:
    """After the agent's reply: another tool output and the user's follow-up."""
    return [
        Message("tool", _source_file(num_functions=max(2, size // 8))),
        Message("user", "Fix parse() so that it keeps every field, then rerun the tests."),
    ]


def tokens_of(messages: list[Message]) -> list[int]:
    return [token for message in messages for token in message.tokens]


def third_turn(size: int) -> list[Message]:
    """The agent reruns the tests after its fix: a tool call and a short tool output."""
    return [
        Message("assistant", "Calling run_tests('tests/test_parser.py')."),
        Message("tool", f"$ pytest -q tests/test_parser.py\n{size} passed in 0.40s"),
    ]


#: The demo's message roles as the edit policies name transcript segments.
SEGMENT_ROLES = {
    "system": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool_output",
}
