"""The last-known-good (LKG) store: the ConfigMap `<name>-rollout` holding the inputs and the
rendered objects of a ModelService's last verified revision, and what it puts in force.

The rollout guard (tuning.py) saves a revision here when it promotes it; while a rollback or
the fallback is in force, the reconcile (handlers.py) renders these inputs instead of the spec
(`inputs_in_force`), leaving the spec as the user wrote it.
"""

from __future__ import annotations

import copy
import json
import logging
from typing import Any, Optional

import yaml

from tokenlane.operator.desired import builders
from tokenlane.operator.clients import kube as k8s
from tokenlane.operator.policy import rollout
from tokenlane.operator.api.resources import ModelService, ServingLane

log = logging.getLogger("tokenlane.operator.clients.last_known_good")

CONFIGMAP_SUFFIX = "-rollout"
COMPONENT = "rollout-guard"


def configmap_name(name: str) -> str:
    return f"{name}{CONFIGMAP_SUFFIX}"


def configmap(msvc: ModelService, revision: str, lanes: list[ServingLane], objects: list[dict]) -> dict:
    """The LKG ConfigMap of `revision`: its inputs (spec and lane specs) and rendered objects."""
    labels = {builders.LABEL_NAME: "tokenlane", builders.LABEL_INSTANCE: msvc.name,
              builders.LABEL_COMPONENT: COMPONENT, builders.LABEL_MODEL_SERVICE: msvc.name}
    meta: dict[str, Any] = {"name": configmap_name(msvc.name), "namespace": msvc.namespace, "labels": labels}
    owner = builders.owner_reference(msvc)
    if owner:
        meta["ownerReferences"] = [owner]
    inputs = {"revision": revision, "modelService": msvc.spec,
              "lanes": {lane.ref.name: lane.spec for lane in lanes}}
    return {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
        "data": {
            "revision": revision,
            "inputs.json": json.dumps(inputs, sort_keys=True),
            "objects.yaml": yaml.safe_dump_all(objects, sort_keys=False),
        },
    }


async def save(client: k8s.KubeClient, cm: dict) -> None:
    meta = cm["metadata"]
    try:
        await client.create(k8s.CONFIG_MAPS, cm)
    except k8s.ApiError as exc:
        if exc.status != 409:
            raise
        await client.apply(k8s.CONFIG_MAPS, cm)
    log.info("saved last-known-good revision %s of %s/%s", cm["data"]["revision"], meta["namespace"], meta["name"])


async def load(client: k8s.KubeClient, namespace: str, name: str) -> Optional[dict]:
    """The LKG inputs of ModelService namespace/name, or None."""
    # A labelled list rather than a get: the operator's RBAC grants list on ConfigMaps, not get.
    found = await client.list(k8s.CONFIG_MAPS, namespace,
                              {builders.LABEL_INSTANCE: name, builders.LABEL_COMPONENT: COMPONENT})
    cm = next((c for c in found if c["metadata"]["name"] == configmap_name(name)), None)
    if not cm:
        return None
    try:
        return json.loads((cm.get("data") or {}).get("inputs.json") or "")
    except ValueError:
        log.warning("ConfigMap %s/%s holds no readable inputs.json", namespace, configmap_name(name))
        return None


async def inputs_in_force(client: k8s.KubeClient, msvc: ModelService, lanes: list[ServingLane], *,
                          revision: Optional[str] = None) -> tuple[ModelService, list[ServingLane]]:
    """What the operator's reconcile should render: the spec, or, while a rollback or the
    fallback is in force, the last-known-good inputs (spec untouched; replicas, autoscaling
    and the router stay the user's, since scaling and routing are not a revision). Lanes
    added since the LKG are left out (marked deleting) until the spec changes again. `revision`: the spec's, when the caller has it."""
    state = rollout.RolloutState.from_dict((msvc.status or {}).get("rollout"))
    if state is None or state.phase not in (rollout.ROLLED_BACK, rollout.FALLBACK) or not state.lkg:
        return msvc, lanes
    if revision is None:
        try:
            revision, _ = rollout.spec_revision(msvc, lanes)
        except ValueError:
            revision = None
    if state.phase == rollout.ROLLED_BACK and revision != state.rolled_back:
        return msvc, lanes  # the user changed the spec: the guard verifies the new revision
    if state.phase == rollout.FALLBACK and revision not in (state.rolled_back, state.lkg):
        return msvc, lanes
    inputs = await load(client, msvc.namespace, msvc.name)
    if not inputs or inputs.get("revision") != state.lkg:
        log.warning("%s/%s: last-known-good %s not found in its ConfigMap; rendering the spec",
                    msvc.namespace, msvc.name, state.lkg)
        return msvc, lanes
    spec = copy.deepcopy(inputs["modelService"])
    # Scaling and routing are not part of a revision: replicas, autoscaling and the router stay the user's.
    for key in ("replicas", "autoscaling", "router"):
        if key in msvc.spec:
            spec[key] = copy.deepcopy(msvc.spec[key])
        else:
            spec.pop(key, None)
    pinned = ModelService(ref=msvc.ref, spec=spec, labels=msvc.labels, status=msvc.status)
    lane_specs = inputs.get("lanes") or {}
    pinned_lanes = []
    for lane in lanes:
        if lane.ref.name in lane_specs:
            pinned_lanes.append(ServingLane(ref=lane.ref, spec=lane_specs[lane.ref.name], created=lane.created,
                                            deleting=lane.deleting, status=lane.status))
        else:
            pinned_lanes.append(ServingLane(ref=lane.ref, spec=lane.spec, created=lane.created, deleting=True,
                                            status=lane.status))
    return pinned, pinned_lanes
