"""Time to first output: which server events start and stop the clock (no I/O)."""

from __future__ import annotations

from coordinator.turn_clock import COMMIT, SERVER_VAD, TurnClock


def ev(kind: str, **own: str) -> dict:
    return {"type": kind, "duplexq": own}


ANSWER = [ev("response.created"), ev("response.output_item.added"),
          ev("response.output_text.delta"), ev("response.output_text.delta"),
          ev("response.done")]  # fmt: skip


def run(clock: TurnClock, events: list[dict], start: float = 10.0) -> list[tuple[str, float]]:
    measured = []
    for i, event in enumerate(events):
        got = clock.sent(event, start + i)
        if got is not None:
            measured.append(got)
    return measured


def test_a_typed_turn_is_measured_once_from_its_commit_to_the_first_delta():
    clock = TurnClock()
    clock.committed(9.0)
    assert run(clock, ANSWER) == [(COMMIT, 3.0)]  # the first delta went out at 12.0
    assert run(clock, ANSWER) == []  # an answer with no turn before it measures nothing


def test_a_voice_turn_starts_when_the_server_vads_turn_end_is_sent():
    clock = TurnClock()
    heard = [ev("input_audio_buffer.speech_started", stage="vad"),
             ev("input_audio_buffer.speech_stopped", stage="vad"),
             ev("input_audio_buffer.committed", stage="vad"),
             ev("conversation.item.input_audio_transcription.completed", stage="asr")]  # fmt: skip
    # The transcript is the user's, not the answer: the first delta, at 6, stops the clock.
    assert run(clock, heard + ANSWER, start=0.0) == [(SERVER_VAD, 4.0)]


def test_the_clients_announced_commit_does_not_restart_its_clock():
    clock = TurnClock()
    clock.committed(1.0)
    assert run(clock, [ev("input_audio_buffer.committed"), *ANSWER], start=2.0) == [(COMMIT, 4.0)]


def test_an_answer_already_streaming_at_the_commit_is_not_the_turns_answer():
    clock = TurnClock()
    clock.committed(1.0)
    late = [ev("response.output_audio.delta"), ev("response.done")]
    assert run(clock, late + ANSWER, start=2.0) == [(COMMIT, 5.0)]


def test_an_answer_that_ends_without_output_measures_nothing():
    clock = TurnClock()
    clock.committed(1.0)
    assert run(clock, [ev("response.created"), ev("response.done"), *ANSWER]) == []


def test_a_refused_commit_leaves_no_turn_waiting():
    clock = TurnClock()
    clock.committed(1.0)
    clock.forget()
    assert run(clock, ANSWER) == []


def test_a_duplex_decision_is_an_output():
    clock = TurnClock()
    clock.committed(1.0)
    assert run(clock, [ev("response.created"), ev("duplexq.response.listen")]) == [(COMMIT, 10.0)]
