"""The run's services: what a run writes, how it stops, resumes, evaluates and exports.

    checkpoint   checkpoints (atomic, newest kept), resume_point and the one "no checkpoint" error
    record       metrics.jsonl / eval.jsonl / completions.jsonl, curves.png, the step's metrics line
    tracking     TensorBoard, Weights & Biases, Trackio (`report_to`)
    evaluate     held-out accuracy and pass@k (HeldOut: the evaluations during a run)
    eval_command `grpo-fast eval`: a run's checkpoint or a model folder on held-out problems
    export       the policy as a Hugging Face folder (`grpo-fast export`)
    signals      Ctrl-C / SIGTERM between steps, never inside one
    atomic       atomic_folder: every folder the run writes, whole or not at all
    errors       RunError, the one-line failure of a run
"""
