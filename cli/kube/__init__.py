"""tokenlane.kube: the one Kubernetes API client of tokenlane (a room of its own).

The operator (`operator/clients/kube.py`: its reconcile, tuner and autoscaler), the fleet
router's EndpointSlice discovery (`runtime/fleet/discovery.py`) and `tokenlane check -n`
(`operator/tools/check.py`) all talk to the API server through this package:

- `credentials.py`: `Credentials` from a kubeconfig (client certificates, bearer tokens and
  token files, basic auth, exec credential plugins) or a pod's service account, and the
  `Authenticator` that keeps rotating tokens current;
- `client.py`: `KubeApi`, an async JSON client (httpx) with get, list, watch, create,
  server-side apply, merge patch (status and scale subresources), delete and discovery, and
  `ApiError`, the one exception (HTTP status and the server's reason).

It imports nothing of tokenlane (pyproject's import contracts): the router's process, which
must not load the operator, and the operator, which must not load the runtime, both may use it.
"""

from tokenlane.kube.client import ApiError, KubeApi, Resource, label_selector
from tokenlane.kube.credentials import (
    Authenticator,
    Credentials,
    CredentialsError,
    NoCredentials,
    in_cluster,
    in_cluster_namespace,
    load,
    load_kubeconfig,
)

__all__ = [
    "ApiError", "Authenticator", "Credentials", "CredentialsError", "KubeApi", "NoCredentials", "Resource",
    "in_cluster", "in_cluster_namespace", "label_selector", "load", "load_kubeconfig",
]
