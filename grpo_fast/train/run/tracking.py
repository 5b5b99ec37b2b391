"""Experiment trackers for a run's metrics (the config key `report_to`): TensorBoard, Weights & Biases, Trackio.

None by default. Each tracker's package is optional and imported only when the run names it; metrics.jsonl,
eval.jsonl and completions.jsonl stay the run's record either way."""
import math
import numbers
import os
import uuid
from importlib.util import find_spec

TRACKERS = ("tensorboard", "wandb", "trackio")   # each one's package, and grpo-fast's extra, has its name
PROJECT = "grpo-fast"
WANDB_ID_FILE = "wandb_run_id.txt"


def check_report_to(names: list[str]) -> None:
    """Raises ValueError for an unknown tracker in `names`, one named twice, or one whose package is not installed.

    Cheap enough for config time: it only looks the packages up (find_spec), it imports none."""
    for index, name in enumerate(names):
        if name not in TRACKERS:
            raise ValueError(f"report_to: unknown tracker {name!r}; the known ones are {', '.join(TRACKERS)}")
        if name in names[:index]:
            raise ValueError(f"report_to names {name!r} twice: {names!r}")
        if find_spec(name) is None:
            raise ValueError(f"report_to names {name!r}, but its package is not installed: "
                             f"`pip install {name}` (or grpo-fast[{name}])")


def _scalars(values: dict, prefix: str) -> dict:
    """The finite numbers of `values` (bools as 0/1) as floats under prefix + key; "step" is left out, being the
    x-axis itself."""
    return {prefix + key: float(value) for key, value in values.items()
            if key != "step" and isinstance(value, numbers.Real) and math.isfinite(value)}


def _markdown_cell(value) -> str:
    """A value as one cell of a markdown table: pipes escaped, line breaks as <br>."""
    return str(value).replace("|", "\\|").replace("\r\n", "\n").replace("\n", "<br>")


class Trackers:
    """The run's experiment trackers; every method does nothing when names is empty or is_main is False.

    output_dir: the run's folder (TensorBoard's events go to tensorboard/ in it, wandb's files to wandb/);
    hyperparameters: the run's settings as a plain dict (the TrainConfig's), recorded by wandb and Trackio;
    resumed_step: the checkpoint's step when the run resumes, so the trackers continue the same run and TensorBoard
    drops the steps after it, which are redone."""

    def __init__(self, names: list[str], output_dir: str, hyperparameters: dict, is_main: bool = True,
                 resumed_step: int | None = None):
        self.names = list(names) if is_main else []   # only the main process reports: the metrics cover all ranks
        self._tensorboard = self._wandb = self._trackio = None
        run_name = os.path.basename(os.path.normpath(output_dir))
        if "tensorboard" in self.names:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard hides the events the earlier session wrote at this step and after
            self._tensorboard = SummaryWriter(os.path.join(output_dir, "tensorboard"),
                                              purge_step=None if resumed_step is None else resumed_step + 1)
        if "wandb" in self.names:
            import wandb

            id_file = os.path.join(output_dir, WANDB_ID_FILE)
            if resumed_step is not None and os.path.isfile(id_file):
                with open(id_file) as f:
                    run_id = f.read().strip()
            else:
                run_id = uuid.uuid4().hex[:12]             # wandb's ids: lowercase letters and digits
                os.makedirs(output_dir, exist_ok=True)
                with open(id_file, "w") as f:
                    f.write(run_id + "\n")
            # Offline unless the user chose a mode: a run must not stall on a machine without network or login
            mode = {} if "WANDB_MODE" in os.environ else {"mode": "offline"}
            self._wandb = wandb.init(project=PROJECT, name=run_name, dir=output_dir, config=hyperparameters, id=run_id,
                                     resume="allow", **mode)
        if "trackio" in self.names:
            import trackio

            # Trackio keeps its runs in its own folder (TRACKIO_DIR, else ~/.cache/huggingface/trackio), by name
            trackio.init(project=PROJECT, name=run_name, config=hyperparameters,
                         resume="never" if resumed_step is None else "allow")
            self._trackio = trackio

    def log(self, scalars: dict, step: int, prefix: str = "") -> None:
        """Records each finite number of `scalars` under prefix + key at `step` (non-numbers, NaN and inf are
        left out)."""
        if not self.names:
            return
        values = _scalars(scalars, prefix)
        if self._tensorboard is not None:
            for tag, value in values.items():
                self._tensorboard.add_scalar(tag, value, step)
        if values and self._wandb is not None:
            self._wandb.log(values, step=step)
        if values and self._trackio is not None:
            self._trackio.log(values, step=step)

    def log_completions(self, step: int, rows: list[dict]) -> None:
        """Records a sample of completions, rows of {"prompt", "completion", "reward"}: a markdown table in
        TensorBoard's text tab, a table named "completions" in wandb and Trackio."""
        if not self.names or not rows:
            return
        columns = ["prompt", "completion", "reward"]
        data = [[row["prompt"], row["completion"], float(row["reward"])] for row in rows]
        if self._tensorboard is not None:
            lines = ["| reward | prompt | completion |", "| --- | --- | --- |"]
            lines += [f"| {reward:.4g} | {_markdown_cell(prompt)} | {_markdown_cell(completion)} |"
                      for prompt, completion, reward in data]
            self._tensorboard.add_text("completions", "\n".join(lines), step)
        if self._wandb is not None:
            import wandb

            self._wandb.log({"completions": wandb.Table(columns=columns, data=data)}, step=step)
        if self._trackio is not None:
            self._trackio.log({"completions": self._trackio.Table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        """Writes out what the trackers hold and ends their runs; the object logs nothing after it."""
        if self._tensorboard is not None:
            self._tensorboard.flush()
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._trackio is not None:
            self._trackio.finish()
        self._tensorboard = self._wandb = self._trackio = None
        self.names = []
