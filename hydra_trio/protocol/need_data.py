"""The one sentinel of the pull-style codecs (the Hydra codec's ``next_event()`` and the ggml-RPC codec's
``next_request_event()`` / ``next_reply_event()``): every event of the bytes received so far was handed out,
receive more (h11's ``NEED_DATA``)."""

from __future__ import annotations

import enum


class NeedData(enum.Enum):
    """The type of :data:`NEED_DATA` (its one value)."""

    NEED_DATA = "NEED_DATA"


NEED_DATA = NeedData.NEED_DATA
"""What a codec's ``next_event()`` returns when every event of the bytes received so far was handed out:
call its ``receive_*data`` with more (h11's ``NEED_DATA``)."""
