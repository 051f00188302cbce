"""Plots people would rather see than read: the loss and learning-rate curves of a run, and for preference
methods (dpo, orpo, simpo, cpo, kto) the reward margin and accuracy of chosen over rejected below them."""

from __future__ import annotations

from pathlib import Path

from finetune.rundir import EVAL_PREFIX, REWARD_ACCURACY, REWARD_KEYS, REWARD_MARGIN, RunDir


def plot_loss_curve(run: RunDir) -> Path | None:
    """Write the run's loss.png: loss (and eval loss) against step, the learning rate on a second axis, and
    below it the gradient noise scale when one was measured; None if no loss was logged."""
    rows = run.read_metrics()
    train = [r for r in rows if "loss" in r]
    if not train:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    noise = [r for r in train if r.get("gns")]
    rewards = [r for r in rows if REWARD_MARGIN in r or EVAL_PREFIX + REWARD_MARGIN in r]
    if noise or rewards:  # panels below the loss: reward margins (preference methods), the noise scale
        panels = 1 + bool(rewards) + bool(noise)
        fig, axes = plt.subplots(panels, 1, figsize=(7, 3 + 2 * panels), dpi=100, sharex=True,
                                 height_ratios=(2, *[1] * (panels - 1)))
        ax, below = axes[0], list(axes[1:])
        if rewards:
            _plot_rewards(below.pop(0), rewards)
        if noise:
            gns_ax = below.pop(0)
            gns_ax.plot([r["step"] for r in noise], [r["gns"] for r in noise], color="tab:green")
            gns_ax.set_yscale("log")
            gns_ax.set_ylabel("noise scale (tokens)")
            gns_ax.set_xlabel("step")
            gns_ax.grid(alpha=0.3)
    else:
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss", color="tab:blue")
    evals = [r for r in rows if "eval_loss" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss", color="tab:orange")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    lr_ax = ax.twinx()
    lr_ax.plot([r["step"] for r in train], [r.get("learning_rate") or 0 for r in train], color="tab:gray",
               alpha=0.5, linestyle="--", label="learning rate")
    lr_ax.set_ylabel("learning rate")
    lines = ax.get_legend_handles_labels()[0] + lr_ax.get_legend_handles_labels()[0]
    ax.legend(lines, [line.get_label() for line in lines], loc="upper right")
    ax.set_title(run.root.name)
    fig.tight_layout()
    out_path = run.loss_plot
    tmp = out_path.with_name(f".{out_path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(out_path)
    return out_path


def _plot_rewards(ax, rows: list[dict]) -> None:
    """Reward margin (chosen minus rejected) and accuracy (chosen above rejected), training and held-out."""
    acc_ax = None
    for prefix, style, color, what in (("", "", "tab:green", "train"), (EVAL_PREFIX, "o", "tab:red", "held-out")):
        margins = [r for r in rows if prefix + REWARD_MARGIN in r]
        if margins:
            ax.plot([r["step"] for r in margins], [r[prefix + REWARD_MARGIN] for r in margins], style + "-", color=color,
                    label=f"{what} {REWARD_KEYS[REWARD_MARGIN]}")
        accuracy = [r for r in rows if prefix + REWARD_ACCURACY in r]
        if accuracy:  # not kto: its answers are not paired
            acc_ax = acc_ax or ax.twinx()
            acc_ax.plot([r["step"] for r in accuracy], [r[prefix + REWARD_ACCURACY] for r in accuracy],
                        style + "--", color=color, alpha=0.4, label=f"{what} {REWARD_KEYS[REWARD_ACCURACY]}")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("reward margin")
    lines = ax.get_legend_handles_labels()[0]
    if acc_ax is not None:
        acc_ax.set_ylim(0, 1)
        acc_ax.set_ylabel("chosen > rejected")
        lines += acc_ax.get_legend_handles_labels()[0]
    ax.legend(lines, [line.get_label() for line in lines], loc="upper left", fontsize=7)
