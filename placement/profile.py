"""The measured cost profile the digital twin prices plans with: one JSON file.

`moeless bench planner --out DIR` measures it on this machine and writes DIR/cost-profile.json
(a GPU profile has the same fields); the twin and `moeless eval` read it back. Every field is
required; a missing or bad one is one clear error naming the file and the field.

    {"alpha": s/token, "beta": s/token, "call_overhead": s/call,
     "load_s": {"disk": s, "host": s},   # one replica's load: from the weight store (read, sha256,
                                         # copy) and from the host memory tier (a copy); optional
                                         # "peer": copied from a GPU that holds it
     "expert_bytes": bytes, "non_expert_bytes": bytes,
     "relevel_s": s,                     # a serving replica re-levelling one layer's shares over its
                                         # replicas on the actual loads (moeless's data plane)
     "source": "where and how it was measured",
     "relevel_check_s": s,               # optional: the check whether that re-level pays and
                                         # the choice of shares (`actual_shares`); absent:
                                         # counted as relevel_s
     "relevel_per_replica_s": s,         # optional: what each replica past the E homes and G
                                         # copies relevel_s was timed on adds (absent: 0)
     "relevel_skip_s": s}                # optional: a call whose check the gate skips
                                         # (placement/check_gate.py); absent: counted as the check
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from moeless.placement.latency_model import LatencyModel
from moeless.core.json_file import read_json

TIERS = ("disk", "host")
OPTIONAL_TIERS = ("peer",)  # a copy from a GPU that holds the expert (roofline profiles have it)
FIELDS = {
    "alpha": "seconds per token through one expert",
    "beta": "seconds per token moved one way",
    "call_overhead": "seconds per replica call with tokens",
    "load_s": "one replica's load time per tier, {\"disk\": s, \"host\": s}",
    "expert_bytes": "bytes one replica holds",
    "non_expert_bytes": "bytes of the non-expert weights (embeddings, attention, norms, gates, head)",
    "relevel_s": "seconds a serving replica takes to re-level one layer's shares over its replicas on the actual loads",
    "source": "where and how the profile was measured",
}
OPTIONAL = {"relevel_check_s": "seconds a serving replica takes to check whether a re-level pays (default: relevel_s)",
            "relevel_per_replica_s": "seconds each replica of a layer past its E homes and G copies adds to a re-level "
                                     "(default 0)",
            "relevel_skip_s": "seconds a serving replica takes to route a call whose check the gate skips "
                              "(default: relevel_check_s)"}


class ProfileError(ValueError):
    """A cost profile that is missing, unreadable or lacks a field."""


@dataclass(frozen=True)
class CostProfile:
    """Measured costs (seconds, bytes); see the module docstring for the fields."""

    alpha: float
    beta: float
    call_overhead: float
    load_s: dict[str, float]
    expert_bytes: int
    non_expert_bytes: int
    relevel_s: float
    source: str
    relevel_check_s: float | None = None
    relevel_per_replica_s: float = 0.0
    relevel_skip_s: float | None = None

    @property
    def check_s(self) -> float:
        """The re-level check's seconds (relevel_s where the profile did not measure it: a check
        never costs more than the re-level it guards)."""
        return self.relevel_s if self.relevel_check_s is None else self.relevel_check_s

    @property
    def skip_s(self) -> float:
        """A call's seconds where the gate skips the check (the check's where not measured)."""
        return self.check_s if self.relevel_skip_s is None else self.relevel_skip_s

    def relevel_for(self, num_replicas: int, num_experts: int, num_gpus: int) -> float:
        """A re-level's seconds on a layer of num_replicas: relevel_s was timed on the E homes and a
        copy of each of the G busiest experts (placement/timing.measure_relevel_s); the pairing walks
        every replica, so each one past those adds relevel_per_replica_s (full replication of E = 64
        on 8 GPUs: 2x the time of E + G replicas, measured)."""
        return self.relevel_s + self.relevel_per_replica_s * max(num_replicas - num_experts - num_gpus, 0)

    def latency_model(self, tier: str = "host") -> LatencyModel:
        """The latency model whose cold start is one load from `tier` ("host" or "disk")."""
        if tier not in self.load_s:
            raise ProfileError(f"no load time for tier {tier!r}; the profile has {sorted(self.load_s)}")
        return LatencyModel(alpha=self.alpha, beta=self.beta, cold_start=self.load_s[tier], call_overhead=self.call_overhead)

    def memory_neutral_price(self, num_layers: int, num_experts: int, serving_replicas: int = 1) -> float:
        """The memory price (seconds of layer time per GB·s) at which a replica pays exactly when it
        saves the deployment as many GB·s as it holds: 1 / the deployment's GB. A deployment holds
        all its memory (the non-expert weights in each serving replica, static EP's L x E expert
        replicas) while a layer waits for its slowest host, so t seconds of layer time saved are t x
        its GB of GB·s off the bill. At this price moeless scales only where the user's GB·s bill
        does not grow; a lower price buys latency with memory."""
        held = self.non_expert_bytes * serving_replicas + num_layers * num_experts * self.expert_bytes
        if held <= 0:
            raise ProfileError("memory_neutral_price: the profile holds no memory (expert_bytes and non_expert_bytes are 0)")
        return 1e9 / held

    def to_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1))
        return path

    @staticmethod
    def from_mapping(doc: dict, where: str = "profile") -> "CostProfile":
        """A profile from its JSON fields; ProfileError names the first missing or bad one."""
        if not isinstance(doc, dict):
            raise ProfileError(f"{where}: a cost profile is a JSON object with {', '.join(FIELDS)}")
        for name, meaning in FIELDS.items():
            if name not in doc:
                raise ProfileError(f"{where}: cost profile lacks {name!r} ({meaning}); re-measure it with "
                                   "`moeless bench planner --out DIR` or add the field")
        for name in ("alpha", "beta", "call_overhead", "expert_bytes", "non_expert_bytes", "relevel_s"):
            _check_number(doc[name], f"{where}: {name}")
        check = doc.get("relevel_check_s")
        if check is not None:
            _check_number(check, f"{where}: relevel_check_s")
        per_replica = doc.get("relevel_per_replica_s", 0.0)
        _check_number(per_replica, f"{where}: relevel_per_replica_s")
        skip = doc.get("relevel_skip_s")
        if skip is not None:
            _check_number(skip, f"{where}: relevel_skip_s")
        loads = doc["load_s"]
        if not isinstance(loads, dict) or set(TIERS) - set(loads):
            raise ProfileError(f"{where}: load_s must give seconds for every tier {list(TIERS)}, got {loads!r}")
        tiers = [*TIERS, *(t for t in OPTIONAL_TIERS if t in loads)]
        for tier in tiers:
            _check_number(loads[tier], f"{where}: load_s.{tier}")
        return CostProfile(float(doc["alpha"]), float(doc["beta"]), float(doc["call_overhead"]),
                           {t: float(loads[t]) for t in tiers}, int(doc["expert_bytes"]), int(doc["non_expert_bytes"]),
                           float(doc["relevel_s"]), str(doc["source"]), None if check is None else float(check),
                           float(per_replica), None if skip is None else float(skip))

    @staticmethod
    def from_json(path: str | Path) -> "CostProfile":
        path = Path(path)
        doc = read_json(path, ProfileError, "no such cost profile; write one with `moeless bench planner --out DIR`")
        return CostProfile.from_mapping(doc, str(path))


def _check_number(value, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ProfileError(f"{where}: expected a finite number >= 0, got {value!r}")
