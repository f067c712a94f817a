"""The plain batch search, beside the decisions it settles before it ends.

The largest batch that fits is searched exactly (the report's "largest batch
size that fits", certified for the whole run), but the decisions after it
need only its plan: the micro-batch and accumulation steps that the largest
batch gives, which every batch from the largest fit to below the smallest
OOM may already share. Near the limit the search closes in a batch at a
time (on the H200 the ImageNet-style trainer's 162, 168, 163, 167, after 128
had fit and 233 had not: 128 x 8 either way), and the savers' searches and
the prescription waited for it. With lanes they go on from the settled plan
while the search ends beside them; without lanes (one replay at a time) it
runs to its end first, as the decisions always did.

The search as it stood when its plan settled stands in for it until then:
its largest fit is a batch that fits (a saver's search starts above it), its
trials what the prescription weighs of no fix; the exact search replaces it
before the report is made.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

from oomdoc.model import Snapshot
from oomdoc.replay import batch as batch_model
from oomdoc.replay.replayer import Replayer
from oomdoc.replay.search import search_batch

Found = tuple[Optional[batch_model.SearchResult], dict, Optional[str]]

# How long the search may take to end once oomdoc stops (its replays are
# stopped then; this only bounds a wait that should be short).
ABANDON_WAIT_S = 30.0


class PlainSearch:
    """search_batch, run beside the decisions (`beside`) or at once."""

    def __init__(self, replayer: Replayer, snapshot: Snapshot, options: Any, beside: bool):
        self.replayer, self.snapshot, self.options = replayer, snapshot, options
        self._settled = threading.Event()
        self._provisional: Optional[Found] = None
        self._found: Optional[Found] = None
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        if beside:
            self._thread = threading.Thread(
                target=self._search, name="oomdoc-plain-search", daemon=True
            )
            self._thread.start()
        else:
            self._search(settle_early=False)

    def _search(self, settle_early: bool = True) -> None:
        try:
            self._found = search_batch(
                self.replayer,
                self.snapshot,
                self.options,
                on_settled=self._settle if settle_early else None,
            )
        except BaseException as exc:  # raised again where the decisions wait for it
            self._error = exc
        finally:
            self._settled.set()

    def _settle(self, search: batch_model.SearchResult, info: dict) -> None:
        self._provisional = (search, info, None)
        self._settled.set()

    @property
    def ahead(self) -> bool:
        """The decisions were given the search as it stood when its plan
        settled, and the exact search is still to come (`final`)."""
        return self._provisional is not None

    def settled(self) -> Found:
        """What the decisions take: the search once its plan is known."""
        self._settled.wait()
        if self._provisional is not None:
            return self._provisional
        return self.final()

    def final(self) -> Found:
        """The search, ended (ReplaysInterrupted and any error pass through)."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._found is not None
        return self._found

    def abandon(self) -> None:
        """oomdoc stops (its replays were stopped): wait for the search's end, bounded."""
        if self._thread is not None:
            self._thread.join(ABANDON_WAIT_S)
