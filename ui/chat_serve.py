"""The chat worker process the UI starts and `ui.chat_worker` drives: `python -m ui.chat_serve` answers the
JSON-lines chat protocol on stdin and stdout (finetune.model.chat) over the models finetune.api keeps for chat,
until its stdin closes; SIGTERM ends it the same way, its models' weight stores closed (their files removed)."""

from __future__ import annotations

import signal
import sys

from finetune import api


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through the store's close, as stdin's end does
    return api.chat_worker()


if __name__ == "__main__":
    raise SystemExit(main())
