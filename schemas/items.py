"""How conversation items are named, in one place for the coordinator and the stages.

The client sees these ids on its events (``item_id``); a model stage names the
messages of its history with the same ids, so that ``conversation.item.delete``
and ``conversation.item.truncate`` reach the message the client means:

- a client's input (typed text, a commit) is ``item_<input seq>``;
- the user's speech is named by the client commit that ended it
  (``item_<commit seq>``), else by the voice activity stage's utterance number
  (``item_speech_<incarnation>_<segment>``);
- a response's message is ``item_<epoch>_<turn>_<response_seq>``, its response
  ``resp_<epoch>_<turn>_<response_seq>``.
"""

from __future__ import annotations

from schemas.events import OutputEvent
from schemas.fence import Fence


def input_item(seq: int) -> str:
    """The item a client input (typed text, a commit) makes."""
    return f"item_{seq}"


def response_id(fence: Fence) -> str:
    return f"resp_{fence.epoch}_{fence.turn_id}_{fence.response_seq}"


def response_seq_of(response: str) -> int:
    """The response_seq a response id names (``resp_E_T_R`` -> R; -1 for an id that is
    not one)."""
    last = response.rpartition("_")[2]
    return int(last) if last.isdigit() else -1


def item_id_for(response: str) -> str:
    """The id of a response's message item (``resp_E_T_R`` -> ``item_E_T_R``)."""
    return "item_" + response.removeprefix("resp_")


def response_item(fence: Fence) -> str:
    return item_id_for(response_id(fence))


def speech_item(out: OutputEvent) -> str:
    """The id of the user's item an output describes (speech events, a transcript, the
    turn's end): named where it began (``meta["item"]``: typed text passed on), by the
    commit that ended it, or by its utterance number; a turn end with none of these is
    named by the output that carried it."""
    named = out.meta.get("item")
    if isinstance(named, str) and named:
        return named
    commit_seq = out.meta.get("commit_seq")
    if commit_seq is not None:
        return input_item(int(commit_seq))
    segment = out.meta.get("segment")
    if segment is not None:
        return f"item_speech_{out.fence.incarnation}_{segment}"
    return f"item_turn_{out.stage}_{out.fence.incarnation}_{out.seq}"
