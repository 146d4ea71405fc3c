"""What the operator reads from the cluster about one ModelService: the object itself, its
lanes, its pods' readiness (from its Deployments or LeaderWorkerSets) and, for a source an init container
fetches, its runtime pods (the fetch-model init containers' states). Shared by the reconcile (handlers.py) and the tuning timer
(tuning.py); only reads, no decisions.
"""

from __future__ import annotations

from typing import Optional

from tokenlane.operator.desired import builders
from tokenlane.operator.clients import kube as k8s
from tokenlane.operator.api.resources import ServingLane, parse_serving_lane
from tokenlane.operator.policy.rollout import PodReadiness


async def model_service_body(client: k8s.KubeClient, namespace: str, name: str) -> Optional[dict]:
    """The ModelService object (apiVersion and kind set, as Events about it need), or None."""
    body = await client.get(k8s.MODEL_SERVICES, namespace, name)
    if body is not None:
        body.setdefault("apiVersion", k8s.MODEL_SERVICES.api_version)
        body.setdefault("kind", "ModelService")
    return body


async def list_lanes(client: k8s.KubeClient, namespace: str, parent: str) -> tuple[list[ServingLane], list[dict]]:
    """Valid lanes of `parent` and the raw bodies of all lanes naming it."""
    bodies = [b for b in await client.list(k8s.SERVING_LANES, namespace)
              if ((b.get("spec") or {}).get("modelServiceRef") or {}).get("name") == parent]
    lanes = []
    for body in bodies:
        try:
            lanes.append(parse_serving_lane(body))
        except ValueError:
            continue  # its own handler reports it
    return lanes, bodies


async def pod_readiness(executor: k8s.Executor, namespace: str, name: str) -> PodReadiness:
    """Desired, updated and ready runtime pods (groups of a LeaderWorkerSet) over every
    Deployment and LeaderWorkerSet the ModelService owns (the router's Deployment serves no
    model and is left out)."""
    deployments = await executor.observe(namespace, name, kinds=k8s.WORKLOADS)
    desired = updated = ready = 0
    for dep in deployments:
        labels = (dep.get("metadata") or {}).get("labels") or {}
        if labels.get(builders.LABEL_COMPONENT, "runtime") != "runtime":
            continue
        want = int((dep.get("spec") or {}).get("replicas") or 0)
        st = dep.get("status") or {}
        desired += want
        updated += min(want, int(st.get("updatedReplicas") or 0))
        ready += min(want, int(st.get("readyReplicas") or 0))
    return PodReadiness(desired, updated, ready)


PODS = k8s.Resource("", "v1", "pods", "Pod")


async def runtime_pods(executor: k8s.Executor, namespace: str, name: str) -> list[dict]:
    """The runtime pods of every pool of the ModelService (by the labels of its pod templates;
    the router's pods are left out). Read only for a huggingFace or s3 source: the
    ModelAvailable condition comes from their fetch-model init containers."""
    pods = await executor.observe(namespace, name, kinds=(PODS,))
    return [p for p in pods
            if ((p.get("metadata") or {}).get("labels") or {}).get(builders.LABEL_COMPONENT) == "runtime"]
