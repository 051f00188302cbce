"""The web UI (`finetune ui`): a Gradio page over the same recipe, planner, CLI and run directories."""
