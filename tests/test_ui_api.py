"""The UI driven through its Gradio API (gradio_client) against the app launched on a loopback port.

Real tiny runs go through the real CLI in separate processes: a long one is started, stopped (a checkpoint
is saved), resumed and stopped again; a short one runs to the end, is exported, and answers beside the
base model in the chat.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune.rundir import RunDir
from tests.ui_support import running_app, status_of, tiny_recipe, wait_for, write_dataset, write_recipe

gradio_client = pytest.importorskip("gradio_client", reason="gradio_client comes with the [ui] extra")


@pytest.fixture(scope="module")
def work(tmp_path_factory, tiny_model_dir):
    workdir = tmp_path_factory.mktemp("ui-api")
    data = write_dataset(workdir / "data.jsonl")
    with running_app(workdir, [workdir, tiny_model_dir]) as demo:
        client = gradio_client.Client(demo.local_url, verbose=False)
        yield workdir, data, client, tiny_model_dir


def _load(client, recipe_path: Path) -> tuple[str, list]:
    msg, *values = client.predict(gradio_client.handle_file(str(recipe_path)), api_name="/load_recipe")
    return msg, values


def test_load_recipe_fills_the_form_and_plans(work):
    workdir, data, client, model = work
    recipe = tiny_recipe(model, data, workdir / "runs" / "plan-only", micro_batch_size=2)
    msg, values = _load(client, write_recipe(workdir / "plan.yaml", recipe))
    assert "Loaded plan.yaml" in msg
    assert str(model) in values and str(data) in values and "2" in values  # micro_batch_size as shown
    plan_msg, _, _ = client.predict(*values, "12 GB card (RTX 3060)", api_name="/plan")
    from finetune import api

    if hasattr(api, "plan"):
        assert "11.50 GiB budget" in plan_msg  # the 12 GB card less memory.gpu_memory_margin
        assert "an estimate" in plan_msg and "RTX 4090-class" in plan_msg  # the speed, with its basis
    else:  # the planner has not landed in this build: the page says so instead of failing
        assert "memory planner is not available" in plan_msg


def test_before_a_recipe_is_chosen_the_memory_tab_shows_one_neutral_hint(work):
    """A fresh form (no model, no data yet): the plan says what to do first, once; no error, no second message."""
    from tests.ui_support import form_values, set_value
    from ui.tabs.memory import FIRST_STEPS

    workdir, data, client, model = work
    fresh = form_values(tiny_recipe(model, data, workdir / "runs" / "fresh"))
    fresh = set_value(set_value(fresh, "model.path", ""), "data.path", "")
    plan_msg, plot, rows = client.predict(*fresh, "12 GB card (RTX 3060)", api_name="/plan")
    assert plan_msg == FIRST_STEPS and plot is None and not rows["data"]
    chart, sweep_msg = client.predict(*fresh, "12 GB card (RTX 3060)", None, api_name="/gpu_sizes")
    assert chart is None and sweep_msg == ""
    broken = set_value(fresh, "training.max_steps", "many")  # something given is wrong: the error, named
    assert "training.max_steps" in client.predict(*broken, "12 GB card (RTX 3060)", api_name="/plan")[0]


def test_two_sessions_download_their_own_recipe(work):
    """Two page sessions save their forms through the page's handler (which takes the session from Gradio's
    request): each gets a file with its own recipe. That the files live apart per session, which one shared
    file did not, is tests/test_ui_lists.py's."""
    workdir, data, client, model = work
    # Without downloading: the answers name the files on the server, read after both saves.
    me, other = (gradio_client.Client(client.src, verbose=False, download_files=False) for _ in range(2))
    _, values = _load(client, write_recipe(workdir / "mine.yaml", tiny_recipe(model, data, workdir / "runs" / "a")))
    _, others = _load(client, write_recipe(workdir / "theirs.yaml", tiny_recipe(model, data, workdir / "runs" / "b")))
    _, mine = me.predict(*values, api_name="/save_recipe")
    _, theirs = other.predict(*others, api_name="/save_recipe")
    mine, theirs = Path(mine["path"]), Path(theirs["path"])
    assert mine != theirs
    assert "runs/a" in mine.read_text() and "runs/b" in theirs.read_text()


def test_gallery_recipe_goal_and_what_fits_per_gpu_size(work):
    from finetune.api import recipe_gallery
    from ui.backend import default_recipes_dir
    from ui.form import form_specs

    workdir, data, client, model = work
    keys = [s.key for s in form_specs()]
    quickstart = next(r["path"] for r in recipe_gallery(default_recipes_dir()) if r["name"] == "quickstart")
    msg, *values = client.predict(quickstart, api_name="/use_gallery_recipe")
    assert "Loaded the ready recipe: Quickstart" in msg
    assert values[keys.index("output.dir")] == str(workdir / "runs" / "quickstart")  # runs go to the runs folder
    goal = client.predict("quick test", api_name="/apply_goal")
    assert goal[keys.index("data.max_seq_len")] == 512 and goal[keys.index("training.max_steps")] == "30"
    assert goal[keys.index("model.path")] == {"__type__": "update"}  # keys the goal is not about are kept
    values[keys.index("model.path")], values[keys.index("data.path")] = str(model), str(data)
    _, table = client.predict(*values, "24 GB card (RTX 4090)", api_name="/gpu_sizes")
    assert "| 8 GB |" in table and "| 80 GB |" in table and "max_position_embeddings" in table
    msg, *_ = client.predict(str(workdir / "runs" / "none"), api_name="/use_run_recipe")
    assert "does not exist" in msg  # a previous run must be one


def test_invalid_recipe_lists_each_bad_key(work):
    workdir, data, client, model = work
    recipe = tiny_recipe(model, data, workdir / "runs" / "bad")
    recipe["training"]["learning_rate"] = -1
    recipe["adapter"]["alpah"] = 4
    msg, values = _load(client, write_recipe(workdir / "bad.yaml", recipe))
    assert "training.learning_rate" in msg and "did you mean adapter.alpha" in msg
    assert all(v == {'__type__': 'update'} for v in values)  # the form is left as it was


def test_path_outside_allowed_folders_is_refused(work):
    workdir, data, client, model = work
    _, values = _load(client, write_recipe(workdir / "o.yaml", tiny_recipe(model, data, workdir / "x")))
    msg, *_ = client.predict("/etc/passwd", *values, api_name="/use_server_file")
    assert "outside the allowed folders" in msg
    msg, path, ex1, *_ = client.predict(str(data), *values, api_name="/use_server_file")
    assert "Detected format" in msg and path == str(data)
    outside = tiny_recipe(model, data, Path("/tmp/elsewhere/run"))
    _, values = _load(client, write_recipe(workdir / "out.yaml", outside))
    msg, _ = client.predict(*values, api_name="/start")
    assert "output.dir /tmp/elsewhere/run is outside the allowed folders" in msg


def test_upload_that_is_not_a_dataset_is_refused(work):
    workdir, _, client, model = work
    _, values = _load(client, write_recipe(workdir / "u.yaml", tiny_recipe(model, workdir / "data.jsonl", workdir / "x")))
    png = workdir / "picture.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    msg, *_ = client.predict(gradio_client.handle_file(str(png)), *values, api_name="/upload_data")
    assert "not a dataset file" in msg
    garbage = workdir / "notes.jsonl"
    garbage.write_text("this is not json\nnor is this\n")
    msg, *_ = client.predict(gradio_client.handle_file(str(garbage)), *values, api_name="/upload_data")
    assert "was refused" in msg and "notes.jsonl" in msg
    assert not (workdir / "runs" / "uploads" / "notes.jsonl").exists()


def test_upload_of_a_dataset_previews_loss_tokens(work):
    workdir, data, client, model = work
    _, values = _load(client, write_recipe(workdir / "p.yaml", tiny_recipe(model, data, workdir / "x")))
    msg, path, ex1, *_ = client.predict(gradio_client.handle_file(str(data)), *values, api_name="/upload_data")
    assert "Detected format: **messages**" in msg
    assert list(ex1["color_map"]) == ["loss"]  # SFT data: no chosen/rejected/good/bad in the legend
    ex1 = ex1["value"]
    assert Path(path).parent == (workdir / "runs" / "uploads").resolve()
    loss_text = "".join(tok["token"] for tok in ex1 if tok["class_or_confidence"] == "loss")
    other_text = "".join(tok["token"] for tok in ex1 if tok["class_or_confidence"] != "loss")
    assert "0 plus 0 is 0." in loss_text and "What is 0 plus 0?" in other_text  # assistant-only loss


def _start(client, workdir: Path, name: str, recipe: dict):
    """Load `recipe` into the form and press Start; returns a function giving (state, step) of the run."""
    run_dir = Path(recipe["output"]["dir"])
    _, values = _load(client, write_recipe(workdir / f"{name}.yaml", recipe))
    msg, selected = client.predict(*values, api_name="/start")
    assert msg.startswith("Queued") and selected["value"] == str(run_dir) and [str(run_dir)] * 2 in selected["choices"]
    return lambda: status_of(client.predict(str(run_dir), api_name="/refresh")[0])


def test_train_stop_and_resume(work):
    """A long run (it never finishes within the test, however fast the machine): stop, resume, stop."""
    workdir, data, client, model = work
    run_dir = (workdir / "runs" / "long").resolve()
    status = _start(client, workdir, "long", tiny_recipe(model, data, run_dir, max_steps=100_000))
    state, step = wait_for(lambda: (s := status())[1] >= 1 and s, 180, "the first logged step")
    assert state == "running"
    assert "asked" in client.predict(str(run_dir), api_name="/stop")
    state, stopped_at = wait_for(lambda: (s := status())[0] == "stopped" and s, 120, "the run to stop")
    assert stopped_at >= 1
    assert (run_dir / "checkpoints" / f"checkpoint-{stopped_at}").is_dir(), "stopping saves a checkpoint"

    msg, _ = client.predict(str(run_dir), api_name="/resume")
    assert msg.startswith("Resuming")
    wait_for(lambda: (s := status())[0] == "running" and s[1] > stopped_at, 180, "the resumed run to go on")
    assert f"resume from {run_dir}/checkpoints/checkpoint-{stopped_at}" in (run_dir / "train.log").read_text()
    client.predict(str(run_dir), api_name="/stop")
    state, step = wait_for(lambda: (s := status())[0] == "stopped" and s, 120, "the resumed run to stop")
    steps = [r["step"] for r in RunDir(run_dir).read_metrics() if "loss" in r]
    assert steps == list(range(1, step + 1)), "each step logged once across stop and resume"


def test_finished_run_history_export_and_chat(work):
    workdir, data, client, model = work
    run_dir = (workdir / "runs" / "short").resolve()
    recipe = tiny_recipe(model, data, run_dir, max_steps=6, micro_batch_size=2, noise_scale_split_every=1)
    status = _start(client, workdir, "short", recipe)
    state, step = wait_for(lambda: (s := status())[0] == "completed" and s, 240, "the run to finish")
    assert step == 6
    fresh = gradio_client.Client(client.src, verbose=False)  # a new page: nothing drawn yet in this session
    (html, _, loss_plot, timeline, lr_plot, memory_plot, batch_text, noise_plot, advice_msg, reward_plot, rewards_text,
     grpo_plot, grpo_text, eval_text, log, queue) = fresh.predict(str(run_dir), api_name="/refresh")
    assert "run completed at step 6" in log and "GPU free" in queue
    assert loss_plot["type"] == timeline["type"] == lr_plot["type"] == memory_plot["type"] == "matplotlib"  # predicted vs measured
    # at the end: the batch panel (an sft run has no reward panel), and its advice written into the form
    assert "**2 sequences per optimizer step**" in batch_text and noise_plot["type"] == "matplotlib"
    assert reward_plot is None is grpo_plot and rewards_text == "" == grpo_text == advice_msg == eval_text  # no eval yet
    advice = RunDir(run_dir).read_results()["advice"]["settings"]
    assert f"effective batch of **{advice['training.effective_batch_size']} sequence" in batch_text
    _, values = _load(client, run_dir / "recipe.yaml")
    msg, *advised = client.predict(str(run_dir), *values, api_name="/use_advice")
    assert msg.startswith("Wrote the advice of short into the recipe form")
    from ui.form import form_specs

    keys = [s.key for s in form_specs()]
    assert advised[keys.index("training.learning_rate")] == advice["training.learning_rate"]

    rows = client.predict(api_name="/history")[0]
    assert any(row[0] == str(run_dir) and row[1] == "completed" for row in rows["data"])
    overlay = client.predict([str(run_dir)], api_name="/overlay")
    assert overlay and overlay.get("type") == "matplotlib"

    merged = workdir / "merged"
    export = client.submit(str(run_dir), str(merged), api_name="/export")
    final = export.result()
    assert any("now: [1/4] loading the base model" in update for update in export.outputs()), "progress shown"
    assert final.startswith(f"**merged model saved to {merged}**") and "done: [3/4] saving the merged model: safetensors" in final
    assert (merged / "config.json").is_file() and list(merged.glob("*.safetensors"))
    assert "outside the allowed folders" in client.predict(str(run_dir), "/root/merged", api_name="/export")
    gguf = client.submit(str(run_dir), str(workdir / "gguf"), "gguf q8_0", True, api_name="/export")
    final = gguf.result()
    assert any("now: [3/4] saving the merged model: GGUF q8_0" in update for update in gguf.outputs())
    assert f"ollama create short -f {workdir / 'gguf' / 'Modelfile'}" in final and "llama-cli -m" in final
    assert (workdir / "gguf" / "short.q8_0.gguf").is_file() and (workdir / "gguf" / "Modelfile").is_file()

    # run, second run, ask the base model too, system prompt, temperature, top-p, max new tokens, message, histories
    chat = client.submit(str(run_dir), None, True, "", 0, 1, 16, {"text": "What is 3 plus 3?", "files": []}, [], [], [],
                         api_name="/chat")
    prompt, tuned, base, second, err = chat.result()
    assert err.startswith("Answered in") and second == [] and len(chat.outputs()) > 2, "the answers stream in"
    assert [m["role"] for m in tuned] == ["user", "assistant"] == [m["role"] for m in base]
    answer = [m for m in tuned if m["role"] == "assistant"][0]["content"]
    base_answer = [m for m in base if m["role"] == "assistant"][0]["content"]
    assert answer != base_answer, "the adapter changes the answer"
