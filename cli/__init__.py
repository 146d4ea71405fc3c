"""tokenlane: per-lane continuous-batching LLM serving and its Kubernetes operator.

The distribution maps the repository's top-level folders into this namespace:
``tokenlane.runtime`` (runtime/), ``tokenlane.kernels`` (kernels/), ``tokenlane.operator``
(operator/). ``tokenlane.cli`` is the console script.
"""

__version__ = "0.1.0"
