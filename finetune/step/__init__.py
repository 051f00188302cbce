"""The training step (`training_step`: one micro-batch forward + backward, one optimizer update) and the
preference losses it computes (`preference`).

Why a package of its own in the build layer (beside model/, data/, memory/, optim/; tests/test_import_graph.py):
`finetune run`'s loop (train/), `finetune measure` and the planner's meta trace (plan/trace.py) all call this
one step, so it must sit below plan/: under train/ the planner's import of it would point up. It is not a
memory saver either (memory/ holds those; the step composes them).
"""
