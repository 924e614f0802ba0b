"""The replay verdict on hand-built journals shaped like a voice session's (pure).

A voice turn of the default pipeline: the ASR's speech started / stopped, transcript
and done; the thinker's text deltas and done; the speech stage's transcript, audio
deltas and done, its audio interleaved with the thinker's text as timing has it; and
settings records passed down the chain (a greedy replay writes one more). What a
client reads is compared stage by stage; the first record that differs is named with
its stage, kind and index among its stage's outputs; the pacing of the waits is
decided from the source's journal times.
"""

from __future__ import annotations

from collections import Counter

from coordinator.controlplane.replay_verdict import compare_outputs, compared
from coordinator.controlplane.replay_wait import AnswerClock, entry_ms, reached
from schemas.events import OutputEvent, OutputKind
from schemas.fence import Fence

K = OutputKind


def _out(stage, kind, text="", data=b"", epoch=1):
    return OutputEvent(Fence("s", 0, epoch, 1, epoch), stage, kind, 1, text=text, data=data)


def turn(heard, answer, *, interleaved=False, epoch=1):
    """One voice turn's client outputs; ``interleaved``: the speech stage starts
    speaking while the thinker still writes (the cut and order timing gives)."""
    heard_kinds = ((K.SPEECH_STARTED, ""), (K.SPEECH_STOPPED, ""), (K.TRANSCRIPT, heard),
                   (K.DONE, ""))  # fmt: skip
    asr = [_out("asr", k, t, epoch=epoch) for k, t in heard_kinds]
    words = answer.split(" ")
    text = [_out("thinker", K.TEXT_DELTA, w + " ", epoch=epoch) for w in words]
    audio = [_out("tts", K.AUDIO_DELTA, data=w.encode(), epoch=epoch) for w in words]
    said = [_out("tts", K.TRANSCRIPT, answer, epoch=epoch)]
    if interleaved:
        middle = [o for pair in zip(text, audio, strict=True) for o in pair]
        return [*asr, *said, *middle, _out("thinker", K.DONE, epoch=epoch),
                _out("tts", K.DONE, epoch=epoch)]  # fmt: skip
    return [*asr, *text, _out("thinker", K.DONE, epoch=epoch), *said, *audio,
            _out("tts", K.DONE, epoch=epoch)]  # fmt: skip


def settings(stage):
    return _out(stage, K.SETTINGS, data=b"\x81")


def test_settings_records_and_the_interleaving_of_stages_are_not_differences():
    source = [*turn("capital of France?", "Paris it is"), *turn("and Japan?", "Tokyo", epoch=2)]
    target = [settings("asr"), settings("thinker"), settings("tts"),
              *turn("capital of France?", "Paris it is", interleaved=True),
              settings("thinker"),
              *turn("and Japan?", "Tokyo", interleaved=True, epoch=2)]  # fmt: skip
    result = compare_outputs(source, target)
    assert result.identical, result
    assert result.matched == result.source_outputs == result.target_outputs == 18
    # Each stage's stream is joined whole, wherever other stages' records fell.
    joined = [o for o in compared(target) if o.kind is K.AUDIO_DELTA]
    assert [o.data for o in joined] == [b"Parisitis", b"Tokyo"]


def test_the_first_differing_record_is_named_with_its_stage_kind_and_index():
    source = [*turn("capital of France?", "Paris it is"), *turn("and Japan?", "Tokyo", epoch=2)]
    # The second question heard otherwise: the ASR's transcript is the first record that
    # differs, though the thinker and the speech stage answered otherwise after it.
    target = [*turn("capital of France?", "Paris it is"),
              *turn("and Japan ice?", "Ice is cold", interleaved=True, epoch=2)]  # fmt: skip
    mismatch = compare_outputs(source, target).first_mismatch
    assert mismatch is not None
    assert (mismatch.stage, mismatch.kind, mismatch.index) == ("asr", "transcript", 6)
    assert "'and Japan?'" in mismatch.source and "'and Japan ice?'" in mismatch.target
    assert mismatch.describe()[0] == "  first mismatch at 6: transcript output #6 of stage asr"

    # Heard alike, answered otherwise: the thinker's text is the first difference.
    target = [*turn("capital of France?", "Paris it is"), *turn("and Japan?", "Kyoto", epoch=2)]
    mismatch = compare_outputs(source, target).first_mismatch
    assert mismatch is not None
    assert (mismatch.stage, mismatch.kind, mismatch.index) == ("thinker", "text_delta", 2)
    assert "'Tokyo '" in mismatch.source and "'Kyoto '" in mismatch.target

    # A turn the target never answered: the first record missing is named, '(none)'.
    mismatch = compare_outputs(source, turn("capital of France?", "Paris it is")).first_mismatch
    assert mismatch is not None
    assert (mismatch.stage, mismatch.kind, mismatch.index, mismatch.target) == (
        "asr", "speech_started", 4, "(none)")  # fmt: skip


def test_an_input_waits_for_the_answers_the_source_had_ended_before_it():
    first, second = turn("q1", "a1"), turn("q2", "a2", epoch=2)
    records = [(1000 + i, o) for i, o in enumerate(first)]
    records += [(5000 + i, o) for i, o in enumerate(second)]
    stages = {"asr", "thinker", "tts"}
    clock = AnswerClock(records, stages)
    assert clock.before(1000) == Counter()
    after_first = Counter(clock.before(4000))
    assert after_first == Counter({"asr": 1, "thinker": 1, "tts": 1})
    assert clock.before(None) == Counter({"asr": 2, "thinker": 2, "tts": 2})
    # A stage the target's pipeline lacks is not waited for.
    assert AnswerClock(records, {"asr"}).before(4000) == Counter({"asr": 1})
    assert not reached(Counter({"asr": 1, "thinker": 1}), after_first)
    assert reached(Counter({"asr": 2, "thinker": 1, "tts": 1}), after_first)
    assert entry_ms("1733300000123-7") == 1733300000123
