"""The default stack's answers, as shipped: right and in English at a high rate.

``duplexq up`` on the default pipeline (tests/shipped_stack.py) with the thinker's
shipped decoding settings, nothing overridden, is asked a fixed set of questions with
known answers, each in fresh sessions over the Realtime API (so each answer draws its
own seed, as every user's does). The sessions ask for text output: the words are the
thinker's either way, and text skips the real-time pacing of the speech.

The bar is measured, not hoped for: docs/models.md gives the rates the shipped settings
reach (about 80 % right, all in English) and those of the settings shipped before
(about 62 % right, some answers in French), which this test refuses. The two questions
the 135M model gets wrong most of the time stay in the set: the rate is the model's.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter

import pytest

from tests.realtime_helpers import Client, text_turn, until_completed
from tests.shipped_stack import START_S, ShippedStack

pytestmark = pytest.mark.timeout(START_S + 600)

QUESTIONS = {
    "What is the capital of France?": r"\bparis\b",
    "What is two plus two?": r"\bfour\b|\b4\b",
    "What color is the sky on a clear day?": r"\bblue\b",
    "How many days are in a week?": r"\bseven\b|\b7\b",
    "What is the largest ocean on Earth?": r"\bpacific\b",
    "What is the opposite of hot?": r"\bcold\b",
    "How many legs does a spider have?": r"\beight\b|\b8\b",
    "What do bees make?": r"\bhoney\b",
    "What planet do we live on?": r"\bearth\b",
    "What is frozen water called?": r"\bice\b",
    "Which animal says moo?": r"\bcows?\b",
    "What is the capital of Japan?": r"\btokyo\b",
}
ASKED = 10
"""Fresh sessions per question: 120 answers, enough that the rate's spread (a few
answers) sits well inside the margin between the bar and what the settings reach."""
RIGHT_AT_LEAST = 0.7
ENGLISH_AT_LEAST = 0.95
ENGLISH = frozenset(re.findall(r"\w+", "the a an is are of in it to and on what this that with"))
FRENCH = frozenset(re.findall(r"\w+", "le la les est de des une et du un en que qui pas dans au"))


def in_english(text: str) -> bool:
    """More English function words than French ones (the model's drift was to French)."""
    found = re.findall(r"[a-zà-ÿ']+", text.lower())
    return sum(w in ENGLISH for w in found) > sum(w in FRENCH for w in found)


def test_in_english_tells_the_answers_seen_apart() -> None:
    assert in_english("The capital of France is Paris.")
    assert not in_english("L'Albanie, le paysage: Si la France est un paysage, les Albans.")
    assert not in_english("")


async def ask(stack: ShippedStack, question: str) -> str:
    async with Client.connect(f"ws://127.0.0.1:{stack.port}", stack.api_key) as client:
        text_only = {"type": "realtime", "output_modalities": ["text"]}
        await client.send({"type": "session.update", "session": text_only})
        for event in text_turn(question):
            await client.send(event)
        events = await until_completed(client, within_s=300)
    assert not [e for e in events if e["type"] == "error"], events
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


async def test_the_shipped_stack_answers_right_and_in_english(shipped_stack: ShippedStack) -> None:
    answers: list[tuple[str, str]] = []
    for _ in range(ASKED):  # a round of every question at once: 12 sessions in flight
        said = await asyncio.gather(*(ask(shipped_stack, q) for q in QUESTIONS))
        answers += zip(QUESTIONS, said, strict=True)
    right = Counter(q for q, a in answers if re.search(QUESTIONS[q], a.lower()) and in_english(a))
    english = sum(in_english(a) for _, a in answers)
    tally = "\n".join(f"  {right[q]}/{ASKED} {q}" for q in QUESTIONS)
    often_wrong = "\n".join(f"  {q} -> {a!r}" for q, a in answers if right[q] < ASKED // 2)
    print(f"\nright and in English {right.total()}/{len(answers)}, in English {english}\n{tally}")
    assert right.total() >= RIGHT_AT_LEAST * len(answers), f"{tally}\n{often_wrong}"
    assert english >= ENGLISH_AT_LEAST * len(answers), [a for _, a in answers if not in_english(a)]
