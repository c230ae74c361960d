"""The router's refusals, with llama-server's statuses and messages (``tools/server/server-models.cpp`` of the
llama.cpp that llama-cpp-python 0.3.36 vendors)."""

from __future__ import annotations

from ..errors import HydraTrioError


class ModelUnavailable(HydraTrioError):
    """500 ``server_error``: the model failed to load (``model name=X failed to load``), the ``--models-max``
    limit is reached with every loaded model busy (``model limit reached, try again later``), or its child
    cannot be reached (``proxy error: ...``)."""

    http_status = 500
