"""What every stage of a run may use: how a run writes, stops and fails, what it records, and the model folder it
exports. Nothing here imports the TrainConfig or a stage above it; the checkpoints, the export and `grpo-fast eval`
that read them sit above, in grpo_fast.train.saved.

    config       RunConfig: the config section `run`
    atomic       atomic_folder: every folder the run writes, whole or not at all
    signals      Ctrl-C / SIGTERM between steps, never inside one
    errors       RunError, the one-line failure of a run
    record       metrics.jsonl / eval.jsonl / completions.jsonl, curves.png, the step's metrics line
    tracking     TensorBoard, Weights & Biases, Trackio (`report_to`)
    evaluate     held-out accuracy and pass@k (HeldOut: the evaluations during a run)
    model_folder a Hugging Face folder of the policy (adapters merged), written whole
    quiet        what a grpo-fast process prints besides its results: dependencies' noise dropped
"""
