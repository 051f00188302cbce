"""The rewards a preference run logs are the ones its plots draw: the keys finetune/step/preference.py
logs (through the loop's metrics.jsonl writer, LiveFiles) are what loss.png (finetune/train/plots.py) and the UI's
reward panel (finetune.api.run_reward_report, ui/charts.py) read back, for training and held-out rows alike."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from finetune import api
from finetune.rundir import RunDir
from finetune.step.preference import PreferenceLoss, metric_means, preference_loss, synthetic_batch
from finetune.train.plots import plot_loss_curve
from finetune.train.reporting import LiveFiles
from ui import charts

VOCAB = 32


class TinyLM(torch.nn.Module):
    """Logits from an embedding: enough for sequence log-probabilities."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, VOCAB)

    def forward(self, input_ids, **_):
        return SimpleNamespace(logits=self.embed(input_ids))


def _logged_run(tmp_path, method: str) -> RunDir:
    """Three steps of `method` as the loop logs them: each step's train row, and an evaluation at each step."""
    torch.manual_seed(0)
    model, loss = TinyLM(), PreferenceLoss(method, precompute_reference=True)  # no reference forward needed
    run = RunDir(tmp_path / method)
    run.create()
    callback = LiveFiles(run, max_steps=3)
    for step in (1, 2, 3):
        loop = SimpleNamespace(state=SimpleNamespace(step=step), rank=0)
        head = {"step": step, "epoch": step / 3}
        for kind in ("train", "eval"):
            metrics: dict = {}
            batch = synthetic_batch(loss, rows=4, seq_len=6, vocab=VOCAB, device="cpu",
                                    generator=torch.Generator().manual_seed(step))
            if "ref_logps" in batch:  # a reference that differs from the policy, so rewards are not zero
                batch["ref_logps"] = torch.randn(batch["ref_logps"].shape) - 10
            with torch.no_grad():
                value = float(preference_loss(model, batch, loss, metrics=metrics))
            logs = ({**head, "loss": value, "learning_rate": 1e-3, "tokens_seen": 100 * step,
                     **metric_means(metrics)} if kind == "train" else
                    {**head, "eval_loss": value, **metric_means(metrics, "eval_")})  # the loop's evaluation rows
            callback.log(loop, logs)
    return run


def _loss_png_lines(monkeypatch, run: RunDir) -> dict[str, list[float]]:
    """label -> y values of every line plot_loss_curve draws into loss.png."""
    from matplotlib.figure import Figure

    drawn = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (drawn.append(fig), save(fig, *a, **k))[1])
    assert plot_loss_curve(run) == run.loss_plot and run.loss_plot.is_file()
    return {line.get_label(): list(line.get_ydata()) for ax in drawn[0].axes for line in ax.get_lines()
            if not line.get_label().startswith("_")}


@pytest.mark.parametrize("method", ["dpo", "orpo", "kto"])
def test_the_rewards_a_preference_run_logs_are_the_ones_its_plots_draw(tmp_path, monkeypatch, method):
    run = _logged_run(tmp_path, method)
    paired = method != "kto"  # kto's answers are not paired: no accuracy
    logged = {k for row in run.read_metrics() for k in row if "rewards" in k}
    expected = {k for k in api.REWARD_KEYS if paired or not k.endswith("accuracies")}
    assert logged == expected | {api.EVAL_PREFIX + k for k in expected}

    report = api.run_reward_report(run.root)  # the UI's reward panel
    for key in expected:
        assert [s for s, _ in report["curves"][key]["train"]] == [1, 2, 3], key
        assert [s for s, _ in report["curves"][key]["eval"]] == [1, 2, 3], key
    drawn = {line.get_label() for ax in charts.reward_figure(report).axes for line in ax.get_lines()
             if not line.get_label().startswith("_")}  # not the zero line
    assert drawn == {name for key in expected for name in (api.REWARD_KEYS[key], f"{api.REWARD_KEYS[key]}, held-out")}

    rows = run.read_metrics()
    lines = _loss_png_lines(monkeypatch, run)  # loss.png: the margin and accuracy, training and held-out
    for key in ("rewards/margins", "rewards/accuracies") if paired else ("rewards/margins",):
        label = api.REWARD_KEYS[key]
        assert lines[f"train {label}"] == pytest.approx([r[key] for r in rows if key in r])
        assert lines[f"held-out {label}"] == pytest.approx([r["eval_" + key] for r in rows if "eval_" + key in r])
    assert paired or not [label for label in lines if "accuracy" in label]
