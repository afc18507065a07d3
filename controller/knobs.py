"""The serving knobs: one vocabulary for `moeless serve` flags, its YAML config and the Kubernetes policy.

Every knob has one name in each place, one unit and one range, all in KNOBS:

| knob | `moeless serve` flag | YAML / ExpertAutoscalingPolicy key | unit |
| --- | --- | --- | --- |
| planner | --planner NAME | planner | a planner name or "module:function" |
| predictor | --predictor gate|history|off | predictor | |
| distance | --distance D | distance | MoE layers between a forecast's source and target |
| keep_alive_s | --keep-alive S | keepAliveSeconds | seconds an idle replica stays resident |
| layer_memory_cap_gib | --layer-memory-cap GIB | layerMemoryCapGiB | GiB all replicas of one layer may hold (null: 2 x one replica per expert) |
| cv_threshold | --cv-threshold V | cvThreshold | the paper's V (coefficient of variation) |
| memory_price | --memory-price P | memoryPrice | seconds of MoE-layer time one GB·s of replica memory is worth (0: memory is free; null: memory-neutral, 1 / the deployment's GB) |
| home_moves_every | --home-moves-every N | homeMovesEvery | plans between moeless's chances to move experts' homes (0: never) |
| scaler | --no-scaler | scaler | on/off (ablation: off = one replica per expert) |
| placer | --no-placer | placer | on/off (ablation: off = round-robin placement) |

A YAML config file holds these keys at its top level (the `serving` block of a policy's spec is
a valid config file). Unknown keys, wrong types and out-of-range values are refused with one
line naming the key; a distance beyond the model's layers is checked once the model is known
(`Knobs.check_for_model`).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from moeless.placement.names import DEFAULT_PLANNER, PLANNER_NAMES

PREDICTORS = ("gate", "history", "off")


class KnobError(ValueError):
    """A knob with a bad value: the message names the key (or flag) and says what is allowed."""


@dataclass(frozen=True)
class Knob:
    """One knob: its attribute, YAML key, CLI flag, unit, help and a check of its value."""

    attr: str
    key: str
    flag: str
    metavar: str | None  # the flag's value in --help (None: an on/off switch)
    unit: str
    help: str
    parse: Callable[[Any, str], Any]  # (raw value, where) -> value; raises KnobError


def _number(kind: type, low: float | None = None, high: float | None = None, low_open: bool = False,
            nullable: bool = False) -> Callable[[Any, str], Any]:
    def parse(value: Any, where: str) -> Any:
        if value is None and nullable:
            return None
        ok_types = (int,) if kind is int else (int, float)
        if isinstance(value, bool) or not isinstance(value, ok_types):
            raise KnobError(f"{where}: expected {'an integer' if kind is int else 'a number'}, got {value!r}")
        value = kind(value)
        if not math.isfinite(value):
            raise KnobError(f"{where}: must be finite, got {value!r}")
        if low is not None and (value <= low if low_open else value < low):
            raise KnobError(f"{where}: must be {'>' if low_open else '>='} {low}, got {value!r}")
        if high is not None and value > high:
            raise KnobError(f"{where}: must be <= {high}, got {value!r}")
        return value

    return parse


def _choice(options: tuple[str, ...]) -> Callable[[Any, str], str]:
    def parse(value: Any, where: str) -> str:
        if value not in options:
            raise KnobError(f"{where}: must be one of {', '.join(options)}; got {value!r}")
        return value

    return parse


def _planner(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise KnobError(f"{where}: expected a planner name, got {value!r}")
    if value not in PLANNER_NAMES and ":" not in value:
        raise KnobError(f"{where}: unknown planner {value!r}; use one of {', '.join(sorted(PLANNER_NAMES))} "
                        "or 'module:function'")
    return value


def _switch(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise KnobError(f"{where}: expected true or false, got {value!r}")
    return value


KNOBS: tuple[Knob, ...] = (
    Knob("planner", "planner", "--planner", "NAME", "name", "the planner (moeless, static, eplb-window, paper, ...)", _planner),
    Knob("predictor", "predictor", "--predictor", "gate|history|off", "gate|history|off",
         "load forecasts: gate replicas at distance d (history as fallback), a history window only, or none",
         _choice(PREDICTORS)),
    Knob("distance", "distance", "--distance", "D", "layers", "layers between a forecast's source and its target layer",
         _number(int, low=1)),
    Knob("keep_alive_s", "keepAliveSeconds", "--keep-alive", "S", "seconds", "how long an idle expert replica stays resident",
         _number(float, low=0.0)),
    Knob("layer_memory_cap_gib", "layerMemoryCapGiB", "--layer-memory-cap", "GIB", "GiB",
         "memory all replicas of one layer may hold (default: twice one replica per expert)",
         _number(float, low=0.0, low_open=True, nullable=True)),
    Knob("cv_threshold", "cvThreshold", "--cv-threshold", "V", "ratio", "the paper's CV threshold V (paper planner)",
         _number(float, low=0.0, low_open=True)),
    Knob("memory_price", "memoryPrice", "--memory-price", "P", "s per GB·s",
         "seconds of MoE-layer time one GB·s of replica memory is worth; moeless adds a replica only when its "
         "gain beats its exposed cold start plus its memory at this price (0: memory is free; default: "
         "memory-neutral, 1 / the deployment's GB, so scaling never grows the GB·s bill)",
         _number(float, low=0.0, nullable=True)),
    Knob("home_moves_every", "homeMovesEvery", "--home-moves-every", "N", "plans",
         "moeless re-pairs each layer's experts with the GPUs (moves their homes, the new ones loaded behind "
         "serving) at most once every N plans, where the loads its gates reported since say the new homes "
         "are faster (0: homes never move)", _number(int, low=0)),
    Knob("scaler", "scaler", "--no-scaler", None, "on/off", "ablation: off keeps one replica per expert", _switch),
    Knob("placer", "placer", "--no-placer", None, "on/off", "ablation: off places replicas round-robin", _switch),
)
BY_KEY = {k.key: k for k in KNOBS}
BY_ATTR = {k.attr: k for k in KNOBS}


@dataclass(frozen=True)
class Knobs:
    """The serving knobs (see the module docstring for names and units)."""

    planner: str = DEFAULT_PLANNER
    predictor: str = "gate"
    distance: int = 2
    keep_alive_s: float = 60.0
    layer_memory_cap_gib: float | None = None
    cv_threshold: float = 0.2
    memory_price: float | None = None  # None: CostProfile.memory_neutral_price
    home_moves_every: int = 50  # PlannerConfig.home_moves_every
    scaler: bool = True
    placer: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):
            knob = BY_ATTR[f.name]
            object.__setattr__(self, f.name, knob.parse(getattr(self, f.name), knob.key))

    @staticmethod
    def from_mapping(doc: Mapping[str, Any], where: str = "config") -> "Knobs":
        """Knobs from YAML-style keys (keepAliveSeconds, ...); unknown keys are an error naming them."""
        if not isinstance(doc, Mapping):
            raise KnobError(f"{where}: expected a mapping of knob names to values, got {type(doc).__name__}")
        unknown = sorted(set(doc) - set(BY_KEY))
        if unknown:
            raise KnobError(f"{where}: unknown key {unknown[0]!r}; known keys: {', '.join(BY_KEY)}")
        values = {BY_KEY[key].attr: BY_KEY[key].parse(value, f"{where}: {key}") for key, value in doc.items()}
        return replace(Knobs(), **values)

    @staticmethod
    def from_yaml(path: str | Path) -> "Knobs":
        """Knobs from a YAML file (keys as in from_mapping); errors name the file and the key."""
        path = Path(path)
        try:
            doc = yaml.safe_load(path.read_text())
        except OSError as err:
            raise KnobError(f"{path}: cannot read the config file ({err.strerror})") from err
        except yaml.YAMLError as err:
            raise KnobError(f"{path}: not valid YAML ({err})") from err
        return Knobs.from_mapping(doc or {}, str(path))

    def to_mapping(self) -> dict[str, Any]:
        """YAML-style keys -> values (the inverse of from_mapping)."""
        return {BY_ATTR[f.name].key: getattr(self, f.name) for f in fields(self)}

    def for_model(self, num_layers: int) -> "Knobs":
        """These knobs fitted to a model of num_layers MoE layers: the default distance, where it reaches
        past a tiny model's layers, shortened to the last one (a distance set on purpose is kept, and
        checked); KnobError names what cannot fit. At start-up and for every live change alike."""
        knobs = self
        if knobs.distance == Knobs().distance and knobs.distance >= num_layers > 1:
            knobs = replace(knobs, distance=num_layers - 1)
        knobs.check_for_model(num_layers)
        return knobs

    def check_for_model(self, num_layers: int) -> None:
        """Checks that need the model: a forecast must land on a layer that exists."""
        if self.predictor != "off" and self.distance >= num_layers:
            raise KnobError(f"distance: {self.distance} layers reaches past the model's {num_layers} MoE layers; "
                            f"use 1..{num_layers - 1}")


def add_knob_flags(parser: argparse.ArgumentParser) -> None:
    """Add --config and every knob's flag; values given on the command line override the file."""
    parser.add_argument("--config", metavar="YAML", help="a YAML file of knobs (keys: " + ", ".join(BY_KEY) + ")")
    defaults = {f.name: f.default for f in fields(Knobs)}  # not Knobs(): checking a planner loads the planners
    for knob in KNOBS:
        default = defaults[knob.attr]
        if knob.metavar is None:  # an on/off switch: the flag turns it off
            parser.add_argument(knob.flag, dest=f"knob_{knob.attr}", action="store_const", const=False, default=None,
                                help=f"{knob.help} (config key {knob.key})")
            continue
        parser.add_argument(knob.flag, dest=f"knob_{knob.attr}", default=None, metavar=knob.metavar,
                            type=None if knob.attr in ("planner", "predictor") else _cli_type(knob),
                            help=f"{knob.help}; {knob.unit} (config key {knob.key}; default "
                                 f"{'unset' if default is None else default})")


def _cli_type(knob: Knob) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        if knob.attr in ("layer_memory_cap_gib", "memory_price") and text.lower() in ("none", "null"):
            return None
        try:
            return int(text) if knob.attr in ("distance", "home_moves_every") else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None

    convert.__name__ = knob.unit
    return convert


def knobs_from_args(args: argparse.Namespace) -> Knobs:
    """The config file's knobs (if --config), overridden by flags given on the command line."""
    knobs = Knobs.from_yaml(args.config) if getattr(args, "config", None) else Knobs()
    given = {}
    for knob in KNOBS:
        value = getattr(args, f"knob_{knob.attr}", None)
        if value is not None:
            given[knob.attr] = knob.parse(value, knob.flag)
    return replace(knobs, **given)
