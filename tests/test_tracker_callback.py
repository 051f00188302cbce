"""The Trainer callback puts the measured peak (CPU: tracker, with breakdown) into every log."""

from __future__ import annotations

import torch


def test_trainer_logs_peak_memory(tiny_model_dir, tmp_path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from finetune.memory.tracker_callback import PeakMemoryCallback

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (4, 32)).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    callback = PeakMemoryCallback(predicted_peak_bytes=1)  # any real peak is above 1 byte: must warn
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, logging_steps=1,
                             report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True)
    captured: list[dict] = []

    class MetricsWriter(TrainerCallback):  # stands for the metrics.jsonl writer, which runs after ours
        def on_log(self, args, state, control, logs=None, **kwargs):
            if "loss" in logs:
                captured.append(dict(logs))

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback, MetricsWriter()])
    trainer.train()
    logs = captured
    assert len(logs) == 2
    first = logs[0]
    params = sum(p.numel() * 4 for p in model.parameters())
    assert first["peak_memory_bytes"] > params  # weights plus activations
    breakdown = first["peak_memory_breakdown"]
    assert breakdown["trainable_weights"] == params
    assert sum(breakdown.values()) == first["peak_memory_bytes"]
    assert "memory_warning" in first
    assert torch.utils._python_dispatch._get_current_dispatch_mode() is None  # tracker left after training
