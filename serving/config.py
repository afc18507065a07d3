"""What a serving app serves and how: the ServeConfig, the model it serves, and the config built
from Ray Serve's application args (a RayService's import path, `app.app_from_args`), its hosts
read by controller/pool/sources.py (a fixed list, or a pool followed while serving)."""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from moeless.controller.knobs import KnobError, Knobs
from moeless.core.paths import cache_dir
from moeless.controller.planning.names import BOARD_NAME, LOOP_NAME
from moeless.controller.pool.addresses import HOSTS_ENV
from moeless.controller.pool.sources import StaticSource, pool_source
from moeless.expert_fn.options import TRANSPORTS
from moeless.model.default import default_model
from moeless.model.hf_loader import load_moe_model
from moeless.model.tiny import tiny_model
from moeless.placement.types import Placement
from moeless.serving.options import BATCHING, DEVICES, STEP_ADMIT
from moeless.serving.pingpong import check_split
from moeless.serving.scheduler import BatchLimits


@dataclass(frozen=True)
class ServeConfig:
    """What the app serves and how. model_loader must be picklable (a function or partial)."""

    model_name: str
    model_loader: Callable[[], Any]  # () -> MoEModel, called once per ModelServer replica
    host_addresses: tuple[str, ...]  # fixed hosts (ignored with `pool`)
    placement: Placement | None = None  # default: static, one replica per expert
    num_replicas: int = 1
    replica_cpus: float = 0.5
    # Where each replica runs the non-expert layers; on "cuda" Ray gives it replica_gpus of a GPU
    # (Ray hides the GPUs from an actor that asks for none; replica_gpus_for picks the share).
    device: str = "cpu"
    replica_gpus: float = 0.0
    ingress_cpus: float = 0.25
    torch_threads: int = 1
    batching: str = "continuous"  # or "static" (the baseline)
    limits: BatchLimits = BatchLimits()  # continuous batching's caps
    # Continuous batching's forwards of micro_batches x micro_batch_tokens tokens or more run as
    # micro-batches in flight together (ping-pong, serving/pingpong.py); 1: never split.
    micro_batches: int = 1
    micro_batch_tokens: int = 256
    max_batch: int = 8  # static batching: requests decoded as one batch
    batch_wait_s: float = 0.02  # static batching: how long a batch waits to fill
    host_timeout_s: float = 30.0
    transport: str = "auto"  # expert calls: shared memory to hosts on this machine, else TCP, else gRPC
    client_poll_s: float = 0.0  # the data channels spin this long for an answer before blocking (expert_fn/wire/polling.py)
    host_model: str | None = None  # the name the expert hosts serve this model by (None: their only one)
    # ESFT fine-tunes of this model served by the same engine (serving/family.py), each by its name, and
    # the names the hosts serve them by, in the same order (() - their names: the local hosts' stores).
    family: tuple[str, ...] = ()
    family_hosts: tuple[str, ...] = ()
    placement_board: str | None = None  # follow placements published under this name (controller/planning/board.py)
    drain_signal: str | None = None  # drain when this signal is raised (shutdown.py)
    # The live loop (serving/live.py, controller/planning/actor.py): the knobs, the loop actor's name (None: no loop,
    # the placement stays static), a cost profile (None: the loop measures one on an expert host),
    # a gate-replica predictor file (None: the cache's for this model), other LoopSettings fields.
    knobs: Any = None  # moeless.controller.knobs.Knobs
    plan_loop: str | None = None
    profile: Any = None  # moeless.placement.profile.CostProfile
    predictor_file: str | None = None
    knob_file: str | None = None  # the knobs' YAML, followed while serving (a k8s pool: its policy instead)
    loop: tuple = ()  # (field, value) pairs of LoopSettings, e.g. (("period_s", 0.1),)
    # The step scaler (serving/step_gate.py; needs the loop and continuous batching): a step's expert
    # work priced at admission against step_slo_s; the loop plans over step_hosts ready hosts (the
    # rest: spares), more for step_hold_s after a batch needed them. None: every ready host, no gate.
    step_slo_s: float | None = None
    step_slos_s: tuple[tuple[str, float], ...] = ()  # (model, SLO) of a fine-tune (or the base) whose own differs
    step_hosts: int = 1
    step_hold_s: float = 2.0
    step_admit: str = "wait"  # newcomers wait for a widening ("wait"), or go in at once ("now")
    # The expert-host pool followed while serving (controller/pool/sources.py: a PoolSource, e.g. the
    # policy's pods on Kubernetes); None: host_addresses, fixed. Read every pool_period_s.
    pool: Any = None
    pool_period_s: float = 1.0

    @property
    def pool_source(self):
        """The PoolSource the app follows (host_addresses as a fixed one when `pool` is unset)."""
        return self.pool if self.pool is not None else StaticSource(tuple(self.host_addresses))

    def __post_init__(self):
        if self.batching not in BATCHING:
            raise ValueError(f"batching must be one of {BATCHING}, got {self.batching!r}")
        check_split(self.micro_batches, self.micro_batch_tokens)
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if (self.device == "cuda") != (self.replica_gpus > 0):
            raise ValueError(f"a replica on {self.device} needs replica_gpus {'> 0' if self.device == 'cuda' else '0'}, "
                             f"got {self.replica_gpus}")
        if self.family and not self.host_model:
            raise ValueError("a family (fine-tunes in this model's engine) needs host_model: the name the hosts serve it by")
        if self.family_hosts and len(self.family_hosts) != len(self.family):
            raise ValueError(f"family_hosts names {len(self.family_hosts)} fine-tunes, family {len(self.family)}")
        if self.plan_loop and not (self.knobs and self.placement_board):
            raise ValueError("the live loop (plan_loop) needs knobs and a placement_board to publish on")
        if self.step_slo_s is not None and not (self.plan_loop and self.batching == "continuous"):
            raise ValueError("the step scaler (step_slo_s) needs the live loop (plan_loop) and continuous batching")
        if self.step_slo_s is not None and not (self.step_slo_s > 0 and self.step_hosts >= 1 and self.step_hold_s >= 0):
            raise ValueError(f"the step scaler needs step_slo_s > 0, step_hosts >= 1 and step_hold_s >= 0, got "
                             f"{self.step_slo_s}, {self.step_hosts}, {self.step_hold_s}")
        unknown = [m for m, _ in self.step_slos_s if m not in (self.model_name, *self.family)]
        if self.step_slos_s and (self.step_slo_s is None or unknown or not all(v > 0 for _, v in self.step_slos_s)):
            raise ValueError(f"step_slos_s {dict(self.step_slos_s)}: each a model of this engine "
                             f"({', '.join((self.model_name, *self.family))}) with an SLO > 0, beside step_slo_s")
        if self.step_admit not in STEP_ADMIT:
            raise ValueError(f"step_admit must be one of {STEP_ADMIT}, got {self.step_admit!r}")


def replica_gpus_for(device: str, replicas: int, visible: int | None = None) -> float:
    """The share of a GPU each of `replicas` replicas asks Ray for on `device`: 0 on the CPU; on
    "cuda" one GPU each where there are enough, else 1/n of one, n replicas to a GPU, for the GPUs
    visible here (`visible`, default torch's count), so that every replica starts. KnobError
    without a GPU."""
    if device not in DEVICES:
        raise KnobError(f"device {device!r}: use one of {', '.join(DEVICES)}")
    if device == "cpu":
        return 0.0
    if visible is None:
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible < 1:
        raise KnobError("device cuda: this machine shows no CUDA GPU to torch (check nvidia-smi, CUDA_VISIBLE_DEVICES "
                        "and that torch is a CUDA build, not the CPU one scripts/install.sh installs); or serve on the CPU: "
                        "--device cpu")
    return 1.0 / math.ceil(replicas / visible)  # 1/n: Ray packs n replicas on a GPU (2/3 each would fit one)


@dataclass(frozen=True)
class ModelChoice:
    """A served model: the name clients send and a picklable loader () -> MoEModel; first_load is
    the driver's own load where it differs (the default model's first build shows its progress);
    base: a fine-tune's base (its weight store is written over the base's: model/weight_store.py);
    joins_base: its non-expert layers are the base's (an ESFT fine-tune, a LoRA on experts only), so it
    can share the base's engine (serving/family.py); a LoRA fine-tune that adapts attention gets an engine
    of its own (its attention LoRA is in that engine's non-expert layers) while its experts are the base's
    replicas on the shared hosts."""

    name: str
    loader: Callable[[], Any]
    first_load: Callable[[], Any] | None = None
    base: "ModelChoice | None" = None
    joins_base: bool = False


def finetune_model(base_loader: Callable[[], Any], root: str):
    """The fine-tune in directory root over the model base_loader loads (model/finetune.py: the base's
    fingerprint and the fine-tune's files checked, a refusal one line naming them): ESFT merged; LoRA
    with its non-expert LoRAs merged and its expert LoRAs not (a LoraMoEModel): its experts are the
    base's, its weight store carries the factors, and the expert hosts apply them at call time over
    the base's shared replicas (expert_fn/host/adapters.py), as the in-process model does."""
    # heavy (peft for a LoRA): kept off --help's start-up path
    from moeless.model.finetune_load import load_finetune

    return load_finetune(root, base_loader(), merge_expert_lora=False)


def choose_model(model: str) -> ModelChoice:
    """"default" (the converted SmolLM2), "tiny:ARCH" (a random test model), a model directory, or
    BASE+FINETUNE: a fine-tune (`moeless model finetune`) over one of those, FINETUNE its directory
    or its name under the cache's finetunes/; served as "<base's name>+<the fine-tune's name>"."""
    if "+" in model:
        # torch and safetensors only where a fine-tune is served
        from moeless.model.finetune import FinetuneError, read_manifest

        spec, _, tune = model.partition("+")
        base = choose_model(spec)
        root = Path(tune) if Path(tune).is_dir() else cache_dir() / "finetunes" / tune
        try:
            manifest = read_manifest(root)
        except FinetuneError as err:
            raise SystemExit(f"--model {model!r}: {err}") from None
        if manifest["method"] == "lora":
            # peft only where a LoRA fine-tune is served
            from moeless.model.lora import adapts_non_experts

            joins = not adapts_non_experts(root)  # a LoRA on experts only: the base's non-expert layers
        else:
            joins = True  # ESFT changes experts only
        return ModelChoice(f"{base.name}+{manifest['name']}", functools.partial(finetune_model, base.loader,
                                                                                 str(root.resolve())), base=base,
                           joins_base=joins)
    if model == "default":
        return ModelChoice("moeless-default", default_model, functools.partial(default_model, progress=True))
    if model.startswith("tiny:"):
        return ModelChoice(f"tiny-{model[5:]}", functools.partial(tiny_model, model[5:], 0))
    path = Path(model)
    if not path.is_dir():
        raise SystemExit(f"--model {model!r}: not 'default', 'tiny:ARCH', a model directory or BASE+FINETUNE")
    return ModelChoice(path.name, functools.partial(load_moe_model, str(path.resolve())))


def config_from_args(args: Mapping[str, Any]):
    """A ServeConfig from Ray Serve's application args: {"config": knobs YAML file (optional),
    "model": "default" | "tiny:ARCH" | DIR (default "default"), "hosts": "host:port,..." or a pool
    such as "k8s://NS/POLICY:PORT?slots=N" (default: $MOELESS_EXPERT_HOSTS; controller/pool/sources.py),
    "replicas": serving replicas (default 1), "transport": auto | local | tcp | nixl | grpc (default auto),
    "micro_batches" (default 1), "micro_batch_tokens" (default 256): ping-pong, "device": cpu | cuda
    (default cpu; cuda: one GPU per replica), "step_slo_ms", "step_hosts", "step_hold_s", "step_admit": the step
    scaler (`moeless serve --step-slo-ms`; default off)}; the loop runs as in `moeless serve`. Raises
    KnobError for a bad value (the message names it)."""
    known = ("config", "model", "hosts", "replicas", "transport", "micro_batches", "micro_batch_tokens", "device",
             "step_slo_ms", "step_hosts", "step_hold_s", "step_admit")
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise KnobError(f"application args: unknown key {unknown[0]!r}; known: {', '.join(known)}")
    transport = str(args.get("transport", "auto"))
    if transport not in TRANSPORTS:
        raise KnobError(f"application args: transport {transport!r}; use one of {', '.join(TRANSPORTS)}")
    split = {key: args.get(key, default) for key, default in (("micro_batches", 1), ("micro_batch_tokens", 256))}
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in split.values()):
        raise KnobError(f"application args: micro_batches and micro_batch_tokens must be whole numbers, got {split}")
    try:
        check_split(**split)
    except ValueError as err:
        raise KnobError(f"application args: {err}") from None
    device = str(args.get("device", "cpu"))
    if device not in DEVICES:
        raise KnobError(f"application args: device {device!r}; use one of {', '.join(DEVICES)}")
    step = _step_scaler_args(args)
    knobs = Knobs.from_yaml(args["config"]) if args.get("config") else Knobs()
    hosts = args.get("hosts") or os.environ.get(HOSTS_ENV)
    if not hosts:
        raise KnobError(f"no expert hosts: pass args.hosts or set {HOSTS_ENV} (host:port[,host:port...])")
    choice = choose_model(str(args.get("model", "default")))
    source = pool_source(str(hosts))
    fixed = isinstance(source, StaticSource)
    return ServeConfig(choice.name, choice.loader, source.addresses if fixed else (), pool=None if fixed else source,
                       num_replicas=int(args.get("replicas", 1)), placement_board=BOARD_NAME, knobs=knobs,
                       plan_loop=LOOP_NAME, knob_file=args.get("config") or None, transport=transport,
                       host_model=getattr(source, "model", None), device=device,
                       replica_gpus=1.0 if device == "cuda" else 0.0, **split, **step)


def _step_scaler_args(args: Mapping[str, Any]) -> dict:
    """The step scaler's ServeConfig fields from the app's args ({} where step_slo_ms is absent)."""
    if args.get("step_slo_ms") is None:
        return {}
    values = {"step_slo_ms": args["step_slo_ms"], "step_hosts": args.get("step_hosts", 1),
              "step_hold_s": args.get("step_hold_s", 2.0)}
    admit = args.get("step_admit", "wait")
    if admit not in STEP_ADMIT:
        raise KnobError(f"application args: step_admit {admit!r}; use one of {', '.join(STEP_ADMIT)}")
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values.values())
    if not numbers or values["step_slo_ms"] <= 0 or values["step_hosts"] < 1 or values["step_hold_s"] < 0 \
            or values["step_hosts"] != int(values["step_hosts"]):
        raise KnobError(f"application args: the step scaler needs step_slo_ms > 0, a whole step_hosts >= 1 and "
                        f"step_hold_s >= 0, got {values}")
    return {"step_slo_s": values["step_slo_ms"] / 1e3, "step_hosts": int(values["step_hosts"]),
            "step_hold_s": float(values["step_hold_s"]), "step_admit": admit}
