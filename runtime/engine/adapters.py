"""LoRA adapters served next to the base model (multi-LoRA, docs/lora.md): where an adapter's
folder comes from, and the engine's table of the adapters it serves.

An adapter is loaded by the executor (`add_adapter(name, folder)`, which validates it and
keeps its weights in host memory; the executor makes the adapters of each step resident in
its slots). The engine keeps `AdapterTable`: which names are served, where each came from
(`model.adapters` in runtime.yaml, or `POST /v1/load_lora_adapter`), and which were
removed but still have requests in flight: an unload takes effect for new requests at once
(they get 404) and frees the weights when the adapter's last request has finished.

Rules (documented in docs/lora.md):
- a config reload loads the adapters it adds and unloads those it removes; a bad one refuses
  the whole reload (nothing of it applies) with an error naming the adapter;
- adapters loaded through the API survive config reloads; a reload whose `model.adapters`
  names one takes it over (same source), and a different source under a served name is
  refused (give the new version a new name, as vLLM asks);
- a source URI (`hf://`, `s3://`) is fetched with `tokenlane.runtime.sources` into
  `model.adapterCacheDir` (default: a folder under the system temp dir).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tokenlane.runtime.config import ADAPTER_NAME_RE, ModelConfig

CONFIG, API = "config", "api"  # where a served adapter came from
_URI_PREFIXES = ("hf://", "s3://")


@dataclass(frozen=True)
class ServedAdapter:
    """One adapter the engine serves."""

    name: str
    source: str  # the path or URI it was loaded from, as given
    origin: str  # CONFIG or API
    rank: int = 0
    target_modules: tuple[str, ...] = ()
    bytes: int = 0


def check_adapter_name(name: str, base_name: str) -> None:
    """ValueError unless `name` may name an adapter next to the base `base_name`."""
    if not isinstance(name, str) or not ADAPTER_NAME_RE.match(name):
        raise ValueError(f"{name!r} is not a valid adapter name (lowercase letters, digits, '-', '.', '_'; "
                         "starts and ends with a letter or digit; at most 128 characters)")
    if name == base_name:
        raise ValueError(f"adapter name {name!r} is the served model's own name; pick another")


def default_adapter_cache_dir() -> str:
    return os.path.join(tempfile.gettempdir(), "tokenlane-adapters")


def adapter_folder(name: str, source: str, model: ModelConfig) -> str:
    """The local folder of adapter `name` from `source`: a folder as is, or a source URI
    fetched into the adapter cache. ValueError naming the adapter if it cannot be had."""
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"adapter {name!r}: the path is empty")
    source = source.strip()
    if not source.startswith(_URI_PREFIXES):
        if "://" in source:
            raise ValueError(f"adapter {name!r}: {source!r} is neither a folder nor an hf:// or s3:// source")
        return source
    from tokenlane.runtime.sources.fetch import FetchOptions, fetch_model
    from tokenlane.runtime.sources.uri import parse_source

    cache_dir = model.adapter_cache_dir or default_adapter_cache_dir()
    try:
        parsed = parse_source(source)
        dest = Path(cache_dir) / "by-name" / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        result = fetch_model(parsed, dest, FetchOptions(cache_dir=cache_dir))
    except Exception as exc:  # SourceError, DestinationError, OSError, a bad URI: the load is refused
        raise ValueError(f"adapter {name!r}: cannot fetch {source}: {exc}") from None
    return str(result.path)


def info_fields(info) -> dict:
    """rank, target_modules and bytes of the executor's AdapterInfo (any object with them)."""
    modules = tuple(getattr(info, "target_modules", ()) or ())
    return {"rank": int(getattr(info, "rank", 0) or 0), "target_modules": modules,
            "bytes": int(getattr(info, "bytes", 0) or 0)}


class AdapterTable:
    """The adapters being served (`served`, replaced whole on each change so readers on other
    threads see a consistent dict) and those unloaded but still in use (`unloading`)."""

    def __init__(self) -> None:
        self.served: dict[str, ServedAdapter] = {}
        self.unloading: set[str] = set()

    def __contains__(self, name: object) -> bool:
        return name in self.served

    def names(self) -> list[str]:
        return list(self.served)

    def add(self, adapter: ServedAdapter) -> None:
        self.served = {**self.served, adapter.name: adapter}

    def remove(self, name: str) -> ServedAdapter:
        """Stop serving `name` (KeyError if it is not served); its weights go once unused."""
        served = dict(self.served)
        adapter = served.pop(name)
        self.served = served
        self.unloading.add(name)
        return adapter

    def adopt(self, name: str) -> None:
        """An API-loaded adapter the config now names: it becomes the config's."""
        adapter = self.served[name]
        self.add(ServedAdapter(adapter.name, adapter.source, CONFIG, adapter.rank, adapter.target_modules,
                               adapter.bytes))

    def config_names(self) -> dict[str, str]:
        return {a.name: a.source for a in self.served.values() if a.origin == CONFIG}

