"""The ground floor: the ways a run or a command stops on purpose, each shown as one line.

Nothing here imports anything of torchpar's, so every layer above may raise these.
"""

from __future__ import annotations

import difflib


class ConfigError(ValueError):
    """A user mistake in a config file, an override, a layout or an input file; printed as one
    line without a traceback (exit code 2)."""


class RankError(ConfigError):
    """A start-up fault that may be this process's alone (its launch variables, peers that never
    came): every rank says it, not rank 0 alone, which may not exist."""


class AlreadyTrained(Exception):
    """A restart of a job that had finished (its last step saved, then a rank failed on the way
    out): nothing left to do, exit code 0; the message is the one line to show."""


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (divergence); the message is the one line to show."""

    code = 3


class Preempted(RuntimeError):
    """The run stopped at a step boundary because of a signal; ``code`` is the exit code."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.code = 128 + signum


class SaveFailed(RuntimeError):
    """A checkpoint could not be written (a full disk, a lost folder); every rank raises it at the
    same step. The message is the one line to show."""

    code = 1


def did_you_mean(word: str, options) -> str:
    """The closest of ``options`` to a mistyped ``word``, as a sentence to append to an error."""
    by_lower = {str(o).lower(): str(o) for o in options}
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=1)
    return (
        f" Did you mean '{by_lower[close[0]]}'?"
        if close
        else f" Known: {', '.join(sorted(map(str, options)))}."
    )
