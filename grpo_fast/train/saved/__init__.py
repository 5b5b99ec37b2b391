"""The top of the trainer, over what a run saved: it imports the TrainConfig and the stages, and only the loop and
the command line import it.

    checkpoint   checkpoints (atomic, newest kept), resume_point and the one "no checkpoint" error
    export       `grpo-fast export`: a run's newest checkpoint as a Hugging Face folder; the final export to model/
    eval_command `grpo-fast eval`: a run's checkpoint or a model folder on held-out problems
    generate     `grpo-fast generate`: a run's model (or a model folder) answers a prompt, as the run samples
"""
