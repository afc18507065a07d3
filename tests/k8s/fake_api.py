"""What an API server does with the reconciles' actions, for the pure reconcile tests: objects by
(kind, name), the owner's status, Events (as (owner, reason, message))."""

from __future__ import annotations

import copy

from moeless.controller.operator.actions import Create, Delete, Emit, Scale, Update, UpdateStatus


def apply_actions(objects: dict, owner: dict, actions: list, events: list) -> None:
    for a in actions:
        if isinstance(a, Create):
            objects[(a.obj["kind"], a.obj["metadata"]["name"])] = copy.deepcopy(a.obj)
        elif isinstance(a, Update):
            target = objects[(a.kind, a.name)]
            for key, value in a.fields.items():
                target[key] = {**target.get(key, {}), **value} if key != "data" else value
        elif isinstance(a, Scale):
            objects[("StatefulSet", a.name)]["spec"]["replicas"] = a.replicas
        elif isinstance(a, Delete):
            objects.pop((a.kind, a.name))
        elif isinstance(a, UpdateStatus):
            owner["status"] = copy.deepcopy(a.status)
        elif isinstance(a, Emit):
            events.append((owner["metadata"]["name"], a.reason, a.message))
