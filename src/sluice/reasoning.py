"""Reasoning output: a thinking model's `<think>…</think>` told apart from its answer.

Models such as Qwen3 and DeepSeek-R1's distills write their reasoning between two tags
before the answer. With `--reasoning-parser NAME` (vLLM's flag and names) the server puts
it in `reasoning_content` on chat completions (its own deltas when streamed) and in a
`reasoning` item of the Responses API; structured outputs and tool calls then apply to the
answer only: the engine holds a request's grammar back until the end tag has been
generated (or the prompt already closed the thinking, as Qwen3's template does with
`chat_template_kwargs: {"enable_thinking": false}`).

The formats:
- `qwen3`: the model opens and closes the thinking itself; output with no opening tag is
  all answer (thinking switched off).
- `deepseek_r1`: the chat template opens the thinking in the prompt, so the output starts
  inside it (an opening tag there anyway is dropped); without the end tag it is all reasoning.

Text-level and streaming: a tag split across two deltas is held back until it is whole.
"""
from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"
# name -> whether the output starts inside the thinking (the template opened it).
FORMATS = {"qwen3": False, "deepseek_r1": True}
# How near the prompt's end a closing tag must be for the thinking to count as closed
# there (Qwen3's "<think>\n\n</think>\n\n": the tag then a blank line or two).
_CLOSED_WITHIN = 4


@dataclass(frozen=True)
class Reasoning:
    """A reasoning format resolved against a tokenizer: its tags' token ids."""
    name: str
    starts_inside: bool
    start_id: int | None
    end_id: int

    def ended_in_prompt(self, prompt_ids: list[int]) -> bool:
        """Whether the prompt itself closes the thinking (a template that switched it off):
        an end tag among its last few tokens, with no start tag after it."""
        tail = list(prompt_ids[-_CLOSED_WITHIN:])
        if self.end_id not in tail:
            return False
        after = tail[len(tail) - 1 - tail[::-1].index(self.end_id):]
        return self.start_id is None or self.start_id not in after

    def splitter(self, prompt_ids: list[int]) -> "ReasoningSplitter":
        if self.ended_in_prompt(prompt_ids):
            return ReasoningSplitter("answer")
        return ReasoningSplitter("before", "thinking" if self.starts_inside else "answer")

    def split(self, text: str, prompt_ids: list[int]) -> tuple[str | None, str | None]:
        """(reasoning, answer) of a whole output; None for an empty part."""
        reasoning, content = self.splitter(prompt_ids).feed(text, final=True)
        return reasoning or None, content or None


def resolve(name: str, tokenizer) -> Reasoning:
    """The named format for this tokenizer (a sluice Tokenizer or a transformers one).
    ValueError for an unknown name, or a vocabulary where the end tag is not one token
    (the engine watches for that token to start a grammar)."""
    if name not in FORMATS:
        raise ValueError(f"unknown reasoning parser {name!r}; supported: {', '.join(FORMATS)}")
    hf = getattr(tokenizer, "hf", tokenizer)
    vocab = hf.get_vocab()
    if END not in vocab:
        raise ValueError(f"reasoning parser {name!r}: this model's vocabulary has no {END} token")
    return Reasoning(name, FORMATS[name], vocab.get(START), vocab[END])


class ReasoningSplitter:
    """One output's text, fed as it streams: each delta split into (reasoning, answer)."""

    def __init__(self, state: str, without_start: str = "answer"):
        self.state = state                  # "before" (no text yet decided), "thinking", "answer"
        self.without_start = without_start  # where output not opening with the start tag goes
        self.held = ""                      # text that may be the start of a tag

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        text = self.held + delta
        self.held = ""
        reasoning = content = ""
        while text or (final and self.state == "before"):
            if self.state == "before":
                stripped = text.lstrip()
                if stripped.startswith(START):
                    text, self.state = stripped[len(START):], "thinking"
                elif START.startswith(stripped) and not final:
                    self.held = text  # whitespace, or part of the start tag so far
                    return reasoning, content
                else:
                    self.state = self.without_start
                    if not text:
                        break
            elif self.state == "thinking":
                i = text.find(END)
                if i >= 0:
                    reasoning += text[:i]
                    text, self.state = text[i + len(END):], "answer"
                    continue
                keep = 0 if final else _partial_tag(text, END)
                reasoning += text[:len(text) - keep]
                self.held = text[len(text) - keep:]
                return reasoning, content
            else:
                content += text
                break
        return reasoning, content


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (a tag the next delta may finish)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
