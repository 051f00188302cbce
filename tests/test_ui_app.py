"""Starting the UI: loopback by default, refused on a network address without a password."""

from __future__ import annotations

import pytest

from ui.app import AUTH_ENV, is_loopback, main, parse_auth


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_loopback_hosts(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.20", "::", "example.com"])
def test_network_hosts(host):
    assert not is_loopback(host)


def test_network_host_without_auth_refuses_to_start(monkeypatch, capsys):
    monkeypatch.delenv(AUTH_ENV, raising=False)
    assert main(["--host", "0.0.0.0", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "refusing to listen on 0.0.0.0 without authentication" in err and "--auth user:password" in err


def test_malformed_auth_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setenv(AUTH_ENV, "justauser")
    assert main(["--host", "0.0.0.0"]) == 2
    assert "user:password" in capsys.readouterr().err


def test_auth_from_the_environment():
    assert parse_auth("alice:s3:cret") == ("alice", "s3:cret")
    assert parse_auth(None) is None


def test_auth_protects_the_page_and_its_api(tmp_path):
    import httpx
    from gradio_client import Client

    from tests.ui_support import free_port
    from ui.app import launch

    demo = launch(port=free_port(), auth=("alice", "s3cret"), allow_dirs=[tmp_path], runs_dir=tmp_path / "runs",
                  block=False)
    try:
        assert httpx.get(demo.local_url + "config").status_code == 401
        with pytest.raises(Exception, match="(?i)login|auth|401"):
            Client(demo.local_url, verbose=False)
        client = Client(demo.local_url, auth=("alice", "s3cret"), verbose=False)
        assert client.predict(api_name="/history")[0]["headers"][:2] == ["run", "state"]
    finally:
        demo.run_manager.close()
        demo.close()


def test_a_taken_port_is_reported_without_a_traceback(tmp_path, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["--port", str(port), "--runs-dir", str(tmp_path / "runs")]) == 2
    assert f"cannot serve on 127.0.0.1:{port}" in capsys.readouterr().err


def test_finetune_ui_prints_its_address_and_no_hint_the_user_cannot_follow(tmp_path):
    """gradio's start-up text says to "set `share=True` in `launch()`", which a `finetune ui` user cannot do."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.ui_support import free_port

    root = Path(__file__).resolve().parents[1]
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "finetune", "ui", "--port", str(port), "--runs-dir",
                             str(tmp_path / "runs")], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"})
    try:
        first = proc.stdout.readline()  # blocks until the server is up (or the process ends)
    finally:
        proc.terminate()
        rest = proc.communicate(timeout=60)[0]
    assert first == f"finetune ui: running on http://127.0.0.1:{port}/\n", first + rest
    assert "share" not in first + rest and "Warning" not in first + rest, first + rest
