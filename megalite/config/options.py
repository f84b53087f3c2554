"""One definition per option: `lr: float = option(1e-3, "peak learning rate")` declares the field
`lr` and the flag `--lr` (type from the annotation); a field no flag sets is `derived(...)`."""

import dataclasses
import types
import typing
from dataclasses import dataclass


# --help's groups: Megatron-LM's titles, in its order (megatron/training/arguments.py). An option is in its
# config class's group (megalite/arguments.py's GROUPS) unless it names another.
HELP_GROUPS = ("network size", "regularization", "training", "initialization", "learning rate", "checkpointing",
               "mixed precision", "distributed", "validation", "data and dataloader", "moe", "logging")


@dataclass(frozen=True)
class Option:
    """How one config field appears on the command line."""

    help: str
    flag: str | tuple[str, ...] = ()  # () : "--" + the field name with dashes; a tuple: aliases
    choices: tuple | None = None
    off_flag: str | None = None  # a second flag that sets a boolean field False
    inverted: bool = False  # the flag sets a boolean field False (`--disable-bias-linear`)
    default_text: str | None = None  # what --help says the default is, when the field default does not say it
    group: str | None = None  # one of HELP_GROUPS, when not the config class's group


def option(default, help: str, **spec):
    """A dataclass field that is also a command-line flag; `spec` holds Option's other fields."""
    return dataclasses.field(default=default, metadata={"option": Option(help, **spec)})


def derived(default, why: str):
    """A dataclass field no flag sets: `why` says where its value comes from."""
    return dataclasses.field(default=default, metadata={"derived": why})


def option_fields(cls) -> list[tuple[dataclasses.Field, Option]]:
    """The fields of config class `cls` that are flags, in declaration order."""
    return [(field, field.metadata["option"]) for field in dataclasses.fields(cls) if "option" in field.metadata]


def flags_of(field: dataclasses.Field) -> tuple[str, ...]:
    """The flag(s) that set `field`: its own spelling(s), then the off flag if any."""
    spec: Option = field.metadata["option"]
    flags = (spec.flag,) if isinstance(spec.flag, str) else spec.flag or ("--" + field.name.replace("_", "-"),)
    return flags + ((spec.off_flag,) if spec.off_flag else ())


def value_type(cls, field: dataclasses.Field):
    """(type, is_list) of `field` from its annotation, None stripped: `int | None` -> (int, False)."""
    kind = typing.get_type_hints(cls)[field.name]
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        kind = next(arg for arg in typing.get_args(kind) if arg is not type(None))
    if typing.get_origin(kind) is list:
        return typing.get_args(kind)[0], True
    return kind, False
