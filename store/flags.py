"""NIXL's yes/no words: the one reading of every boolean setting, the ranks' and this package's own.

It imports nothing from the package, so that setup.py can load it by path at build time (before
anything is built) and app/ reads NIXL_TELEMETRY_PROMETHEUS_LOCAL with the same words.
"""

from __future__ import annotations

# NIXL's own boolean words (configTraits<bool>), matched the way it matches them: whole value, any case, no
# trimming. An empty or padded value is refused, as the C++ plug-in refuses it, so one environment never makes
# C++ ranks fail while Python ranks start.
TRUE_WORDS = frozenset({"y", "yes", "on", "1", "true", "enable"})
FALSE_WORDS = frozenset({"n", "no", "off", "0", "false", "disable"})


def parse_flag(name: str, text: str | None) -> bool:
    """False when the variable is unset; otherwise one of NIXL's yes/no words, in any case (ValueError if not)."""
    if text is None:
        return False
    word = text.lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"{name}={text!r} is not a yes/no word (use one of y, yes, on, 1, true, enable or "
                     "n, no, off, 0, false, disable, in any case)")
