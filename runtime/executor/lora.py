"""LoRA adapters: PEFT folders read and checked into host memory, and the device slot table.

An adapter is a PEFT LoRA folder (`adapter_config.json` + `adapter_model.safetensors`, as
`PeftModel.save_pretrained` writes it) for the served base model. `load_peft_adapter` reads it
whole and checks it against the base before anything reaches the device: the file names and
formats, every weight's name (`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`
and so on; q, k, v, o, gate, up and down are supported), every shape against the base's
projections, the rank against `engine.maxLoraRank`, finite values, and the config options
this runtime cannot apply (DoRA, LoRA biases, `modules_to_save`, embedding or LM-head
targets). Any problem is a ValueError that names the adapter. The checked weights stay in host
memory (`HostAdapter`).

`LoraSlots` holds `engine.maxLoras` adapters on the device at once, each slot sized for
`maxLoraRank`, allocated at start-up before the KV pool is sized (so on a GPU the pool is what
is left after them). Per layer and fused projection it keeps the stacked tensors that
kernels/lora.py multiplies: q/k/v share one stacked A (the model computes them in one matmul,
`qkv_proj`), gate/up another (`gate_up_proj`); o and down have their own. Each step
`make_resident` copies the adapters of the step's requests that are not resident into a free
slot, else into the least recently used slot that this step does not use.

Under tensor/pipeline parallel each rank's slots hold its share only (runtime/executor/sharding.py,
`lora_shard`): its stage's layers, and each module cut like the base projection.

`scaling` is PEFT's: lora_alpha / r, or lora_alpha / sqrt(r) with `use_rslora`, per module
where `rank_pattern` / `alpha_pattern` give a module its own rank or alpha.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from tokenlane.kernels.lora import LoraSegments, add_lora
from tokenlane.runtime.executor.sharding import ShardPlan, lora_shard

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The model's projections and the PEFT modules each computes (in column order of its output).
PROJECTION_GROUPS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_WEIGHT_NAME = re.compile(r"base_model\.model\.(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def module_shapes(args) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target module of the base (ModelArgs)."""
    h, q, kv, i = args.hidden_size, args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim, \
        args.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    rank: int  # the largest rank of its modules
    target_modules: tuple[str, ...]  # of TARGET_MODULES, those it has weights for
    bytes: int  # host memory of its weights


@dataclass
class HostAdapter:
    """A checked adapter in host memory: per (layer, module) A [r, in] and B [out, r] as PEFT
    stores them, and the module's scaling."""

    info: AdapterInfo
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    scaling: dict[tuple[int, str], float]


def _pattern_value(patterns: dict, module_name: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches a module name it ends with."""
    for key, value in (patterns or {}).items():
        if re.fullmatch(rf"(.*\.)?{key}", module_name):
            return value
    return default


def load_peft_adapter(name: str, folder: str | Path, args, max_rank: int) -> HostAdapter:
    """Read and check a PEFT LoRA folder for the base `args` (ModelArgs); ValueError naming the
    adapter on any problem."""
    def refuse(reason: str) -> ValueError:
        return ValueError(f"adapter {name!r}: {reason}")

    folder = Path(folder)
    if not folder.is_dir():
        raise refuse(f"{str(folder)!r} is not a folder")
    config_file, weights_file = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    if not config_file.is_file():
        raise refuse(f"no {ADAPTER_CONFIG} in {str(folder)!r}")
    if not weights_file.is_file():
        other = (" (only safetensors weights are read, not adapter_model.bin)"
                 if (folder / "adapter_model.bin").exists() else "")
        raise refuse(f"no {ADAPTER_WEIGHTS} in {str(folder)!r}{other}")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise refuse(f"cannot read {ADAPTER_CONFIG}: {exc}") from exc
    if not isinstance(config, dict):
        raise refuse(f"{ADAPTER_CONFIG} is not a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise refuse(f"peft_type {peft_type!r} is not supported (only LORA)")
    if config.get("use_dora"):
        raise refuse("DoRA adapters (use_dora) are not supported")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise refuse(f"LoRA biases (bias={config.get('bias')!r}, lora_bias) are not supported")
    if config.get("modules_to_save"):
        raise refuse(f"modules_to_save {config['modules_to_save']} is not supported (full copies of base modules)")
    targets = config.get("target_modules")
    if isinstance(targets, (list, tuple)):
        unknown = sorted(set(targets) - set(TARGET_MODULES))
        if unknown:
            raise refuse(f"target modules {unknown} are not supported; supported: {', '.join(TARGET_MODULES)}")
    try:
        rank_default = int(config["r"])
        alpha_default = float(config.get("lora_alpha", rank_default))
    except (KeyError, TypeError, ValueError) as exc:
        raise refuse(f"{ADAPTER_CONFIG} needs a numeric r and lora_alpha ({exc})") from exc
    rslora, fan_in_fan_out = bool(config.get("use_rslora")), bool(config.get("fan_in_fan_out"))

    from safetensors import safe_open

    tensors: dict[tuple[int, str, str], torch.Tensor] = {}
    try:
        with safe_open(str(weights_file), framework="pt") as f:
            for key in f.keys():
                match = _WEIGHT_NAME.fullmatch(key)
                if match is None:
                    raise refuse(f"weight {key!r} is not a LoRA A/B weight of q, k, v, o, gate, up or down "
                                 "(embeddings, LM head, biases and DoRA magnitudes are not supported)")
                layer, parent, module, which = int(match[1]), match[2], match[3], match[4]
                if module not in TARGET_MODULES or _PARENT[module] != parent:
                    raise refuse(f"weight {key!r}: module {parent}.{module} is not supported; "
                                 f"supported: {', '.join(TARGET_MODULES)}")
                if layer >= args.num_layers:
                    raise refuse(f"weight {key!r} names layer {layer}; the base model has {args.num_layers} layers")
                tensors[(layer, module, which)] = f.get_tensor(key)
    except ValueError:
        raise
    except Exception as exc:  # a corrupt or unreadable file: SafetensorError, OSError, ...
        raise refuse(f"cannot read {ADAPTER_WEIGHTS}: {exc}") from exc
    if not tensors:
        raise refuse(f"{ADAPTER_WEIGHTS} holds no LoRA weights")

    shapes = module_shapes(args)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    scaling: dict[tuple[int, str], float] = {}
    total_bytes, max_seen = 0, 0
    for (layer, module, which) in sorted(tensors):
        if which != "A":
            if (layer, module, "A") not in tensors:
                raise refuse(f"layer {layer} {module}: lora_B without lora_A")
            continue
        if (layer, module, "B") not in tensors:
            raise refuse(f"layer {layer} {module}: lora_A without lora_B")
        a, b = tensors[(layer, module, "A")], tensors[(layer, module, "B")]
        if fan_in_fan_out:  # stored transposed (Conv1D-style bases)
            a, b = a.T, b.T
        in_features, out_features = shapes[module]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape[0] != out_features \
                or a.shape[0] != b.shape[1]:
            raise refuse(f"layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                         f"the base's {in_features} -> {out_features} projection (an adapter of another base model?)")
        rank = a.shape[0]
        if rank > max_rank:
            raise refuse(f"rank {rank} (layer {layer} {module}) is above engine.maxLoraRank {max_rank}")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise refuse(f"layer {layer} {module}: weights must be floating point, got {a.dtype}, {b.dtype}")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise refuse(f"layer {layer} {module}: weights hold NaN or infinite values")
        full_name = f"model.layers.{layer}.{_PARENT[module]}.{module}"
        r_cfg = int(_pattern_value(config.get("rank_pattern"), full_name, rank_default))
        alpha = float(_pattern_value(config.get("alpha_pattern"), full_name, alpha_default))
        if r_cfg != rank:
            raise refuse(f"layer {layer} {module}: weights of rank {rank}, but the config says r={r_cfg}")
        weights[(layer, module)] = (a.contiguous(), b.contiguous())
        scaling[(layer, module)] = alpha / math.sqrt(rank) if rslora else alpha / rank
        total_bytes += a.nbytes + b.nbytes
        max_seen = max(max_seen, rank)
    found = tuple(m for m in TARGET_MODULES if any(key[1] == m for key in weights))
    info = AdapterInfo(name=name, rank=max_seen, target_modules=found, bytes=total_bytes)
    return HostAdapter(info=info, weights=weights, scaling=scaling)


class LoraProjection:
    """One layer's slot tensors of one model projection (kernels/lora.py's layout), applied to
    that projection's output by `apply`."""

    def __init__(self, modules: tuple[str, ...], in_features: int, widths: list[int], num_slots: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device):
        self.modules = modules
        self.widths = widths
        self.lora_a = torch.zeros((num_slots, len(modules) * max_rank, in_features), dtype=dtype, device=device)
        self.lora_b = [torch.zeros((num_slots, max_rank, n), dtype=dtype, device=device) for n in widths]
        self.scaling = torch.zeros((num_slots, len(modules)), dtype=torch.float32, device=device)

    @property
    def nbytes(self) -> int:
        return self.lora_a.nbytes + sum(b.nbytes for b in self.lora_b) + self.scaling.nbytes

    def apply(self, out: torch.Tensor, x: torch.Tensor, segments: Optional[LoraSegments], backend: str) -> None:
        """Add the step's adapter deltas into `out` [T, sum(widths)] (the projection's output)."""
        if segments is None:
            return
        outs = out.split(self.widths, dim=1) if len(self.widths) > 1 else (out,)
        add_lora(outs, x, self.lora_a, self.lora_b, self.scaling, segments, backend, check=False)

    def load(self, slot: int, adapter: HostAdapter, layer: int, rank: int,
             shard: Optional[tuple[ShardPlan, int]] = None) -> None:
        """Slot `slot` := the adapter's weights of (global) layer `layer`, stacked by `rank`
        (zero elsewhere); `shard` = (this rank's ShardPlan, head_dim) cuts them to its share."""
        self.lora_a[slot].zero_()
        self.scaling[slot].zero_()
        for g, module in enumerate(self.modules):
            self.lora_b[g][slot].zero_()
            pair = adapter.weights.get((layer, module))
            if pair is None:
                continue
            a, b = pair if shard is None else lora_shard(module, *pair, *shard)
            r = a.shape[0]
            self.lora_a[slot, g * rank : g * rank + r].copy_(a)
            self.lora_b[g][slot, :r].copy_(b.T)
            self.scaling[slot, g] = adapter.scaling[(layer, module)]


class LoraSlots:
    """`num_slots` resident adapters of up to `max_rank`, for every layer and projection.

    `args` are the modules' shapes: with `shard` (a tensor/pipeline-parallel rank), this rank's
    (sharding.local_args), its layers the stage's from `shard.layer_start`."""

    def __init__(self, args, num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device,
                 shard: Optional[ShardPlan] = None):
        if num_slots < 1 or max_rank < 1:
            raise ValueError(f"LoRA slots need engine.maxLoras >= 1 and engine.maxLoraRank >= 1, "
                             f"got {num_slots} and {max_rank}")
        self.num_slots, self.max_rank, self.device = num_slots, max_rank, torch.device(device)
        self.shard = shard
        self.layer_start = shard.layer_start if shard is not None else 0
        self._cut = (shard, args.head_dim) if shard is not None and shard.sharded else None
        shapes = module_shapes(args)
        self.layers: list[dict[str, LoraProjection]] = []
        for _ in range(args.num_layers):
            self.layers.append({
                proj: LoraProjection(modules, shapes[modules[0]][0], [shapes[m][1] for m in modules],
                                     num_slots, max_rank, dtype, device)
                for proj, modules in PROJECTION_GROUPS.items()
            })
        self.resident: list[Optional[str]] = [None] * num_slots
        self.ranks: list[int] = [0] * num_slots
        self._last_used: list[int] = [-1] * num_slots
        self._clock = 0
        self.loads = 0  # copies into a slot (a miss), for tests and logs

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for layer in self.layers for p in layer.values())

    def slot_of(self, name: str) -> Optional[int]:
        return self.resident.index(name) if name in self.resident else None

    def evict(self, name: str) -> None:
        slot = self.slot_of(name)
        if slot is not None:
            self.resident[slot], self.ranks[slot], self._last_used[slot] = None, 0, -1

    def make_resident(self, names: list[str], adapters: dict[str, HostAdapter]) -> dict[str, int]:
        """Slots of this step's adapters (distinct names, at most `num_slots`), copying in those
        not resident: into a free slot, else the least recently used slot of no name here."""
        if len(names) > self.num_slots:
            raise ValueError(f"{len(names)} adapters in one step, but engine.maxLoras is {self.num_slots}")
        self._clock += 1
        wanted = set(names)
        slots: dict[str, int] = {}
        for name in names:
            slot = self.slot_of(name)
            if slot is None:
                free = [s for s, held in enumerate(self.resident) if held is None]
                if free:
                    slot = free[0]
                else:
                    slot = min((s for s, held in enumerate(self.resident) if held not in wanted),
                               key=lambda s: self._last_used[s])
                self._load(slot, adapters[name])
            self._last_used[slot] = self._clock
            slots[name] = slot
        return slots

    def _load(self, slot: int, adapter: HostAdapter) -> None:
        rank = adapter.info.rank
        for layer, projections in enumerate(self.layers):
            for projection in projections.values():
                projection.load(slot, adapter, self.layer_start + layer, rank, self._cut)
        self.resident[slot], self.ranks[slot] = adapter.info.name, rank
        self.loads += 1


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "AdapterInfo", "HostAdapter", "LoraProjection", "LoraSlots",
           "PROJECTION_GROUPS", "TARGET_MODULES", "load_peft_adapter", "module_shapes"]
