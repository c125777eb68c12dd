"""The table of ``nixl-prometheus-mp top``: its columns, and how they fit a terminal's width.

Narrow terminals hide the least important columns first and shorten agent names last; the key columns (AGENT,
PID, P50, P99, ERRORS) stay at any width from 40 columns.  No line is ever longer than the width: a terminal
that wraps one would shift every row below it.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

HEADER = ("AGENT", "PID", "INST", "RANK", "STATE", "AGE(s)", "TX B/s", "RX B/s", "TX REQ/s", "RX REQ/s",
          "P50", "P99", "ERRORS")
_LEFT = 5  # the first five columns are left-aligned words, the rest right-aligned figures



# Dropped in this order where the terminal is too narrow for the whole table: the hidden ones are named on a line
# of their own.  AGENT, PID, P50, P99 and ERRORS are never dropped: who a rank is and whether its transfers are
# slow or failing is what an operator looks at first (the rank's AGENT is shortened instead).
_NARROW_DROPS = ("INST", "AGE(s)", "RX REQ/s", "TX REQ/s", "RANK", "RX B/s", "TX B/s", "STATE")
_AGENT = HEADER.index("AGENT")
_SHORT_MARK = "~"  # ASCII: the terminal may not be set up for UTF-8, and an ellipsis is not one column in all


@dataclass(frozen=True, slots=True)
class Layout:
    """Which columns of HEADER a table shows (their indices, in order), how wide AGENT is, and the gap between."""

    columns: tuple[int, ...]
    agent_width: int
    gap: int

    def width(self, widths: Sequence[int]) -> int:
        """The table's width with ``widths`` (every column's, AGENT's as its longest cell)."""
        return sum(self.agent_width if i == _AGENT else widths[i] for i in self.columns) + \
            self.gap * (len(self.columns) - 1)

    @property
    def hidden(self) -> list[str]:
        """The columns not shown, in the order they were dropped in."""
        return [name for name in _NARROW_DROPS if HEADER.index(name) not in self.columns]


def fit_columns(widths: Sequence[int], width: int | None) -> Layout:
    """The layout of a table whose columns are ``widths`` wide in ``width`` characters (None: no limit).

    What gives way, in this order: the columns of _NARROW_DROPS, one by one; the two spaces between columns,
    to one; the AGENT column, down to its heading's width.  Below that the table is wider than ``width`` (the
    caller cuts its lines): no key column is dropped at any width.
    """
    layout = Layout(tuple(range(len(HEADER))), widths[_AGENT], 2)
    if width is None:
        return layout
    for name in _NARROW_DROPS:
        if layout.width(widths) <= width:
            return layout
        layout = Layout(tuple(i for i in layout.columns if i != HEADER.index(name)), layout.agent_width, 2)
    if layout.width(widths) > width:
        layout = Layout(layout.columns, layout.agent_width, 1)
    excess = layout.width(widths) - width
    if excess > 0:
        layout = Layout(layout.columns, max(len(HEADER[_AGENT]), layout.agent_width - excess), layout.gap)
    return layout


def shorten(text: str, width: int) -> str:
    """``text`` in ``width`` characters at most: its middle replaced by a mark, as agent names of one job
    usually differ at their end (a rank's number) and by their start (a role)."""
    if len(text) <= width:
        return text
    if width <= len(_SHORT_MARK):
        return text[:width]
    tail = (width - len(_SHORT_MARK)) // 2
    return text[:width - len(_SHORT_MARK) - tail] + _SHORT_MARK + (text[-tail:] if tail else "")


def align(table: list[tuple[str, ...]], width: int | None = None) -> tuple[list[str], list[str]]:
    """The table's lines, none longer than ``width`` (None: no limit), and the columns hidden to fit it."""
    widths = [max(len(r[i]) for r in table) for i in range(len(HEADER))]
    layout = fit_columns(widths, width)
    widths[_AGENT] = layout.agent_width
    cells = [[shorten(r[i], widths[i]) if i == _AGENT else r[i] for i in layout.columns] for r in table]
    lines = [(" " * layout.gap).join(cell.ljust(widths[i]) if i < _LEFT else cell.rjust(widths[i])
                                     for i, cell in zip(layout.columns, row, strict=True))[:width].rstrip()
             for row in cells]
    return lines, layout.hidden


def wrap(text: str, style: int, width: int | None) -> list[tuple[str, int]]:
    """``text`` as lines of ``width`` at most, broken between words (a cut word reads as another word)."""
    if width is None or len(text) <= width:
        return [(text, style)]
    return [(line, style) for line in textwrap.wrap(text, max(width, 1), break_on_hyphens=False)]
