"""Where a running planning loop reads its knobs, so that a change reaches it without a restart.

- On Kubernetes, the serving pods' policy itself (`PolicyKnobs`): its `spec.serving` and
  `metadata.generation`, read from the API server (the serving ServiceAccount may get and patch the
  policy). The loop reports the generation it applied by setting the policy's annotation
  `moeless.io/serving-generation`; the operator shows it as `status.servingGeneration`.
- Locally, the `--config` file `moeless serve` was started with (`FileKnobs`): its generation counts
  the changes of its bytes since the loop started (1: as started).

`read()` -> (generation, the knobs: a mapping of config keys, or a file's YAML text); OSError or the
API's errors when the source cannot be read (the loop keeps its knobs and tries again).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

import yaml

from moeless.controller.knobs import KnobError, Knobs
from moeless.controller.pool.kube import KubePodSource, api_client

log = logging.getLogger(__name__)
APPLIED_ANNOTATION = "moeless.io/serving-generation"  # controller/operator/objects.py: serving does not import the operator


class KnobSource(Protocol):
    def read(self) -> tuple[int, Mapping[str, Any] | str]: ...

    def applied(self, generation: int) -> None:
        """Tell the source's owner which generation now runs."""
        ...


@dataclass
class FileKnobs:
    """A knobs YAML file (a `moeless serve --config` file). New contents count as a new generation
    once two reads settle_s apart agree: a file being rewritten in place (truncated, then written)
    is read empty in between, and an empty file is every default. An emptied file must agree over
    empty_settle_s: a busy machine may run the next read before the writer's write (seen in CI)."""

    path: str
    settle_s: float = 0.05
    empty_settle_s: float = 1.0
    _generation: int = 0
    _digest: bytes = field(default=b"", repr=False)
    _data: bytes = field(default=b"", repr=False)

    def read(self) -> tuple[int, str]:
        data = Path(self.path).read_bytes()
        digest = hashlib.sha256(data).digest()
        if digest != self._digest:
            time.sleep(self.settle_s if data else max(self.settle_s, self.empty_settle_s))
            if Path(self.path).read_bytes() != data:  # still being written: the next read decides
                return self._generation, self._data.decode(errors="replace")
            self._digest, self._data, self._generation = digest, data, self._generation + 1
        return self._generation, data.decode(errors="replace")

    def applied(self, generation: int) -> None:
        """Nothing to tell: /metrics shows it."""


@dataclass(frozen=True)
class PolicyKnobs:
    """The ExpertAutoscalingPolicy's serving knobs via the API server (kubeconfig as KubePodSource's)."""

    namespace: str
    policy: str
    kubeconfig: str | None = None

    def _api(self):
        from kubernetes import client

        return client.CustomObjectsApi(api_client(self.kubeconfig))

    def read(self) -> tuple[int, Mapping[str, Any]]:
        doc = self._api().get_namespaced_custom_object("moeless.io", "v1alpha1", self.namespace,
                                                       "expertautoscalingpolicies", self.policy, _request_timeout=5)
        serving = (doc.get("spec") or {}).get("serving") or {}
        return int(doc["metadata"].get("generation") or 0), serving

    def applied(self, generation: int) -> None:
        self._api().patch_namespaced_custom_object(  # a dict body: a merge patch, only this annotation
            "moeless.io", "v1alpha1", self.namespace, "expertautoscalingpolicies", self.policy,
            {"metadata": {"annotations": {APPLIED_ANNOTATION: str(generation)}}}, _request_timeout=5)


def knob_source_for(pool, config_file: str | None) -> KnobSource | None:
    """The policy of a pool followed on Kubernetes, else the config file (None: the knobs are fixed)."""
    if isinstance(pool, KubePodSource):
        return PolicyKnobs(pool.namespace, pool.policy, pool.kubeconfig)
    return FileKnobs(config_file) if config_file else None


def as_mapping(doc: Mapping[str, Any] | str) -> Mapping[str, Any]:
    """A source's knobs as a mapping (a file's text parsed); KnobError for what is not one."""
    if isinstance(doc, str):
        try:
            doc = yaml.safe_load(doc) or {}
        except yaml.YAMLError as err:
            raise KnobError(f"not YAML ({err})") from None
    if not isinstance(doc, Mapping):
        raise KnobError(f"the knobs are a mapping of config keys, got {type(doc).__name__}")
    return doc


def follow_knobs(source: KnobSource, apply: Callable[[Knobs, int], bool], refuse: Callable[[int, Exception], None],
                 stop: threading.Event, period_s: float, seen: Callable[[], tuple[int, int]]) -> None:
    """Every period_s until `stop`: a generation of `source` not seen yet (seen(): the applied and
    the last refused one) is parsed and given to apply(knobs, generation) (False: refused), or to
    refuse(generation, error) when it is not knobs; an applied one is reported to the source. An
    unreadable source is tried again next period."""
    while not stop.wait(period_s):
        try:
            generation, doc = source.read()
            if generation in seen():
                continue
        except Exception as err:  # the API server or the file is not there now: next period
            log.warning("cannot read the knobs (%s): %s", type(err).__name__, err)
            continue
        try:
            knobs = Knobs.from_mapping(as_mapping(doc), f"knobs generation {generation}")
        except KnobError as err:
            refuse(generation, err)
            continue
        if apply(knobs, generation):
            try:
                source.applied(generation)
            except Exception as err:  # reporting is best effort: /metrics shows the generation too
                log.warning("cannot report knobs generation %d: %s", generation, err)
