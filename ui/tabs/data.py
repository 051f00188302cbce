"""Data tab: pick a server file or upload a dataset, and preview examples as the model sees them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gradio as gr

from finetune.errors import FinetuneError, RecipeError
from ui import views
from ui.backend import Backend
from ui.form import to_widget
from ui.paths import allowed_path, data_files, is_inside, store_upload
from ui.tabs.messages import first_steps, problems_markdown, reported

FIRST_STEPS = "No data file yet: choose a ready recipe in the Recipe tab, or pick or upload a file above."
EXAMPLES = 3  # examples previewed
THUMBNAIL = 160  # pixels: the longer side of an image shown beside its example
# Categories of highlighted tokens: loss tokens of SFT data, and of each answer of preference data.
CHOSEN, REJECTED, GOOD, BAD = "chosen answer (loss)", "rejected answer (loss)", "good answer (loss)", "bad answer (loss)"
COLORS = {"loss": "#f4a261", CHOSEN: "#2a9d8f", REJECTED: "#e76f51", GOOD: "#2a9d8f", BAD: "#e76f51"}


def highlighted(example: dict) -> list[tuple[str, str | None]]:
    """An example's tokens as (text, category): loss tokens of SFT data; a preference pair's chosen sequence,
    then its rejected one (below a divider), each answer's loss tokens in its own colour; a kto answer as good
    or bad."""
    if "rejected_tokens" in example:
        return ([(tok, CHOSEN if loss else None) for tok, loss in example["tokens"]]
                + [("\n\n── rejected ──\n\n", None)]
                + [(tok, REJECTED if loss else None) for tok, loss in example["rejected_tokens"]])
    category = "loss" if "label" not in example else GOOD if example["label"] else BAD
    return [(tok, category if loss else None) for tok, loss in example["tokens"]]


def example_update(example: dict | None) -> dict:
    """One preview box: the highlighted tokens, with a legend of only the categories they use (SFT data shows
    "loss", not the chosen/rejected colours of preference data)."""
    tokens = highlighted(example) if example else []
    used = {category for _, category in tokens if category}
    return gr.update(value=tokens, color_map={k: color for k, color in COLORS.items() if k in used})


def thumbnails(example: dict | None, roots: list[Path]) -> list[tuple[Any, str]]:
    """(thumbnail, caption) of each image of a previewed example (vision-language data), in order: small copies
    made here, so the page never serves the data's own files; an image outside the allowed folders is named,
    not shown."""
    from PIL import Image

    out = []
    for i, path in enumerate((example or {}).get("images", []), 1):
        if not is_inside(Path(path), roots):
            out.append((Image.new("RGB", (THUMBNAIL, THUMBNAIL // 4), "white"),
                        f"image {i}: outside the allowed folders, not shown"))
            continue
        try:
            with Image.open(path) as image:
                small = image.convert("RGB")
                small.thumbnail((THUMBNAIL, THUMBNAIL))
        except (OSError, ValueError) as exc:  # its header was fine (the data checks), its pixels are not
            out.append((Image.new("RGB", (THUMBNAIL, THUMBNAIL // 4), "white"), f"image {i}: unreadable ({exc})"))
            continue
        out.append((small, f"image {i}: {Path(path).name} ({image.width}x{image.height})"))
    return out


def gallery_update(example: dict | None, roots: list[Path]) -> dict:
    """One example's image strip: shown only for an example with images."""
    shown = thumbnails(example, roots)
    return gr.update(value=shown or None, visible=bool(shown))


def build(backend: Backend, widgets: list[gr.components.Component]) -> gr.Dropdown:
    """The Data tab over the form `widgets` (it fills data.path, a text box: its own change refreshes the recipe
    tab's views; a picked file replaces a list of files there); returns the server file picker."""
    keys = [s.key for s in backend.specs]
    with gr.Tab("Data", id="data") as data_tab:
        gr.Markdown("Pick a dataset on the server (inside the allowed folders) or upload one; the "
                    "preview tokenizes with the recipe's model and highlights tokens that carry loss "
                    "(preference data: the chosen answer, then the rejected one).")
        with gr.Row():
            # No file until one is picked (a dropdown otherwise shows its first choice as if chosen)
            server_file = gr.Dropdown(choices=data_files(backend.settings.allow_dirs), value=None,
                                      allow_custom_value=True, label="Server file", elem_id="server-file", scale=3,
                                      info="a dataset inside the allowed folders")
            use_file_btn = gr.Button("Use this file", elem_id="use-file", scale=1)
        data_upload = gr.File(label="Upload a dataset (.json, .jsonl, .csv, .parquet)", elem_id="data-upload",
                              height=140)
        preview_btn = gr.Button("Preview data", elem_id="preview-data")
        data_msg = gr.Markdown(elem_id="data-message")
        examples, galleries = [], []
        for i in range(EXAMPLES):
            with gr.Row():
                examples.append(gr.HighlightedText(label=f"example {i + 1}", show_legend=True, scale=4,
                                                   show_inline_category=False, combine_adjacent=True,
                                                   elem_id=f"example-{i}"))
                galleries.append(gr.Gallery(label=f"example {i + 1}: images", visible=False, scale=1,
                                            columns=2, height=THUMBNAIL + 60, elem_id=f"example-images-{i}"))
        previewed = gr.State(None)  # the form values last previewed when the tab opened
    data_path = widgets[keys.index("data.path")]
    path_spec = backend.specs[keys.index("data.path")]

    def path_text(path: Path) -> str:
        """The data.path widget's text for one file (a YAML value: the list of a mix is typed there)."""
        return to_widget(path_spec, str(path))

    def with_data_path(values, path):
        values = list(values)
        values[keys.index("data.path")] = path_text(path)
        return values

    def show_preview(values) -> tuple:
        found, bad = backend.preview(values, EXAMPLES)
        padded = [*found, *[None] * EXAMPLES][:EXAMPLES]
        shown = [example_update(ex) for ex in padded]
        images = [gallery_update(ex, backend.settings.roots) for ex in padded]
        return (views.preview_markdown(found, bad), *shown, *images)

    shows = 2 * EXAMPLES  # outputs after the message: the examples' tokens, then their images

    @reported(2 + shows)
    def use_server_file(path, *values):
        chosen = allowed_path(path, backend.settings.allow_dirs, "data file", must_exist=True)
        try:
            msg, *shown = show_preview(with_data_path(values, chosen))
        except FinetuneError as exc:
            msg, shown = problems_markdown(exc), [gr.skip()] * shows
        return (msg, path_text(chosen), *shown)

    use_file_btn.click(use_server_file, [server_file, *widgets], [data_msg, data_path, *examples, *galleries],
                       api_name="use_server_file")

    @reported(2 + shows)
    def uploaded(path, *values):
        if not path:
            return (gr.skip(),) * (2 + shows)
        stored = store_upload(path, backend.settings.runs_dir / "uploads")
        try:
            msg, *shown = show_preview(with_data_path(values, stored))
        except FinetuneError as exc:
            stored.unlink(missing_ok=True)
            raise FinetuneError(f"{Path(path).name} was refused: it is not a dataset this recipe can read",
                                [str(exc)]) from None
        return (msg, path_text(stored), *shown)

    data_upload.upload(uploaded, [data_upload, *widgets], [data_msg, data_path, *examples, *galleries],
                       api_name="upload_data")
    preview_btn.click(reported(1 + shows)(lambda *v: show_preview(v)), widgets, [data_msg, *examples, *galleries],
                      api_name="preview_data")

    @reported(2 + shows)
    def opened(last, *values):
        """The tab opened: preview the form's data file without a click, once per recipe (a ready recipe names
        one), or say what to do first; the same recipe again keeps what is shown."""
        key = json.dumps(values, default=str)
        if key == last:
            return (gr.skip(),) * (2 + shows)
        try:
            return (*show_preview(values), key)
        except RecipeError as exc:
            if (hint := first_steps(exc, FIRST_STEPS)) is None:
                raise
            return (hint, *[example_update(None)] * EXAMPLES, *[gallery_update(None, [])] * EXAMPLES, key)

    data_tab.select(opened, [previewed, *widgets], [data_msg, *examples, *galleries, previewed],
                    api_visibility="private")
    return server_file
