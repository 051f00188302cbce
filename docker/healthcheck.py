"""The image's health check: the UI answers on its port. A container started for another command (a one-off
`finetune run ...`) has no UI to check and counts as healthy, instead of showing "unhealthy" while it trains."""

import sys
import urllib.request

args = open("/proc/1/cmdline", "rb").read().decode(errors="replace").split("\0")
if "ui" not in args:
    sys.exit(0)
port = args[args.index("--port") + 1] if "--port" in args[:-1] else "7860"
try:
    urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=4)
except OSError as exc:
    sys.exit(f"the UI does not answer on port {port}: {exc}")
