"""The fence one stage serves for one session, and the rule for what an interruption left behind.

A stage worker stamps every output with the fence it serves, absorbs inputs
of an older epoch, and stops work whose epoch an interruption released. The
served fence is held by a ``StageFence`` and moves only through its named
transitions, called by the actor and the worker runtime; backends read it as
``StageContext.fence``, which cannot be assigned.

Theory of operation
-------------------
``released(fence, epoch)`` is the one stale check: work made under ``fence``
was released by an interruption that moved the session to ``epoch`` when
``fence.epoch < epoch``. ``StageFence.is_stale(fence)`` asks it of the served
epoch; the coordinator's connection asks it of the epoch its own cancel
reached. Whoever drops a message for it counts the drop
(``duplexq_dropped_stale_total``, reason ``epoch``).

Transitions (``cur`` is the served fence, ``f`` the fence given; ``up`` is the
stage's view of its upstream stream, a ``FenceView``)::

    transition                 when                                 moves
    -------------------------  -----------------------------------  --------------------------
    follow(f)                  an event to handle carries f, or an  cur = f unless f regressed
                               input-describing stage's refused     (a higher incarnation of f
                               publish is restamped to f            is taken as ours first)
    on_cancel(f)               a cancel control                     up.advance(f);
                                                                    cur.epoch up to f's
    on_failover(f)             another stage failed over (control)  when f's incarnation is
                                                                    higher: cur's = f's and
                                                                    up.advance(f)
    on_interrupt(f)            this stage's own barge-in went in    cur.epoch up to f's
    on_reserve(f)              this stage ended the user's turn     cur's turn and response =
                                                                    f's, if f has cur's
                                                                    incarnation and epoch
    on_refused_released(f)     a publish refused: the work being    when cur.epoch rises to
                               produced was released                f's: up's epoch floor too
    on_refused_incarnation(f)  a publish refused: another stage     cur.incarnation = f's
                               failed over while our lease held
    on_refused_ahead(f)        a publish refused: the authority is  cur = f; up.advance(f)
                               behind us (it lost writes)
    on_barrier(f)              a barrier read upstream              up.observe(f)
    judge_upstream(f)          an upstream output read              up.judge(f)

"up to" means only ever raised. Only the epoch moves on a cancel, an interrupt
and a refused release: the authority's turn and response may already be ahead
of inputs of the new epoch the stage has not read, and those must still be
handled.

Why ``FenceView`` stays a type of its own: it is how any consumer judges a
stream it reads in order (the coordinator's journal follower uses it
unchanged), and its rule is the whole fence rule, learning incarnations from
barriers. A stage's view of its upstream stream is one such view; the stage
fence owns it and moves it only here, because each move of it goes with a
move of the served fence or with reading the stream.
"""

from __future__ import annotations

from dataplane.sessions import FenceView, MismatchReason, fence_mismatch
from schemas.fence import Fence


def released(fence: Fence, epoch: int) -> bool:
    """True when an interruption to ``epoch`` released what was made under ``fence``."""
    return fence.epoch < epoch


class StageFence:
    """The fence a stage serves for one session, and its view of its upstream stream.

    Starts at ``fence`` (the lease's); the upstream view starts as a resuming one
    (``FenceView.resuming``), since the stage's input is read from a position whose
    incarnation it does not know.
    """

    __slots__ = ("_current", "_upstream")

    def __init__(self, fence: Fence) -> None:
        self._current = fence
        self._upstream = FenceView.resuming(fence)

    @property
    def current(self) -> Fence:
        """The fence the stage serves: what its outputs are stamped with."""
        return self._current

    @property
    def upstream(self) -> Fence:
        """The newest fence the upstream view has accepted."""
        return self._upstream.current

    def __repr__(self) -> str:
        return f"StageFence({self._current!r})"

    # -- the stale check ---------------------------------------------------------

    def is_stale(self, fence: Fence) -> bool:
        """True when the served epoch released ``fence``'s work: an input to absorb
        only, a draft or a producer to drop."""
        return released(fence, self._current.epoch)

    # -- transitions -------------------------------------------------------------

    def follow(self, fence: Fence) -> None:
        """Serve ``fence`` unless it regressed. A higher incarnation (a failover whose
        control this stage has not read yet) is taken as the served one first: the
        authority stamped it, and serving the older fence would stamp the answer with
        an older epoch too, which a publish then drops."""
        current = self._current
        if fence.incarnation > current.incarnation:
            current = current.replace(incarnation=fence.incarnation)
        if fence.incarnation == current.incarnation and fence_mismatch(current, fence) is None:
            self._current = fence

    def on_cancel(self, fence: Fence) -> None:
        """A cancel control moved the session to ``fence``."""
        self._upstream.advance(fence)
        self._raise_epoch(fence.epoch)

    def on_failover(self, fence: Fence) -> None:
        """Another stage failed over: the session's incarnation is ``fence``'s."""
        if fence.incarnation <= self._current.incarnation:
            return
        self._current = self._current.replace(incarnation=fence.incarnation)
        self._upstream.advance(fence)

    def on_interrupt(self, fence: Fence) -> None:
        """This stage's own barge-in moved the session to ``fence``."""
        self._raise_epoch(fence.epoch)

    def on_reserve(self, fence: Fence) -> None:
        """This stage ended the user's turn: ``fence`` holds the reserved turn and
        response, taken if it is still the served incarnation and epoch."""
        current = self._current
        if (fence.incarnation, fence.epoch) == (current.incarnation, current.epoch):
            self._current = current.replace(turn_id=fence.turn_id, response_seq=fence.response_seq)

    def on_refused_released(self, current: Fence) -> None:
        """A publish of the work being produced was refused as released; ``current`` is
        the authority's fence. A cancel not yet read from the control stream is acted
        on here: the epoch, and from it on upstream outputs of older epochs are stale."""
        if released(self._current, current.epoch):
            self._current = self._current.replace(epoch=current.epoch)
            self._upstream.raise_epoch_floor(current.epoch)

    def on_refused_incarnation(self, current: Fence) -> None:
        """A publish was refused because another stage failed over while this stage's
        lease held: the served incarnation becomes the authority's (``current``'s)."""
        self._current = self._current.replace(incarnation=current.incarnation)

    def on_refused_ahead(self, current: Fence) -> None:
        """A publish was refused as ahead of the authority (only a Redis that lost
        acknowledged writes is behind a stage): follow it back to ``current``."""
        self._current = current
        self._upstream.advance(current)

    # -- the upstream stream -----------------------------------------------------

    def on_barrier(self, fence: Fence) -> None:
        """A barrier (cancel, failover, open) read in the upstream stream."""
        self._upstream.observe(fence)

    def judge_upstream(self, fence: Fence) -> MismatchReason | None:
        """The reason to drop an upstream output of ``fence``, or None to handle it
        (which moves the upstream view to it)."""
        return self._upstream.judge(fence)

    def drop_reason(self, fence: Fence) -> str:
        """The counter's reason for an upstream output ``judge_upstream`` refused."""
        return str(fence_mismatch(self._upstream.current, fence) or MismatchReason.EPOCH)

    def _raise_epoch(self, epoch: int) -> None:
        if released(self._current, epoch):
            self._current = self._current.replace(epoch=epoch)
