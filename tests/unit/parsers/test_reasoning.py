"""reasoning_content split from recorded R1-style answers, whole and streamed in any chunking."""

from __future__ import annotations

import random

import pytest
from recorded import R1_ANSWER, R1_CONTENT, R1_REASONING, R1_TRUNCATED, R1_WITH_OPEN_TAG

from runtime.parsers.reasoning import ReasoningParser


def chunkings(text: str) -> list[list[str]]:
    """The text in one piece, one character at a time, and in random pieces of 1-7 characters."""
    rng = random.Random(len(text))
    out = [[text], list(text)]
    for _ in range(5):
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(1, 7)
            pieces.append(text[i : i + n])
            i += n
        out.append(pieces)
    return out


def streamed(kind: str, pieces: list[str], thinking: bool = False) -> tuple[str, str]:
    p = ReasoningParser(kind, thinking=thinking)
    reasoning = content = ""
    for piece in pieces:
        r, c = p.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = p.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("pieces", chunkings(R1_ANSWER))
def test_r1_answer_splits_at_the_closing_tag_however_it_streams(pieces):
    assert streamed("deepseek-r1", pieces) == (R1_REASONING, R1_CONTENT)


def test_r1_answer_split_whole():
    assert ReasoningParser.split("deepseek-r1", R1_ANSWER) == (R1_REASONING, R1_CONTENT)


@pytest.mark.parametrize("pieces", chunkings(R1_WITH_OPEN_TAG))
def test_an_opening_tag_the_model_repeats_is_not_reasoning_text(pieces):
    assert streamed("deepseek-r1", pieces) == ("\nThe capital of France is Paris.\n", "Paris.")


def test_an_unclosed_reasoning_is_all_reasoning():
    assert ReasoningParser.split("deepseek-r1", R1_TRUNCATED) == (R1_TRUNCATED, "")
    # a partial closing tag at the cut is reasoning text too
    assert ReasoningParser.split("deepseek-r1", "hmm </thi") == ("hmm </thi", "")


def test_the_closing_tag_is_held_back_while_it_is_incomplete():
    p = ReasoningParser("deepseek-r1")
    assert p.feed("thinking</th") == ("thinking", "")
    assert p.feed("ink>\n\nAnswer") == ("", "Answer")
    assert p.feed(" more") == ("", " more")


def test_deepseek_v3_reasons_only_when_thinking_is_on():
    assert ReasoningParser.split("deepseek-v3", R1_ANSWER) == ("", R1_ANSWER)
    assert ReasoningParser.split("deepseek-v3", R1_ANSWER, thinking=True) == (R1_REASONING, R1_CONTENT)
    # a block the model opens itself at the very start is still reasoning
    assert ReasoningParser.split("deepseek-v3", "<think>plan</think>done") == ("plan", "done")
    assert ReasoningParser.split("deepseek-v3", "text <think>x</think>") == ("", "text <think>x</think>")


@pytest.mark.parametrize("pieces", chunkings("  <think>a</think>b"))
def test_deepseek_v3_detects_an_opening_tag_split_across_pieces(pieces):
    assert streamed("deepseek-v3", pieces) == ("a", "b")


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="deepseek-r1"):
        ReasoningParser("qwen3")
