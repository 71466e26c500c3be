"""Text to token ids without tokenizing more of a text than the context can hold.

A text far longer than the context must be refused before it is tokenized whole: the
tokenizer's encoding of a multi-megabyte text takes about a hundred bytes of memory per
token and seconds of CPU. A bound from the text's size alone (its bytes over the longest
token's) is no bound for every tokenizer: a whitespace pre-tokenizer drops the spaces
and a word-level one maps any unknown word to one token. So a long text is counted a
slice at a time, each slice cut at whitespace (where the pre-tokenizers split anyway),
and refused as soon as the count passes the limit plus a margin for what a cut can change
(a word split in two, a prefix space added); only a text whose count fits is encoded
whole, for its exact ids. Encoding goes through `encode_batch`, which releases Python's
GIL (`encode` holds it), so the event loop keeps answering meanwhile."""

from __future__ import annotations

import re
from typing import Any

SLICE_CHARS = 16_384  # characters per counted slice
SLICES_PER_BATCH = 4  # slices encoded together: the memory of one batch is bounded
CUT_MARGIN = 16  # tokens by which one cut may change a count
_WHITESPACE = re.compile(r"\s")
CUT_SEARCH_CHARS = 1_024  # how far past a slice's end a cut looks for whitespace


def _slices(text: str) -> list[str]:
    """`text` in pieces of about SLICE_CHARS characters, each cut before whitespace when
    there is some within CUT_SEARCH_CHARS of the slice's end."""
    pieces, start = [], 0
    while start < len(text):
        end = min(start + SLICE_CHARS, len(text))
        if end < len(text):
            space = _WHITESPACE.search(text, end, end + CUT_SEARCH_CHARS)
            end = space.start() if space else end
        pieces.append(text[start:end])
        start = end
    return pieces


def encode_within(tokenizer: Any, text: str, special: bool, limit: int) -> list[int] | None:
    """The ids of `text` (special tokens added when `special`), or None when it has more
    than `limit` tokens; a long text is refused after its first slices, never encoded
    whole (module docstring)."""
    if len(text) > SLICE_CHARS:
        slices = _slices(text)
        counted = 0
        for first in range(0, len(slices), SLICES_PER_BATCH):
            batch = slices[first : first + SLICES_PER_BATCH]
            counted += sum(
                len(e.ids) for e in tokenizer.encode_batch(batch, add_special_tokens=False)
            )
            if counted > limit + CUT_MARGIN * (first + len(batch)):
                return None
    ids = tokenizer.encode_batch([text], add_special_tokens=special)[0].ids
    return ids if len(ids) <= limit else None
