"""`finetune ui`: start the web UI, on loopback unless told otherwise, and never open to a network unguarded.

Any host other than loopback, and a Gradio share link (GRADIO_SHARE=true), needs `--auth user:password`
(or FINETUNE_UI_AUTH): the UI can start processes and read files inside the allowed folders, so it must
not be reachable by anyone without it. Wrong passwords are rate limited (ui.login).
"""

from __future__ import annotations

import argparse
import gc
import ipaddress
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from finetune.console import quiet_libraries
from finetune.errors import FinetuneError

AUTH_ENV = "FINETUNE_UI_AUTH"
EXIT_USAGE = 2
WORKER_EXIT_S = 1.0  # on Ctrl-C the chat worker gets this long to end by itself (its pipe closed), then is killed


class UIConfigError(FinetuneError):
    """The UI was asked to start in an unsafe or malformed way."""

    exit_code = EXIT_USAGE


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1); hostnames other than localhost are not."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def parse_auth(value: str | None) -> tuple[str, str] | None:
    """'user:password' -> (user, password); None stays None."""
    if not value:
        return None
    user, sep, password = value.partition(":")
    if not sep or not user or not password:
        raise UIConfigError("--auth must look like user:password (both non-empty)",
                            hint=f"e.g. --auth alice:s3cret, or set {AUTH_ENV}=alice:s3cret")
    return user, password


def share_requested() -> bool:
    """Whether the environment asks Gradio for a public share link (GRADIO_SHARE, as gradio reads it)."""
    return os.environ.get("GRADIO_SHARE", "").strip().lower() in ("true", "1", "yes")


def check_exposure(host: str, auth: tuple[str, str] | None, share: bool = False) -> None:
    """Refuse to serve a non-loopback address, or a public share link, without a password."""
    if share and auth is None:
        raise UIConfigError(
            "refusing to publish the UI through a Gradio share link (GRADIO_SHARE) without authentication: "
            "anyone with the link could start training runs and read files in the allowed folders",
            hint=f"pass --auth user:password (or set {AUTH_ENV}), or unset GRADIO_SHARE")
    if not is_loopback(host) and auth is None:
        raise UIConfigError(
            f"refusing to listen on {host} without authentication: anyone who can reach it could start "
            "training runs and read files in the allowed folders",
            hint=f"pass --auth user:password (or set {AUTH_ENV}), or listen on 127.0.0.1")


def launch(host: str = "127.0.0.1", port: int = 7860, auth: tuple[str, str] | None = None,
           allow_dirs: list[str | Path] | None = None, runs_dir: str | Path = "runs", block: bool = True,
           allow_python_rewards: bool = False):
    """Build and serve the UI; with block=False return the running gradio Blocks (for tests)."""
    share = share_requested()
    check_exposure(host, auth, share)
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # offline machines: no usage pings
    from starlette.middleware import Middleware

    from ui.backend import Backend, UISettings
    from ui.layout import CSS, build_app
    from ui.login import ClientAddress, HideBeforeLogin, LoginGuard
    from ui.runs import RunManager

    settings = UISettings(allow_dirs=[Path(p) for p in (allow_dirs or [Path.cwd()])], runs_dir=Path(runs_dir),
                          allow_python_rewards=allow_python_rewards)
    manager = RunManager(settings.runs_dir).start()
    backend = Backend(settings, manager)
    demo = build_app(backend)
    demo.run_manager = manager  # tests stop its runs when they close the app
    demo.chat_worker = backend.chat_worker  # and its chat worker (which also ends by itself with this process)
    demo.downloads = backend.downloads  # and see a closed page's download folder go
    demo.login_guard = LoginGuard(*auth) if auth else None
    middleware = [Middleware(ClientAddress), Middleware(HideBeforeLogin)]
    # quiet: gradio's start-up text tells the user to "set `share=True` in `launch()`", which a `finetune ui`
    # user cannot do; the address is printed here instead (a share link, when asked for, gradio prints itself).
    demo.launch(server_name=host, server_port=port, auth=demo.login_guard, share=share,
                app_kwargs={"middleware": middleware}, prevent_thread_lock=True, css=CSS,
                allowed_paths=[str(settings.runs_dir)], quiet=True, footer_links=[])
    if block:
        print(f"finetune ui: running on {demo.local_url}", flush=True)
        serve_until_stopped(demo)
    return demo


def serve_until_stopped(demo: Any) -> None:
    """Serve until Ctrl-C (SIGINT) or SIGTERM, then stop promptly: the chat worker first, since a reply being
    streamed keeps its request open and the server waits for open requests before it stops (seconds to
    minutes while a model generates); then the server. Training runs go on: they run in their own session."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(0.5) and demo.is_running:
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        print("finetune ui: stopping (the chat worker, then the server; training runs go on)", flush=True)
        demo.chat_worker.close(timeout=WORKER_EXIT_S)  # a streaming reply ends: "the chat worker stopped"
        demo.run_manager.close()
        if demo.server is not None:  # a browser's open event stream would hold uvicorn's graceful shutdown:
            demo.server.force_exit = True  # end it now, and quietly (the requests it cancels are expected)
            logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL)
        demo.close()
        gc.freeze()  # the process ends now: no last collection over the whole heap (seconds on a busy machine)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="finetune ui", description="Web UI: recipe form, memory plan, training, chat.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on; anything but loopback needs --auth")
    p.add_argument("--port", type=_port, default=7860, help="port (default 7860)")
    p.add_argument("--auth", default=os.environ.get(AUTH_ENV), metavar="USER:PASSWORD",
                   help=f"require this login (default: ${AUTH_ENV})")
    p.add_argument("--allow-dir", dest="allow_dirs", action="append", default=None, metavar="FOLDER", type=_folder,
                   help="folder whose files the UI may use (repeatable; default: the working directory)")
    p.add_argument("--runs-dir", default="runs", help="folder of run directories and the run queue (default runs)")
    p.add_argument("--allow-python-rewards", action="store_true",
                   help="run GRPO recipes whose rewards are Python files (code on this machine; refused by default)")
    return p


def _port(text: str) -> int:
    """--port: a TCP port, 1 to 65535 (argparse turns the refusal into exit code 2)."""
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 1 to 65535, not {text!r}")
    return int(text)


def _folder(text: str) -> str:
    """--allow-dir: a folder that exists (a typo would silently allow nothing)."""
    if not Path(text).expanduser().is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a folder")
    return text


def main(argv: list[str] | None = None) -> int:
    """Entry point of `finetune ui`; returns the exit code (2 for a refused or malformed start)."""
    args = build_parser().parse_args(argv)
    quiet_libraries()
    try:
        launch(args.host, args.port, parse_auth(args.auth), args.allow_dirs, args.runs_dir,
               allow_python_rewards=args.allow_python_rewards)
    except FinetuneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # e.g. the port is taken
        print(f"error: cannot serve on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
