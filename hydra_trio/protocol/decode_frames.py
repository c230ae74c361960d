"""DECODE reply frames (docs/hydra-protocol.md §3), sans-I/O: ``[u32 token_id][f32 logprob][u8 flags]``.

The frame layout, the flags (FINAL, PAD, and hydra-trio's stop-reason bits),
padding, and :class:`DecodeFramer`, which turns generated tokens into exactly
``9 × budget`` bytes.  hydra-trio's choices are in docs/protocol-notes.md.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TypeAlias

Bytes: TypeAlias = bytes | bytearray | memoryview
"""What the sans-I/O codecs take as input (:mod:`.hydra`, :mod:`.strict`, and here)."""

DECODE_FRAME_SIZE = 9
"""One DECODE frame: ``[u32 token_id][f32 logprob][u8 flags]``, 9 bytes."""
DECODE_FLAG_FINAL = 0x01
"""Set on the last real generated token."""
DECODE_FLAG_PAD = 0x02
"""Set on padding frames only (hydra-trio's padding rule, see below)."""
DECODE_PAD_TOKEN = 0xFFFFFFFF

DECODE_STOP_FLAGS: dict[str, int] = {
    "eos": 0x04,  # an end-of-generation token
    "length": 0x08,  # the frame budget (n_predict) is used up
    "n_tokens_limit": 0x10,  # the slot's context is full
    "stop": 0x20,  # a stop string
    "error": 0x40,  # generation failed or was cancelled
}
"""Why generation stopped, in the otherwise reserved flag bits of the DECODE
frame that ends it (hydra-trio's extension: the reply meta is sent before the
first token, so it cannot say): set on the FINAL frame, or on the first PAD
frame when no token was generated.  Names as DECODE's ``stop_reason`` meta key (docs/protocol-notes.md)."""


def decode_stop_reason(flags: int) -> str | None:
    """The stop reason a frame's flags carry (see `DECODE_STOP_FLAGS`), or None."""
    return next((name for name, bit in DECODE_STOP_FLAGS.items() if flags & bit), None)


_FRAME = struct.Struct("<IfB")
assert _FRAME.size == DECODE_FRAME_SIZE

DECODE_PAD_FRAME = _FRAME.pack(DECODE_PAD_TOKEN, 0.0, DECODE_FLAG_PAD)
"""The padding frame.

Padding rule (hydra-trio's answer to docs/hydra-protocol.md §3 "define and
document the padding"): a DECODE reply announces ``payload_len = 9 *
budget`` frames up front. Real tokens are sent as they are generated; the
last real token carries `DECODE_FLAG_FINAL`. When generation ends before the
budget is used up (EOS, stop word, error, cancellation), the remaining frames
are padding: token_id ``0xFFFFFFFF``, logprob ``0.0`` (not NaN, so frames
compare equal), flags `DECODE_FLAG_PAD` (0x02). A reader stops at the first
FINAL or PAD frame and discards the rest; the byte count always matches
payload_len so the connection stays in sync. If generation fails before any
token, every frame is padding.
"""


def pack_decode_frame(token_id: int, logprob: float, flags: int) -> bytes:
    """One 9-byte DECODE frame. Raises struct.error when token_id is not a
    u32 or flags not a u8."""
    return _FRAME.pack(token_id, logprob, flags)


class DecodeFramer:
    """DECODE frames for a budget of ``budget`` tokens, sans-I/O (docs/hydra-protocol.md §3).

    Feed generated tokens with :meth:`push` (it returns the frames that can be
    sent now: the last token is held back so that it can carry FINAL) and end
    with :meth:`finish`, which returns the FINAL frame, with the stop reason in
    its flags (`DECODE_STOP_FLAGS`), and, when ``pad``, PAD frames up to the
    budget, so that exactly ``9 * budget`` bytes are written in all.  Tokens
    beyond the budget are dropped.

    Attributes:
        tokens_generated: real token frames produced so far (FINAL included).
    """

    def __init__(self, budget: int) -> None:
        if budget < 1:
            raise ValueError(f"a DECODE budget is at least 1 frame, got {budget}")
        self.budget = budget
        self.tokens_generated = 0
        self._held: tuple[int, float] | None = None
        self._sent = 0

    def push(self, tokens: Sequence[int], logprobs: Sequence[float]) -> bytes:
        """Frames for newly generated ``tokens`` (one logprob each); the last one is held back."""
        out = bytearray()
        for tok, lp in zip(tokens, logprobs, strict=True):
            if self._held is not None and self._sent < self.budget - 1:
                out += _FRAME.pack(self._held[0], self._held[1], 0)
                self._sent += 1
                self.tokens_generated += 1
            self._held = (tok, lp)
        return bytes(out)

    def finish(self, stop_reason: str | None, *, pad: bool = True) -> bytes:
        """The end: the held token as FINAL (or, without one, a PAD frame) carrying ``stop_reason``,
        then PAD frames up to the budget when ``pad``.

        Raises ValueError for an unknown stop reason.
        """
        reason = DECODE_STOP_FLAGS[stop_reason] if stop_reason is not None else 0
        out = bytearray()
        if self._held is not None and self._sent < self.budget:
            out += _FRAME.pack(self._held[0], self._held[1], DECODE_FLAG_FINAL | reason)
            self._sent += 1
            self.tokens_generated += 1
            self._held = None
        elif pad and self._sent < self.budget:
            out += _FRAME.pack(DECODE_PAD_TOKEN, 0.0, DECODE_FLAG_PAD | reason)
            self._sent += 1
        if pad:
            out += decode_pad_frames(self.budget - self._sent)
            self._sent = self.budget
        return bytes(out)


def decode_pad_frames(n: int) -> bytes:
    """``n`` padding frames (9 * n bytes); see `DECODE_PAD_FRAME`."""
    if n < 0:
        raise ValueError(f"frame count must be >= 0, got {n}")
    return DECODE_PAD_FRAME * n


def unpack_decode_frames(b: Bytes) -> list[tuple[int, float, int]]:
    """Split a DECODE payload into ``(token_id, logprob, flags)`` tuples.
    Padding frames are returned too. Raises ValueError when ``len(b)`` is not
    a multiple of 9."""
    if len(b) % DECODE_FRAME_SIZE:
        raise ValueError(f"DECODE payload of {len(b)} bytes is not a whole number of {DECODE_FRAME_SIZE}-byte frames")
    return list(_FRAME.iter_unpack(b))
