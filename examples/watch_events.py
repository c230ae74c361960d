"""Watch a node's events with trio-websocket in ten lines: one JSON object per event, printed as it comes.

    .venv/bin/python examples/watch_events.py [HOST:PORT] [TYPES] [COUNT]
    .venv/bin/python examples/watch_events.py 127.0.0.1:8080 slot,mode 20

TYPES is a ``?types=`` filter (all categories when absent, ``""`` or ``all``);
COUNT stops after that many events (for ever when absent).  Ctrl-C stops it.
``hydra-trio watch`` is the full tool (a live table, reconnects, keys, TLS).
"""

import json
import sys

import trio
from trio_websocket import open_websocket_url


async def main(address: str = "127.0.0.1:8080", types: str = "", count: str = "0") -> None:
    query = f"?types={types}" if types not in ("", "all") else ""
    async with open_websocket_url(f"ws://{address}/v1/events{query}") as ws:
        for _ in range(int(count) or sys.maxsize):
            event = json.loads(await ws.get_message())
            print(event["type"], event.get("trace_id", ""), json.dumps(event), flush=True)


if __name__ == "__main__":
    trio.run(main, *sys.argv[1:4])
