"""Graphs that outlive their step, and outputs an evaluation still holds.

A variable in the user's frames whose autograd graph reaches back into an
earlier step (`total += loss`) keeps every step's activations alive: the
tracker stamps each step's graph roots (stamp_graph) and, at each step's
end, walks the user's variables down to the nearest stamp (LeakChecks).
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch

from oomdoc import frames

_GRAPH_STAMP = "oomdoc_step"
# On an autograd node: the oldest step stamp found below it (what a walk
# from it would return), so the next walk stops there instead of walking an
# ever longer chain again (`total += loss` adds one node per step).
_GRAPH_BELOW = "oomdoc_below"
_NO_STAMP = 1 << 62
_GRAPH_WALK_LIMIT = 4000
_LEAK_FRAMES = 3
_CONTAINER_ITEMS = 8
# The deep leak walk (below this step's own graph roots) runs only while
# end-of-step memory grows, after this many steps of growth in a row, then
# with gaps that double up to the last value: O(log steps) walks in a leak.
_DEEP_WALK_AFTER_GROWTH = 3
DEEP_WALK_FIRST_GAP = 4
_DEEP_WALK_MAX_GAP = 256

_CO_OPTIMIZED = 0x0001


class LeakChecks:
    """The Tracker's leak checks. What they read of the tracker's state is
    declared here (the Tracker sets it up)."""

    stats: dict[str, int]
    step_index: int
    steps: list[dict]
    _current: dict[str, Any]
    # Weak references to the previous evaluation call's outputs, and their bytes.
    _previous_evaluation_outputs: list[tuple[weakref.ref[torch.Tensor], int]]
    # End-of-step growth streak, and when the next deep walk may run.
    _growth_streak: int
    _growth_counted_for: dict | None
    _next_deep_walk_step: int
    _deep_walk_gap: int

    # ------------------------------------------------------------ leaks
    def _deep_walk_due(self) -> bool:
        """Whether this step's leak check should also walk below the step's
        own graph roots (the deep walk): only while end-of-step memory has
        grown for several steps in a row, and then with doubling gaps."""
        current = self._current
        if self._growth_counted_for is not current:  # once per step, however many optimizers
            previous = self.steps[-1]["end_allocated_bytes"] if self.steps else None
            end = current["end_allocated_bytes"]
            grew = previous is not None and end is not None and end > previous
            self._growth_streak = self._growth_streak + 1 if grew else 0
            self._growth_counted_for = current
        if self._growth_streak < _DEEP_WALK_AFTER_GROWTH:
            return False
        if self.step_index < self._next_deep_walk_step:
            return False
        self._next_deep_walk_step = self.step_index + self._deep_walk_gap
        self._deep_walk_gap = min(2 * self._deep_walk_gap, _DEEP_WALK_MAX_GAP)
        return True

    def _find_retained_graphs(self, deep: bool = False) -> list[dict]:
        """Variables in the user's frames whose autograd graph reaches back into
        an earlier step (e.g. `total += loss`): graphs that outlive their step.

        Every step, the variables are checked down to the nearest graph root
        stamped with a step, which costs what the step added (walks remember
        on each node what lies below it). A variable that is this step's own
        root (the model's output, the loss) is walked below only by the deep
        walk (`deep`), which _deep_walk_due() allows while memory grows."""
        found: list[dict] = []
        if self.step_index == 0:
            return found
        self.stats["leak_checks"] += 1
        if deep:
            self.stats["leak_walks"] += 1
        try:
            user_frames = frames.user_frames(_LEAK_FRAMES, sys._getframe(1))
        except Exception:
            return found
        seen_tensors = set()
        walked = [0]
        for frame in user_frames:
            for name, value in _frame_locals(frame):
                if not isinstance(value, _CANDIDATE_TYPES):
                    continue  # most locals: modules, numbers, functions
                for tensor in _candidate_tensors(value):
                    if id(tensor) in seen_tensors:
                        continue
                    seen_tensors.add(id(tensor))
                    oldest = _oldest_stamp(tensor.grad_fn, self.step_index, deep, walked)
                    if oldest is not None:
                        found.append(
                            {
                                "variable": name,
                                "file": frame.f_code.co_filename,
                                "line": frame.f_lineno,
                                "function": frame.f_code.co_name,
                                "from_step": oldest,
                            }
                        )
                        break
        self.stats["graph_nodes_walked"] += walked[0]
        return found

    # ------------------------------------------------------------ OOM
    def _held_previous_outputs(self, frame) -> dict | None:
        """The previous evaluation call's outputs still alive while this one
        runs (`output = model(x)` in a loop keeps the last batch's logits
        until the new ones are assigned): their bytes, and the user's
        variable that holds them when one is found."""
        alive = [
            (tensor, nbytes)
            for reference, nbytes in self._previous_evaluation_outputs
            if (tensor := reference()) is not None
        ]
        if not alive:
            return None
        held: dict = {"bytes": int(sum(nbytes for _tensor, nbytes in alive))}
        ids = {id(tensor) for tensor, _nbytes in alive}
        try:
            user_frames = frames.user_frames(_LEAK_FRAMES, frame)
        except Exception:
            user_frames = []
        for user_frame in user_frames:
            for name, value in _frame_locals(user_frame):
                if isinstance(value, _CANDIDATE_TYPES) and any(
                    id(tensor) in ids for tensor in output_tensors(value)
                ):
                    held["variable"] = name
                    held["location"] = frames.location_dict(
                        user_frame.f_code.co_filename,
                        user_frame.f_lineno,
                        user_frame.f_code.co_name,
                    )
                    return held
        return held


def _frame_locals(frame) -> list[tuple[str, object]]:
    """A function frame's local variables, without keeping them alive.

    Before Python 3.13, `frame.f_locals` of a running function is a snapshot
    dict cached on the frame until the next access: it would hold the
    previous step's tensors (logits, loss) alive through the whole next step
    and inflate that step's peak. The snapshot is emptied after it is read;
    the frame's real variables are untouched (the next access rebuilds the
    snapshot from them). Module frames' f_locals is the namespace itself and
    3.13's is a write-through proxy: neither is cleared.
    """
    snapshot = frame.f_locals
    items = list(snapshot.items())
    if (
        sys.version_info < (3, 13)
        and frame.f_code.co_flags & _CO_OPTIMIZED
        and isinstance(snapshot, dict)
    ):
        snapshot.clear()
    return items


def stamp_graph(output, step_index: int) -> None:
    """Mark the graph roots made in this step so a later step can tell that a
    variable still holds them."""
    stack = [output]
    budget = 64
    while stack and budget:
        budget -= 1
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            grad_fn = item.grad_fn
            if grad_fn is not None:
                try:
                    # torch.autograd.graph.Node declares metadata a method; it is a property.
                    grad_fn.metadata.setdefault(_GRAPH_STAMP, step_index)  # type: ignore[attr-defined]
                except Exception:
                    pass
        elif isinstance(item, (list, tuple)):
            stack.extend(item[:16])
        elif isinstance(item, dict):
            stack.extend(list(item.values())[:16])
        elif hasattr(item, "__dataclass_fields__") or hasattr(item, "to_tuple"):
            try:
                stack.extend(list(vars(item).values())[:16])
            except TypeError:
                pass


_CANDIDATE_TYPES = (torch.Tensor, list, tuple, dict)


def _candidate_tensors(value):
    if isinstance(value, torch.Tensor):
        if value.grad_fn is not None:
            yield value
    elif isinstance(value, (list, tuple)):
        for item in value[-_CONTAINER_ITEMS:]:
            if isinstance(item, torch.Tensor) and item.grad_fn is not None:
                yield item
    elif isinstance(value, dict):
        for item in list(value.values())[-_CONTAINER_ITEMS:]:
            if isinstance(item, torch.Tensor) and item.grad_fn is not None:
                yield item


def output_tensors(value) -> list:
    """The tensors a model call returned or a variable holds: the value, or
    the last few items of a tuple, list or dict (HF's ModelOutput is one),
    with or without autograd history."""
    if isinstance(value, torch.Tensor):
        items: list = [value]
    elif isinstance(value, (list, tuple)):
        items = list(value[-_CONTAINER_ITEMS:])
    elif isinstance(value, dict):
        items = list(value.values())[-_CONTAINER_ITEMS:]
    else:
        return []
    return [item for item in items if isinstance(item, torch.Tensor) and item.device.type != "meta"]


def _node_marks(node) -> tuple:
    """(step stamp, oldest stamp below) recorded on an autograd node, or Nones."""
    try:
        metadata = node.metadata
    except Exception:
        return None, None
    if not metadata:
        return None, None
    return metadata.get(_GRAPH_STAMP), metadata.get(_GRAPH_BELOW)


def _next_nodes(node) -> list:
    try:
        return [next_node for next_node, _ in node.next_functions if next_node is not None]
    except Exception:
        return []


def _stamp_below(start, walked: list) -> int:
    """The oldest step stamp on the graph roots reachable from `start`'s
    inputs without passing another root (_NO_STAMP when none).

    Each node walked remembers its answer in its metadata, so a later walk
    stops there: graphs never change below a node, so per step a walk costs
    what the step added. At most _GRAPH_WALK_LIMIT nodes are expanded; past
    that the oldest stamp seen so far is returned and nothing more is
    remembered (an unfinished node's answer would be wrong)."""
    budget = _GRAPH_WALK_LIMIT
    complete = True
    # Each entry: [node, its inputs, next input to look at, oldest stamp so far].
    stack = [[start, _next_nodes(start), 0, _NO_STAMP]]
    result = _NO_STAMP
    while stack:
        entry = stack[-1]
        node, inputs, index, oldest = entry
        if index < len(inputs):
            entry[2] = index + 1
            child = inputs[index]
            stamp, below = _node_marks(child)
            if stamp is not None:
                if stamp < oldest:
                    entry[3] = stamp
                continue
            if below is not None:
                if below < oldest:
                    entry[3] = below
                continue
            if budget <= 0:
                complete = False
                continue
            budget -= 1
            walked[0] += 1
            stack.append([child, _next_nodes(child), 0, _NO_STAMP])
            continue
        stack.pop()
        if complete:
            try:
                node.metadata[_GRAPH_BELOW] = oldest
            except Exception:
                pass
        if stack:
            if oldest < stack[-1][3]:
                stack[-1][3] = oldest
        else:
            result = oldest
    return result


def _oldest_stamp(grad_fn, current_step: int, deep: bool, walked: list) -> int | None:
    """The earliest step stamp older than the current step reachable from
    `grad_fn`, or None.

    The walk does not go below a stamped root other than the start: below a
    root of this step lies this step's model graph (nothing to find in the
    usual training loop, and costly to walk), below an older root lies the
    older step already found. Below the start itself when it is a root of
    this step only when `deep`.
    """
    if grad_fn is None:
        return None
    stamp, below = _node_marks(grad_fn)
    if stamp is not None:
        if stamp < current_step:
            return stamp
        if not deep:
            return None
    if below is None:
        below = _stamp_below(grad_fn, walked)
    return below if below < current_step else None
