"""The page: one tab per step (recipe, data, memory, train, runs, chat), each built by its module in ui/tabs.

Every handler reports user mistakes as a message on the page (never a traceback), and every view of a run
is re-read from its run directory, so a reload or a second browser sees the same state.
"""

from __future__ import annotations

import gradio as gr

from ui import views
from ui.backend import Backend
from ui.paths import data_files
from ui.tabs import chat, data, memory, recipe, runs, train

REFRESH_S = 2.0
UPLOAD_CACHE_S = 3600  # gradio's copies of uploads (a recipe or dataset: read, or copied to the runs folder, at
# once) are deleted this long after they came, checked as often; all of them when the server stops
CSS = "#run-status progress { height: 1.2em }"


def build_app(backend: Backend) -> gr.Blocks:
    """The whole UI, bound to one backend (allowed folders, runs folder, run queue)."""
    with gr.Blocks(title="finetune", delete_cache=(UPLOAD_CACHE_S, UPLOAD_CACHE_S)) as demo:
        gr.Markdown("# finetune\nBuild a recipe, check it fits your GPU, train, watch, and chat with the result.")
        timer = gr.Timer(REFRESH_S)
        with gr.Tabs():
            form, basic_gpu, prev_run = recipe.build(demo, backend)
            server_file = data.build(backend, form.widgets)
            memory.build(backend, form.widgets, basic_gpu)
            run_sel = train.build(backend, form, timer)
            runs_tab = runs.build(backend, form)
            chat_run = chat.build(backend)
        _wire_run_lists(demo, backend, run_sel, runs_tab, [prev_run], chat_run, server_file)

        def end_session(request: gr.Request) -> None:  # the tab closed or reloaded: its downloads go
            backend.downloads.forget(request.session_hash)

        demo.unload(end_session)
    return demo


def _wire_run_lists(demo: gr.Blocks, backend: Backend, run_sel: gr.Dropdown, runs_tab: runs.RunsTab,
                    run_pickers: list[gr.Dropdown], chat_run: gr.Dropdown, server_file: gr.Dropdown) -> None:
    """The lists that span tabs: runs (history, overlay, export and previous-run pickers; the chat's lists
    only runs with an adapter) and server data files, filled when the page opens, when the Runs tab opens
    and when its refresh button is pressed."""
    pickers = [runs_tab.compare, runs_tab.recipe_run, *run_pickers]

    def history_view():
        dirs = backend.run_dirs()
        return (views.history_rows(dirs), *(gr.update(choices=dirs) for _ in pickers),
                gr.update(choices=backend.chat_runs()))

    runs_tab.refresh_btn.click(history_view, None, [runs_tab.history, *pickers, chat_run], api_name="history")
    runs_tab.tab.select(history_view, None, [runs_tab.history, *pickers, chat_run], api_visibility="private")

    def on_load():
        current = backend.current_run()
        dirs = backend.run_dirs()
        return (gr.update(choices=dirs, value=current), *history_view(),
                gr.update(choices=data_files(backend.settings.allow_dirs)))

    demo.load(on_load, None, [run_sel, runs_tab.history, *pickers, chat_run, server_file], api_visibility="private")
