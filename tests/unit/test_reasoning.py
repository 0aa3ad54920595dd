"""The reasoning splitter: <think>…</think> apart from the answer, whole and streamed."""
from __future__ import annotations

import random

import pytest

from sluice.reasoning import Reasoning, ReasoningSplitter

QWEN3 = Reasoning("qwen3", False, start_id=10, end_id=11)
R1 = Reasoning("deepseek_r1", True, start_id=10, end_id=11)


@pytest.mark.parametrize("fmt, text, want", [
    (QWEN3, "<think>\nLet me see.\n</think>\n\nParis.", ("\nLet me see.\n", "\n\nParis.")),
    (QWEN3, "Paris.", (None, "Paris.")),                               # no thinking: all answer
    (QWEN3, "  <think>hmm", ("hmm", None)),                            # no closing tag: all reasoning
    (QWEN3, "<think></think>Paris.", (None, "Paris.")),
    (QWEN3, "", (None, None)),
    (QWEN3, "<thin", (None, "<thin")),                                 # a start tag that never finished
    (R1, "Let me see.</think>Paris.", ("Let me see.", "Paris.")),      # the template opened it
    (R1, "<think>Let me see.</think>Paris.", ("Let me see.", "Paris.")),
    (R1, "still thinking", ("still thinking", None)),
    (R1, "a < b </thin", ("a < b </thin", None)),
])
def test_split_whole_output(fmt, text, want):
    assert fmt.split(text, prompt_ids=[1, 2, 3]) == want


@pytest.mark.parametrize("fmt", [QWEN3, R1])
@pytest.mark.parametrize("text", [
    "<think>\nStep one. Step < two </ three.\n</think>\n\nThe answer is 4.",
    "The answer is 4, no <think> here.",
    "<think>never closed </thi",
    " <think>x</think>",
])
def test_streamed_in_any_pieces_equals_whole(fmt, text):
    """Tags split across deltas anywhere: the concatenated deltas are the whole split."""
    whole = fmt.split(text, [1])
    rng = random.Random(len(text))
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 8))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        s = fmt.splitter([1])
        r = c = ""
        for i, piece in enumerate(pieces):
            dr, dc = s.feed(piece, final=i == len(pieces) - 1)
            r, c = r + dr, c + dc
        assert (r or None, c or None) == whole, pieces


def test_partial_tags_are_held_until_whole():
    s = QWEN3.splitter([1])
    assert s.feed("<thi") == ("", "")
    assert s.feed("nk>Hmm</") == ("Hmm", "")
    assert s.feed("think>OK") == ("", "OK")
    assert s.feed("", final=True) == ("", "")


def test_a_prompt_that_closed_the_thinking_makes_all_output_the_answer():
    """Qwen3's template with enable_thinking false ends the prompt with <think>\\n\\n</think>\\n\\n."""
    closed = [5, 10, 7, 11, 7]
    assert QWEN3.ended_in_prompt(closed) and R1.ended_in_prompt(closed)
    assert R1.split("Paris.", closed) == (None, "Paris.")
    opened = [5, 11, 7, 10, 7]   # an earlier turn's end tag, then a new start: still thinking
    assert not R1.ended_in_prompt(opened)
    assert not QWEN3.ended_in_prompt([11] + [7] * 10)   # far back: an earlier turn's
    assert isinstance(QWEN3.splitter(closed), ReasoningSplitter)
