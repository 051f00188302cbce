"""The UI's download folders do not pile up: a page session's folder goes when the page closes, and the folders
a killed server left go when the next server starts (a live server's are kept); nor do gradio's copies of
uploads (ui.layout.UPLOAD_CACHE_S)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.ui_support import form_values, running_app, tiny_recipe, wait_for, write_dataset
from ui.downloads import OWNER, Downloads

ROOT = Path(__file__).resolve().parents[1]
SERVER = "import sys, time; from ui.downloads import Downloads; d = Downloads(sys.argv[1]); " \
         "print(d.root, flush=True); time.sleep(600)"


def _server(parent: Path) -> tuple[subprocess.Popen, Path]:
    """A process that made its download folder under `parent` and lives until killed."""
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(parent)], env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, text=True)
    return proc, Path(proc.stdout.readline().strip())


def test_a_killed_servers_downloads_go_when_the_next_starts_a_live_ones_stay(tmp_path):
    killed, killed_root = _server(tmp_path)
    live, live_root = _server(tmp_path)
    try:
        (killed_root / "session" / "recipe.yaml").parent.mkdir()
        (killed_root / "session" / "recipe.yaml").write_text("x")
        killed.send_signal(signal.SIGKILL)  # no exit handler runs
        killed.wait()
        other = tmp_path / "finetune-ui-not-ours"  # no OWNER: not a folder a server made, left alone
        other.mkdir()
        mine = Downloads(tmp_path)
        assert not killed_root.exists()
        assert live_root.is_dir() and (live_root / OWNER).is_file() and other.is_dir() and mine.root.is_dir()
    finally:
        live.send_signal(signal.SIGKILL)
        live.wait()
    ended = subprocess.run([sys.executable, "-c", SERVER.replace("time.sleep(600)", "pass"), str(tmp_path)],
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, check=True)
    assert not Path(ended.stdout.strip()).exists()  # a server that exits removes its own folder


def test_a_page_sessions_download_folder_goes_when_the_page_closes(tmp_path, tiny_model_dir, monkeypatch):
    from gradio_client import Client

    monkeypatch.setenv("GRADIO_HEARTBEAT_INTERVAL", "0.25")  # the server notices the closed page at once
    values = form_values(tiny_recipe(tiny_model_dir, write_dataset(tmp_path / "d.jsonl"), tmp_path / "runs" / "a"))
    with running_app(tmp_path, [tmp_path, tiny_model_dir]) as demo:
        client, other = (Client(demo.local_url, verbose=False, download_files=False) for _ in range(2))
        for c in (client, other):
            c.predict(*values, api_name="/save_recipe")  # the page gets gradio's copy of the file
        mine, theirs = (demo.downloads.folder(c.session_hash) / "recipe.yaml" for c in (client, other))
        assert "runs/a" in mine.read_text() and theirs.is_file()
        client.close()  # its heartbeat stops, as when the browser tab closes
        wait_for(lambda: not mine.parent.exists(), 20, "the closed session's download folder to go")
        assert theirs.is_file()  # the open page keeps its file
        other.close()


def test_gradios_copy_of_an_upload_goes_after_the_cache_age(tmp_path, tiny_model_dir, monkeypatch):
    """An uploaded recipe (it may hold private paths, a dataset private records) is not kept in gradio's upload
    cache for good: gone after UPLOAD_CACHE_S (here 1 s), the loaded form unaffected."""
    from gradio_client import Client, handle_file

    import ui.layout

    monkeypatch.setattr(ui.layout, "UPLOAD_CACHE_S", 1)
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(f"model: {{path: {tiny_model_dir}}}\ndata: {{path: {write_dataset(tmp_path / 'd.jsonl')}}}\n")
    with running_app(tmp_path, [tmp_path, tiny_model_dir]) as demo:
        client = Client(demo.local_url, verbose=False, download_files=False)
        notice, *_ = client.predict(handle_file(str(recipe)), api_name="/load_recipe")
        assert notice == "Loaded mine.yaml."
        cached = [Path(f) for files in demo.temp_file_sets for f in files if Path(f).name == "mine.yaml"]
        assert cached and all(p.is_file() and p != recipe for p in cached)
        wait_for(lambda: not any(p.exists() for p in cached), 20, "gradio's copy of the upload to go")
        assert recipe.is_file()  # the user's own file is never touched
        client.close()
