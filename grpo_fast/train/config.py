"""The trainer's configuration: `TrainConfig`, one section per stage of a run, read from a YAML file nested by
section and `--key value` overrides, checked once.

    policy        the model trained, its dtype and memory options, LoRA       grpo_fast.train.policy
    data          the prompts: a built-in task or a dataset on disk           grpo_fast.train.tasks.config
    rollout       completions per step, the engine, sampling                  grpo_fast.train.rollout.config
    correction    the rollout correction of the engine's numerics / staleness grpo_fast.train.update.config
    scoring       reward functions and advantages                             grpo_fast.train.update.config
    loss          a grpo_fast.LossConfig: every loss type (GSPO: importance_sampling_level sequence)
    optimization  the optimizer, the schedule, updates per rollout            grpo_fast.train.update.config
    batching      micro-batches, packing, shared prompts                      grpo_fast.train.update.config
    warm_start    supervised steps before GRPO                                grpo_fast.train.update.config
    evaluation    held-out problems                                           grpo_fast.train.tasks.config
    distribution  DDP or FSDP2 under torchrun                                 grpo_fast.train.distributed
    run           steps, seed, the output folder, checkpoints, trackers       grpo_fast.train.run.config

Each section is a dataclass whose fields are declared and checked with grpo_fast.fields, in its own module (the
loss section is the library's LossConfig, declared the same way, with the same defaults); this module composes
them, checks what spans sections, and maps the keys: every key is named on the command line by its field name
alone (`--temperature 0.7`) or with its section (`--rollout.temperature 0.7`). The one name two
sections share, max_completion_length, is the rollout's (tokens sampled); the loss's dr_grpo normalizer is
`loss.max_completion_length`: unset (None), each step's completion budget (its stage's length); a value given is
kept, whatever it equals.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
import typing
import warnings
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from grpo_fast.fields import Rule, hints, one_of, type_name
from grpo_fast.train import keys
from grpo_fast.train.distributed import DistributionConfig, check_data_groups, check_sequence_parallel
from grpo_fast.train.policy import PolicyConfig
from grpo_fast.train.qlora import check_4bit
from grpo_fast.train.rollout.config import RolloutConfig, length_stages
from grpo_fast.train.run.config import RunConfig
from grpo_fast.train.tasks.config import TASKS, DataConfig, EvaluationConfig, check_split
from grpo_fast.train.update.config import (
    BatchingConfig,
    CorrectionConfig,
    LossSection,
    OptimizationConfig,
    ScoringConfig,
    WarmStartConfig,
)
from grpo_fast.train.update.correction import IS_MODES
from grpo_fast.train.update.optimizer import check_optimizer
from grpo_fast.variants import LossConfig

SECTIONS = {"policy": PolicyConfig, "data": DataConfig, "rollout": RolloutConfig, "correction": CorrectionConfig,
            "scoring": ScoringConfig, "loss": LossConfig, "optimization": OptimizationConfig,
            "batching": BatchingConfig, "warm_start": WarmStartConfig, "evaluation": EvaluationConfig,
            "distribution": DistributionConfig, "run": RunConfig}
GROUPS = tuple(SECTIONS)                # keys_help's headers, in this order

class Key(NamedTuple):
    """One config key: `name` as the command line and keys_help spell it, its section and field there, its type,
    default, help, Rule and choices."""
    name: str
    section: str
    field: str
    kind: object
    type: str
    default: object
    help: str
    rule: Optional[Rule]
    choices: Optional[tuple]


@functools.cache
def _keys() -> dict:
    """{name: Key} of every key; a field whose name another section already has is named `section.field`."""
    found = {}
    for section, cls in SECTIONS.items():
        kinds = hints(cls)
        for item in dataclasses.fields(cls):
            name = item.name if item.name not in found else f"{section}.{item.name}"
            default = item.default_factory() if item.default is dataclasses.MISSING else item.default
            found[name] = Key(name, section, item.name, kinds[item.name], item.type, default, item.metadata["help"],
                              item.metadata["rule"], item.metadata["choices"])
    return found


def _addresses() -> dict:
    """{how a key may be named: Key}: its name, and section.field."""
    found = dict(KEYS)
    found.update({f"{key.section}.{key.field}": key for key in KEYS.values()})
    return found


KEYS = _keys()
RULES = {name: key.rule for name, key in KEYS.items() if key.rule is not None}       # every numeric key's range
ADDRESSES = _addresses()
NAMES = {(key.section, key.field): name for name, key in KEYS.items()}


@dataclass
class TrainConfig:
    """Every option of `grpo-fast train`, in one section per stage of a run (the module docstring lists them;
    `keys_help()` lists each key with its type, default and help). Build one in code with sections, e.g.
    `TrainConfig(rollout=RolloutConfig(temperature=0.7))`, or from keys: `TrainConfig.from_keys(temperature=0.7)`.
    """

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    loss: LossConfig = field(default_factory=LossSection)
    optimization: OptimizationConfig = field(default_factory=OptimizationConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    distribution: DistributionConfig = field(default_factory=DistributionConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self):
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"TrainConfig's section {name!r} must be a {cls.__name__}, got "
                                f"{type(getattr(self, name)).__name__}")
        self.loss = LossSection.of(self.loss)         # max_completion_length None: each step's budget
        _check_across_sections(self)

    @classmethod
    def from_keys(cls, **values) -> TrainConfig:
        """TrainConfig from keys named as on the command line (`temperature`, or `rollout.temperature`), with
        values typed as in code (no text conversion); the other keys keep their defaults."""
        return _build(_place(values), convert=False)

    def replace(self, **values) -> TrainConfig:
        """A copy with the keys `values` (named as in `from_keys`) changed, checked anew."""
        return _build(_merge(_place(self.flat()), _place(values)), convert=False)

    def loss_at(self, step: int) -> LossConfig:
        """The LossConfig of (0-based) `step`: the loss section at the step's completion budget (its stage's
        max_completion_length: dr_grpo's normalizer unless loss.max_completion_length is given)."""
        return self.loss.at_length(self.rollout.stages.at(step))

    def flat(self) -> dict:
        """{key: value} of every key, named as on the command line."""
        return flat_values(dataclasses.asdict(self))

    def check_world(self, world_size: int) -> None:
        """The checks of a training job (not of an evaluation), with those that need the number of processes, run
        once before anything is loaded."""
        self.rollout.check_for_training()
        check_data_groups(self.rollout.prompts_per_step, world_size, self.optimization.steps_per_generation,
                          self.rollout.max_staleness)
        if self.scoring.scale_rewards == "batch" and world_size > 1:
            raise ValueError("scale_rewards='batch' needs the rewards of all ranks; use 'group' or 'none'")


def _check_across_sections(config: TrainConfig) -> None:
    """The checks of keys from two or more sections."""
    eval_source = config.data.task if config.evaluation.eval_task is None else config.evaluation.eval_task
    if config.evaluation.eval_split is not None and (eval_source in TASKS or not os.path.isdir(eval_source)):
        name = "task" if config.evaluation.eval_task is None else "eval_task"
        raise ValueError(f"eval_split={config.evaluation.eval_split!r} names a split of a dataset folder, but {name} "
                         f"is {eval_source!r}: use eval_task or eval_fraction")
    check_split(config.evaluation.eval_split, eval_source, "eval_split")
    importance_sampling = config.correction.importance_sampling
    if config.rollout.max_staleness and importance_sampling == "none":
        # the rollout correction is what weighs a stale sample: exp(current policy - the policy that sampled)
        raise ValueError(f"max_staleness={config.rollout.max_staleness} needs a rollout correction to weigh samples "
                         "from older policies (exp(trainer log-prob - sampling log-prob)); importance_sampling is "
                         f"'none': set one of {one_of(IS_MODES[1:])}, or max_staleness: 0")
    corrected = config.rollout.engine == "vllm" or config.rollout.max_staleness > 0   # engine log-probs reach the loss
    if config.loss.loss_type == "vespo" and corrected and importance_sampling.startswith("sequence"):
        # vespo folds each token's correction into its sequence weight: a per-sequence ratio would count n times
        raise ValueError(f"loss_type 'vespo' takes the rollout correction per token into its sequence weight; "
                         f"importance_sampling={importance_sampling!r} is per sequence: use token_truncate, "
                         "token_mask or none")
    if config.policy.attention != "auto" and config.batching.packing:
        # transformers' own masks keep a packed row's sequences apart only in models that pass their position
        # ids to the mask (Llama, Qwen2, Gemma 2 do; GPT-OSS does not and would attend across sequences)
        raise ValueError(f"packing=True needs attention 'auto' (transformers' {config.policy.attention} does not keep "
                         f"a packed row's sequences apart in every model), got attention={config.policy.attention!r}; "
                         "set packing: false to keep it")
    check_optimizer(config.policy.dtype, config.optimization.optimizer, config.policy.lora_rank)
    check_4bit(config.policy.load_in_4bit, config.policy.bnb_4bit_double_quant, config.policy.lora_rank,
               config.distribution.distributed, config.warm_start.sft_steps)
    check_sequence_parallel(config.distribution.sequence_parallel, config.batching.packing, config.policy.attention,
                            config.rollout.max_staleness)
    if config.evaluation.eval_reward == "overlong":
        raise ValueError("eval_reward 'overlong' scores lengths, not answers: name a reward that scores the answer "
                         "(accuracy, exact_match, ...) or leave it unset")
    metric = config.rollout.dynamic_sampling_metric
    if metric is not None and metric != "reward" and metric not in config.scoring.rewards:
        raise ValueError(f"dynamic_sampling_metric must be 'reward' (the weighted sum) or one of scoring.rewards "
                         f"{config.scoring.rewards}, got {metric!r}")
    shortest = config.rollout.stages.shortest
    if config.scoring.overlong_buffer > shortest:
        raise ValueError(f"overlong_buffer ({config.scoring.overlong_buffer}) must be at most max_completion_length "
                         f"({shortest}, of its shortest stage): the penalty ramps over the last tokens before it")


def _unknown(names: list) -> ValueError:
    """The error of unknown keys, with the keys they were probably meant to be."""
    hints = []
    for name in names:
        field_name = name.rpartition(".")[2]
        close = ([KEYS[field_name].section + "." + field_name] if "." in name and field_name in KEYS else
                 difflib.get_close_matches(name, list(ADDRESSES), n=3))
        if close:
            hints.append(f"{name!r}: did you mean {' or '.join(close)}?")
    return ValueError(f"unknown config key(s) {sorted(names)}" + ("; " + "; ".join(hints) if hints else "") +
                      " (`grpo-fast train --help` lists the keys)")


def _place(values: dict) -> dict:
    """{section: {field: value}} of keys named flat or as section.field; a key named twice is an error."""
    unknown = sorted(str(name) for name in values if name not in ADDRESSES)
    if unknown:
        raise _unknown(unknown)
    placed, given_as = {}, {}
    for name, value in values.items():
        key = ADDRESSES[name]
        if key.name in given_as:
            raise ValueError(f"{given_as[key.name]} and {name} are the same key ({key.section}.{key.field}); give "
                             "it once")
        given_as[key.name] = name
        placed.setdefault(key.section, {})[key.field] = value
    return placed


def _merge(base: dict, changes: dict) -> dict:
    """base's {section: {field: value}} with changes' on top; a schedule given as max_completion_length in changes
    replaces base's completion_length_stages (a schedule given twice is refused only within one source)."""
    merged = {section: {**base.get(section, {}), **changes.get(section, {})} for section in SECTIONS}
    rollout = changes.get("rollout", {})
    if length_stages(rollout.get("max_completion_length")) is not None and "completion_length_stages" not in rollout:
        merged["rollout"].pop("completion_length_stages", None)
    return merged


def _build(placed: dict, convert: bool) -> TrainConfig:
    """TrainConfig of {section: {field: value}}; with `convert`, values are text or YAML, converted to each
    field's type with errors naming the key."""
    sections = {}
    for section, cls in SECTIONS.items():
        values = dict(placed.get(section, {}))
        if convert:
            for item, value in values.items():
                key = KEYS[NAMES[section, item]]
                if (section, item) == ("rollout", "max_completion_length") and length_stages(value) is not None:
                    continue                            # a schedule: RolloutConfig reads it
                values[item] = keys.convert(key.name, value, key.kind, key.choices)
        sections[section] = (LossSection if section == "loss" else cls)(**values)
    return TrainConfig(**sections)


def saved_config(saved: dict, overrides: Optional[dict] = None) -> TrainConfig:
    """The TrainConfig a checkpoint saved, nested by section (dataclasses.asdict) or flat (earlier versions), with
    `overrides` {key: value} (values as text or typed) applied."""
    return _build(_merge(_place(flat_values(saved)), _place(overrides or {})), convert=True)


def key_names(values: dict) -> dict:
    """{key: value} with each key named as keys_help names it (section.field given for a field that has a name of
    its own becomes that name); unknown keys are errors."""
    placed = _place(values)
    return {NAMES[section, item]: value for section, fields in placed.items() for item, value in fields.items()}


def flat_values(values: dict) -> dict:
    """{key: value}, keys named as on the command line, of a config as a dict: nested by section
    (dataclasses.asdict of a TrainConfig) or flat (what checkpoints of earlier versions saved)."""
    flat = {}
    for name, value in values.items():
        if name in SECTIONS and isinstance(value, dict):
            flat.update({NAMES.get((name, item), f"{name}.{item}"): v for item, v in value.items()})
        else:
            flat[name] = value
    return flat


def _one_line(text) -> str:
    return " ".join(str(text).split())


@functools.cache
def _unique_keys_loader():
    """yaml's SafeLoader, except that a key given twice in one mapping is an error (SafeLoader keeps the last)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            lines = {}                                            # key -> the line it was first given on
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":     # `<<: *base`: its keys may be overridden
                    continue
                key = self.construct_object(key_node, deep=deep)
                if isinstance(key, typing.Hashable) and key in lines:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {key!r} is given twice, here and on line {lines[key]}; give it once",
                        key_node.start_mark)
                if isinstance(key, typing.Hashable):
                    lines[key] = key_node.start_mark.line + 1
            return super().construct_mapping(node, deep=deep)

    # YAML 1.1 reads 1:30 as the base-60 integer 90 (and 1:30.5 as a float): a schedule or a mistyped number would
    # pass as a number nobody wrote, so such a scalar stays text, which its key then reads or refuses
    text = ("tag:yaml.org,2002:str", re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?$"))
    UniqueKeyLoader.yaml_implicit_resolvers = {
        first: ([text] if first is not None and first in "+-0123456789" else []) + list(resolvers)
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    return UniqueKeyLoader


def _read_yaml(path: str):
    import yaml

    with open(path, "rb") as f:
        data = f.read().removeprefix(b"\xef\xbb\xbf")          # a UTF-8 byte order mark is no error
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[:error.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte {data[error.start]:#04x}: {error.reason})") from None
    try:
        return yaml.load(text, Loader=_unique_keys_loader())
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"{path}:{mark.line + 1}" if mark else path       # marks count lines from 0
        problem = error.problem or error.context
        if error.context and error.problem and error.context_mark:   # e.g. where an unclosed [ opened
            problem += f"; {error.context} on line {error.context_mark.line + 1}"
        raise ValueError(f"{where}: not valid YAML ({_one_line(problem)})") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not valid YAML ({_one_line(error)})") from None


def _file_keys(loaded: dict, path: str) -> dict:
    """{key name: value} of a config file: its sections' keys as section.field, and keys outside any section (the
    flat files of earlier versions), which are read as their sections' with a FutureWarning of one line that
    shows the file's nested form."""
    values, flat = {}, {}
    for name, value in loaded.items():
        if name in SECTIONS:
            if value is not None and not isinstance(value, dict):
                raise ValueError(f"{path}: {name} is a section, a mapping of its keys, got {value!r}")
            values.update({f"{name}.{item}": v for item, v in (value or {}).items()})
        else:
            values[name] = value
            if name in KEYS and "." not in str(name):
                flat[name] = value
    if flat:
        import yaml

        nested = _merge({}, _place(flat))
        nested = {section: fields for section, fields in nested.items() if fields}
        form = yaml.safe_dump(nested, default_flow_style=True, sort_keys=False, width=2**31).strip()
        warnings.warn(f"{path}: keys outside a section, read into their sections; nested, the file is {form}",
                      FutureWarning, stacklevel=3)
    return values


def load_config(path: Optional[str] = None, overrides: Optional[dict] = None) -> TrainConfig:
    """TrainConfig from a YAML file nested by section (optional) and overrides {key: value} (`--key value`: the key
    alone or as section.key); unknown keys are errors, naming the keys they were probably meant to be."""
    values = {}
    if path:
        loaded = _read_yaml(os.path.expanduser(path)) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: a config file is a mapping of sections to their keys")
        values = _file_keys(loaded, path)
    return _build(_merge(_place(values), _place(overrides or {})), convert=True)


def load_config_values(path: str) -> dict:
    """{key: value} of a YAML config file as written (named as on the command line), unchecked."""
    loaded = _read_yaml(os.path.expanduser(path)) or {}
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: a config file is a mapping of sections to their keys")
    return key_names(_file_keys(loaded, path))


def keys_help() -> str:
    """Every key by section: `  key: type = default  help`, one line each (for `train --help`); the headers and
    indentation are those of a config file."""
    rows = [(key.section, f"  {key.name}: {type_name(key.kind)} = {key.default!r}", key.help)
            for key in KEYS.values()]
    # one column for the help, wide enough for the usual key and default; a longer default pushes its help along
    width = max(len(left) for _, left, _ in rows if len(left) <= 60) + 2
    lines, last_section = [], None
    for section, left, help in rows:
        if section != last_section:
            lines.append(f"{section}:")
            last_section = section
        lines.append(f"{left:<{width}}{help}" if len(left) < width else f"{left}  {help}")
    return "\n".join(lines)


def parse_overrides(items: list) -> dict:
    """['--key', 'value', '--other=v'] -> {'key': 'value', 'other': 'v'}: dashes in keys become _, values are kept
    exactly as given (`--output-dir=runs/my-run` is runs/my-run). A key given twice is an error."""
    overrides, index = {}, 0
    while index < len(items):
        item = items[index]
        if not item.startswith("--"):
            raise ValueError(f"expected --key value, got {item!r}")
        key, equals, value = item[2:].partition("=")
        if equals:
            index += 1
        else:
            if index + 1 >= len(items):
                raise ValueError(f"--{key} needs a value")
            value = items[index + 1]
            index += 2
        key = key.replace("-", "_")
        if key in overrides:
            raise ValueError(f"--{key.replace('_', '-')} is given twice ({overrides[key]!r} and {value!r}); give "
                             "each key once")
        overrides[key] = value
    return overrides
