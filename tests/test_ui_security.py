"""The UI as an attacker would call it: every handler, through its API on a live loopback app, given paths
outside the allowed folders (absolute, through `..`, through a symlink), server paths passed as uploads,
a run directory whose recipe points outside, wrong passwords by the hundred, and a share link without auth.
Each is refused with a message naming the problem, and nothing outside is read, copied or queued.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from tests.ui_support import (
    call_raw,
    form_values,
    running_app,
    set_value,
    tiny_recipe,
    write_dataset,
    write_recipe,
)
from ui.paths import NOT_PATHS, PATH_KEYS

gradio_client = pytest.importorskip("gradio_client", reason="gradio_client comes with the [ui] extra")

SECRET = "SECRET-7f3a"
REFUSED = "outside the allowed folders"
FORMS = ("absolute", "dotdot", "symlink")


def _outside_tree(outside: Path, model_dir: Path) -> None:
    """Files an attacker would like to read, each holding SECRET."""
    (outside / "secret.jsonl").write_text(json.dumps({"text": SECRET}) + "\n")
    (outside / "secret.jinja").write_text(SECRET + "{% for m in messages %}{{ m.content }}{% endfor %}")
    (outside / "model").mkdir()
    (outside / "model" / "config.json").write_text(json.dumps({"model_type": SECRET}))
    run = outside / "run"
    (run / "adapter").mkdir(parents=True)
    (run / "status.json").write_text(json.dumps({"state": SECRET, "step": 1}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0, "rewards/margins": 0.5}) + "\n")
    (run / "results.json").write_text(json.dumps({  # the run view's batch panel and its advice
        "batch": {"micro_batch_size": 1, "gradient_accumulation_steps": 1, "effective_batch_size": 1},
        "advice": {"settings": {"training.learning_rate": 1e-3}, "reason": SECRET}}))
    write_recipe(run / "recipe.yaml", tiny_recipe(model_dir, outside / "secret.jsonl", run))
    write_recipe(outside / "secret.yaml", tiny_recipe(outside / "model", outside / "secret.jsonl", outside / "r"))


@pytest.fixture(scope="module")
def site(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("ui-sec")
    allowed, outside, runs = root / "allowed", root / "outside", root / "runs"
    allowed.mkdir()
    outside.mkdir()
    _outside_tree(outside, tiny_model_dir)
    (allowed / "out-link").symlink_to(outside, target_is_directory=True)
    data = write_dataset(allowed / "data.jsonl")
    # Run directories inside the runs folder whose recipe reads a model outside / stays inside.
    for name, model in (("evil", outside / "model"), ("good", tiny_model_dir)):
        run = runs / name
        (run / "adapter").mkdir(parents=True)
        (run / "status.json").write_text(json.dumps({"state": "completed", "step": 1}))
        write_recipe(run / "recipe.yaml", tiny_recipe(model, data, run))
    with running_app(root, [allowed, tiny_model_dir]) as demo:
        client = gradio_client.Client(demo.local_url, verbose=False)
        base = form_values(tiny_recipe(tiny_model_dir, data, runs / "new"))
        yield {"root": root, "allowed": allowed, "outside": outside, "runs": runs, "client": client,
               "url": demo.local_url, "values": base, "demo": demo}


def hostile(site, name: str, form: str) -> str:
    """`outside/name` written as an absolute path, through `..` from an allowed folder, or through a symlink."""
    return {"absolute": str(site["outside"] / name),
            "dotdot": f"{site['allowed']}/../outside/{name}",
            "symlink": str(site["allowed"] / "out-link" / name)}[form]


def _refused(result, where: int = 0) -> None:
    text = json.dumps(result) if not isinstance(result, str) else result
    msg = result[where] if isinstance(result, (list, tuple)) else result
    assert REFUSED in msg, msg
    assert SECRET not in text


def _nothing_queued(site) -> None:
    assert site["demo"].run_manager.jobs() == []
    assert not (site["runs"] / ".ui" / "jobs").exists()


TARGETS = {"data.path": "secret.jsonl", "model.path": "model", "data.chat_template": "secret.jinja",
           "memory.offload_dir": "offload", "output.dir": "run2"}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("key", list(TARGETS))
def test_recipe_paths_outside_are_refused_by_preview_plan_and_start(site, key, form):
    client = site["client"]
    values = set_value(site["values"], key, hostile(site, TARGETS[key], form))
    _refused(client.predict(*values, api_name="/preview_data"))
    _refused(client.predict(*values, "12 GB card (RTX 3060)", api_name="/plan"))
    _refused(client.predict(*values, api_name="/start"))
    _nothing_queued(site)


@pytest.mark.parametrize("form", FORMS)
def test_a_data_mix_with_one_file_outside_is_refused(site, form):
    """data.path as a list (typed as YAML in its box): every file is checked, not only the first."""
    client = site["client"]
    mix = json.dumps([str(site["allowed"] / "data.jsonl"), {"path": hostile(site, "secret.jsonl", form), "weight": 1}])
    values = set_value(site["values"], "data.path", mix)
    for result in (client.predict(*values, api_name="/preview_data"),
                   client.predict(*values, "12 GB card (RTX 3060)", api_name="/plan"),
                   client.predict(*values, api_name="/start")):
        _refused(result)
        assert "data.path[1]" in (result[0] if isinstance(result, (list, tuple)) else result)
    _nothing_queued(site)


def test_chat_template_file_is_not_shown_by_the_preview(site):
    """The reported leak: data.chat_template as a path to a file outside, shown by the data preview."""
    values = set_value(site["values"], "data.chat_template", "/etc/passwd")
    msg, *examples = site["client"].predict(*values, api_name="/preview_data")
    assert "data.chat_template /etc/passwd is " + REFUSED in msg and "root:" not in json.dumps(examples)


@pytest.mark.parametrize("form", FORMS)
def test_server_file_picker_refuses_outside(site, form):
    _refused(site["client"].predict(hostile(site, "secret.jsonl", form), *site["values"], api_name="/use_server_file"))


@pytest.mark.parametrize("form", FORMS)
def test_run_views_refuse_a_run_outside(site, form):
    client, run = site["client"], hostile(site, "run", form)
    _refused(client.predict(run, api_name="/resume"))
    _refused(client.predict(run, api_name="/stop"))
    html, *_ = client.predict(run, api_name="/refresh")
    assert REFUSED in html and SECRET not in html
    with pytest.raises(Exception, match=f"{REFUSED}|is not in the list of choices"):  # gradio checks choices first
        client.predict([run], api_name="/overlay")
    _refused(client.predict(run, str(site["allowed"] / "merged"), api_name="/export"))
    _refused(client.predict(run, None, True, "", 0, 1, 8, {"text": "hello", "files": []}, [], [], [],
                            api_name="/chat"), where=4)
    _refused(client.predict(run, *site["values"], api_name="/use_advice"))
    panels = client.predict(run, api_name="/run_view")  # the batch and rewards panels stay empty
    assert SECRET not in json.dumps(panels) and all(p in ("", None) for p in panels)
    _nothing_queued(site)
    assert not (site["allowed"] / "merged").exists()


def test_a_run_whose_recipe_reads_outside_is_refused(site):
    """A run directory inside the runs folder is fine, but resume, chat and export load its recipe's model."""
    client, evil = site["client"], str(site["runs"] / "evil")
    for result, where in ((client.predict(evil, api_name="/resume"), 0),
                          (client.predict(evil, str(site["allowed"] / "merged"), api_name="/export"), 0),
                          (client.predict(evil, None, True, "", 0, 1, 8, {"text": "hello", "files": []}, [], [], [],
                                          api_name="/chat"), 4)):
        msg = result[where] if isinstance(result, (list, tuple)) else result
        assert "model.path" in msg and REFUSED in msg
    _nothing_queued(site)


@pytest.mark.parametrize("form", FORMS)
def test_export_target_outside_is_refused(site, form):
    out = hostile(site, "merged", form)
    _refused(site["client"].predict(str(site["runs"] / "good"), out, api_name="/export"))
    assert not (site["outside"] / "merged").exists()


@pytest.mark.parametrize("api_name", ["load_recipe", "upload_data"])
@pytest.mark.parametrize("name", ["secret.yaml", "secret.jsonl"])
def test_server_paths_sent_as_uploads_are_refused(site, api_name, name):
    """A raw API call (gradio_client would upload the file itself) naming a server file as the upload."""
    from gradio.utils import get_upload_folder

    extra = site["values"] if api_name == "upload_data" else []
    for path in (str(site["outside"] / name), f"{get_upload_folder()}/../../{site['outside']}/{name}"):
        reply = call_raw(site["url"], api_name, [{"path": path, "meta": {"_type": "gradio.FileData"}}, *extra])
        assert "event: error" in reply and SECRET not in reply
    assert not (site["runs"] / "uploads" / name).exists()


@pytest.fixture
def backend(tmp_path, monkeypatch):
    """A Backend with Gradio's upload folder moved into tmp_path (so the test can plant files there)."""
    from ui.backend import Backend, UISettings
    from ui.runs import RunManager

    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "gradio"))
    (tmp_path / "gradio" / "abc").mkdir(parents=True)
    (tmp_path / "allowed").mkdir()
    (tmp_path / "outside").mkdir()
    return Backend(UISettings([tmp_path / "allowed"], tmp_path / "runs"), RunManager(tmp_path / "runs"))


def test_upload_handlers_take_files_only_from_the_upload_cache(backend, tmp_path):
    """Even past Gradio's own check: a server path, or a symlink in the cache leading out, is refused."""
    from ui.paths import PathNotAllowed, store_upload

    secret = tmp_path / "outside" / "secret.yaml"
    secret.write_text(yaml.safe_dump({"model": {"path": SECRET}, "data": {"path": "d.jsonl"}}))
    (tmp_path / "outside" / "secret.jsonl").write_text(json.dumps({"text": SECRET}) + "\n")
    link = tmp_path / "gradio" / "abc" / "link.yaml"
    link.symlink_to(secret)
    for path in (secret, link, tmp_path / "gradio" / "abc" / ".." / ".." / "outside" / "secret.yaml"):
        with pytest.raises(PathNotAllowed, match="was not uploaded through the page"):
            backend.load_upload(str(path))
    with pytest.raises(PathNotAllowed, match="was not uploaded through the page"):
        store_upload(tmp_path / "outside" / "secret.jsonl", tmp_path / "runs" / "uploads")
    assert not (tmp_path / "runs" / "uploads").exists()
    good = tmp_path / "gradio" / "abc" / "r.yaml"
    good.write_text(secret.read_text())
    name, values = backend.load_upload(str(good))
    assert name == "r.yaml" and SECRET in values


def test_a_binary_or_huge_recipe_upload_is_a_message(backend, tmp_path):
    from finetune.errors import RecipeError

    upload = tmp_path / "gradio" / "abc" / "bin.yaml"
    upload.write_bytes(b"model:\n  path: \xff\xfe\n")
    with pytest.raises(RecipeError, match=r"bin.yaml is not a text file \(byte 15 is not UTF-8\)"):
        backend.load_upload(str(upload))
    big = tmp_path / "gradio" / "abc" / "big.yaml"
    big.write_text("# padding\n" * 200_000)
    with pytest.raises(RecipeError, match=r"big.yaml is 2,000,000 bytes: a recipe is at most 1,048,576"):
        backend.load_upload(str(big))


def test_a_yaml_alias_bomb_upload_is_refused_fast(backend, tmp_path):
    from finetune.errors import RecipeError

    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]"
                                                     for i in range(1, 10)]
    upload = tmp_path / "gradio" / "abc" / "bomb.yaml"
    upload.write_text("\n".join(lines) + "\n")
    start = time.perf_counter()
    with pytest.raises(RecipeError):
        backend.load_upload(str(upload))
    assert time.perf_counter() - start < 1


def test_model_sources_that_are_not_server_paths(tmp_path):
    """A hub id, a pkg: file inside its package and a random: folder inside the allowed ones are allowed; a pkg:
    path leaving its package and a random: folder outside are not."""
    from finetune.errors import FinetuneError
    from finetune.recipe.load import validate_recipe
    from ui.paths import PathNotAllowed, check_recipe_paths

    roots = [tmp_path.resolve()]

    def check(model: str) -> None:
        check_recipe_paths(validate_recipe({"model": {"path": model}, "data": {"path": str(tmp_path / "d.jsonl")},
                                            "output": {"dir": str(tmp_path / "run")}}), roots)

    check("Qwen/Qwen2.5-0.5B")
    check("pkg:json/decoder.py")
    check(f"random:{tmp_path / 'config-only'}")
    for bad in ("pkg:json/../../../../etc/passwd", "pkg:json//etc/passwd", "/etc", "../../etc", "random:/etc",
                f"random:{tmp_path}/../../etc"):
        with pytest.raises(PathNotAllowed):
            check(bad)
    with pytest.raises(FinetuneError, match="NUL"):  # refused by the schema before any path is resolved
        check(str(tmp_path / "a\0b"))


def test_every_path_valued_recipe_key_is_checked():
    """A new string key in the schema must be sorted into PATH_KEYS (checked) or NOT_PATHS (not a path)."""
    from finetune.recipe.load import iter_fields

    string_keys = {key for key, field, section in iter_fields() if not section and "str" in repr(field.annotation)}
    assert string_keys == set(PATH_KEYS) | set(NOT_PATHS)


def test_wrong_passwords_are_rate_limited(tmp_path, monkeypatch):
    import httpx

    from tests.ui_support import free_port
    from ui import login
    from ui.app import launch

    monkeypatch.setattr(login, "FIRST_LOCK_S", 0.2)
    monkeypatch.setattr(login, "MAX_LOCK_S", 1.0)
    demo = launch(port=free_port(), auth=("alice", "s3cret"), allow_dirs=[tmp_path], runs_dir=tmp_path / "runs",
                  block=False)
    try:
        with httpx.Client(base_url=demo.local_url, timeout=10) as http:
            codes = [http.post("login", data={"username": "alice", "password": f"guess{i}"}).status_code
                     for i in range(200)]
            assert codes[:login.FREE_TRIES] == [400] * login.FREE_TRIES
            assert codes.count(429) >= 150 and set(codes) == {400, 429}
            assert demo.login_guard.checked < 40, "most guesses were refused without being checked"
            guard = demo.login_guard
            time.sleep(guard.retry_after("127.0.0.1") + 0.05)
            assert http.post("login", data={"username": "alice", "password": "again"}).status_code == 400
            locked = http.post("login", data={"username": "alice", "password": "s3cret"})
            assert locked.status_code == 429, "even the right password waits out the lockout"
            assert "too many failed logins: try again in 1 s" in locked.json()["detail"]
            other = httpx.Client(base_url=demo.local_url, timeout=10,
                                 transport=httpx.HTTPTransport(local_address="127.0.0.2"))
            with other:  # the lockout is per client address: the owner elsewhere still gets in
                assert other.post("login", data={"username": "alice", "password": "s3cret"}).status_code == 200
            time.sleep(guard.retry_after("127.0.0.1") + 0.05)
            assert http.post("login", data={"username": "alice", "password": "s3cret"}).status_code == 200
    finally:
        demo.run_manager.close()
        demo.close()


# The page, the run-history page and every config/info/schema route gradio serves.
BEFORE_LOGIN = ("", "?deep_link=x", "gradio_api/runs", "config", "gradio_api/info",
                "gradio_api/info?all_endpoints=true", "gradio_api/openapi.json", "manifest.json",
                "gradio_api/startup-events", "gradio_api/user", "gradio_api/token", "gradio_api/app_id")


def test_nothing_about_the_servers_files_before_login(tmp_path):
    """Gradio's login page embeds the API description, whose choices and defaults name the files in the
    allowed folders, the ready recipes and the runs folder: without a session none of it is shown; after
    login the page and its config still carry them."""
    import httpx

    from tests.ui_support import free_port
    from ui.app import launch

    allowed, runs = tmp_path / "allowed-7c1e", tmp_path / "runs-7c1e"
    allowed.mkdir()
    write_dataset(allowed / "private-notes.jsonl")
    demo = launch(port=free_port(), auth=("alice", "s3cret"), allow_dirs=[allowed], runs_dir=runs, block=False)
    secrets = [str(allowed), "private-notes", str(runs), str(Path("recipes").resolve()), "quickstart"]
    try:
        with httpx.Client(base_url=demo.local_url, timeout=30) as http:
            for route in BEFORE_LOGIN:
                text = http.get(route).text
                leaked = [s for s in secrets if s in text]
                assert not leaked, f"GET /{route} before login shows {leaked}"
            assert "auth_required" in http.get("").text, "the login page is still served"
            assert http.post("login", data={"username": "alice", "password": "s3cret"}).status_code == 200
            page, config = http.get(""), http.get("config")
            assert config.status_code == 200 and "components" in config.json()
            assert str(allowed / "private-notes.jsonl") in page.text, "after login the API description is whole"
            assert str(Path("recipes").resolve()) in page.text
    finally:
        demo.run_manager.close()
        demo.close()


@pytest.mark.parametrize("value", ["True", "true", "1"])
def test_share_link_without_auth_refuses_to_start(monkeypatch, capsys, tmp_path, value):
    from ui.app import AUTH_ENV, main

    monkeypatch.delenv(AUTH_ENV, raising=False)
    monkeypatch.setenv("GRADIO_SHARE", value)

    def no_launch(*args, **kwargs):  # if the refusal ever regresses, fail fast instead of serving forever
        raise AssertionError("the UI started serving with a share link and no login")

    monkeypatch.setattr("gradio.Blocks.launch", no_launch)
    assert main(["--port", "1", "--runs-dir", str(tmp_path / "runs")]) == 2
    assert "refusing to publish the UI through a Gradio share link (GRADIO_SHARE)" in capsys.readouterr().err


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "192.168.1.20", "my-host.local"])
def test_network_hosts_without_auth_refuse_to_start(monkeypatch, capsys, tmp_path, host):
    from ui.app import AUTH_ENV, main

    monkeypatch.delenv(AUTH_ENV, raising=False)
    assert main(["--host", host, "--port", "1", "--runs-dir", str(tmp_path / "runs")]) == 2
    assert f"refusing to listen on {host} without authentication" in capsys.readouterr().err
