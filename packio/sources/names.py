"""Class names as packio stores them: one spelling per text, case kept.

``café`` typed on Linux (NFC: one code point for é) and ``café`` copied from macOS (NFD: e
plus a combining accent) are different folder names but the same text: stored in NFC,
they are one class, so a name looked up in ``manifest.classes`` finds it. ``Dog`` and
``dog`` are different folders on Linux, and torchvision's ImageFolder keeps them as two
classes: packio does too, with a note in the summary, since it is more often a slip.
"""

from __future__ import annotations

import unicodedata
from collections import Counter

from packio.sample import text_key

__all__ = ["class_name", "case_notes", "stored_alike"]


def class_name(name: str) -> str:
    """``name`` as a class name is stored: Unicode NFC; a folder name's bytes that are not
    UTF-8 written as ``\\xNN`` (:func:`packio.sample.text_key`)."""
    return text_key(unicodedata.normalize("NFC", name))


def stored_alike(names: set[str]) -> tuple[str, str] | None:
    """Two of ``names`` that are different texts (not NFC and NFD of one) yet one class name
    as stored: a name whose bytes are not UTF-8 (``b'caf\\xe9'``) is written ``caf\\xe9``,
    which a name holding a backslash may spell already. None when there are none."""
    first: dict[str, str] = {}
    for name in sorted(names):
        other = first.setdefault(class_name(name), name)
        if unicodedata.normalize("NFC", other) != unicodedata.normalize("NFC", name):
            return other, name
    return None


def case_notes(names: list[str], *, since: int = 0, what: str = "class") -> Counter[str]:
    """A summary note for each group of ``names`` that differ only in case (each group
    counted by its size); ``since``: only groups holding a name at that index or later
    (the names an append adds)."""
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        groups.setdefault(name.casefold(), []).append(i)
    return Counter({f"{what} names that differ only in case, kept as different classes (rename the folders or "
                    f"labels to merge them): {', '.join(names[i] for i in ids)}": len(ids)
                    for ids in groups.values() if len(ids) > 1 and ids[-1] >= since})
