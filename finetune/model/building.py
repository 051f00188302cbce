"""One model built at a time in this process.

Why: torch's default dtype is process-wide, and transformers sets it while it builds a model
(`from_config(dtype=...)`, `from_pretrained(dtype=...)`) and puts back what it found. Two threads building at
once (concurrent plans in the UI's handlers, a plan beside a load) can each put back the other's dtype, leaving
the process on bfloat16 for good: every later tensor and model is then silently built in it. Every build in
finetune holds `BUILDING`; a build takes milliseconds on meta, so plans barely wait.
"""

from __future__ import annotations

import threading

BUILDING = threading.RLock()
