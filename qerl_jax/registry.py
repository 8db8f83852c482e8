"""Named registries: the single source of every name a user picks (formats, loss types,
policy objectives, advantage estimators, AQN schedules, presets, kernel choices, ...).

A registry maps a name to an implementation, or to where one is registered: "module:attr" (the
object at that path) or "module" (importing the module registers the name). So the built-in
names are known without importing JAX: the config schema and `--help` read `names()`, and
`get(name)` imports the implementation the first time it is asked for. A name registered from
outside the package (a plug-in module named in `config.imports`) is selectable like a built-in
one.

Every registry is defined at the end of this module, its built-in names listed lazily; each
implementation module registers into its registry (e.g. `register_format(Format(...))` in
quant/nvfp4.py fills the "nvfp4" entry). So the config schema imports this module only: the
modules the names come from (JAX-side ones, and tasks, rewards and prompts, which import the
run infrastructure that imports the schema) load when an entry is first asked for.

    @LOSS_NORMALIZERS.register("my_loss")
    def my_loss(masked, mask, sequences, global_valid_tokens, config): ...
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Iterable, Mapping

_DECORATE = object()   # register()'s value when it is used as a decorator


class Registry:
    """Names -> implementations (or lazy entries, resolved on first `get`)."""

    def __init__(self, kind: str):
        self.kind = kind                      # what the names are, for error messages
        self._entries: dict[str, Any] = {}    # name -> value, or _Lazy before first get
        self._aliases: dict[str, str] = {}    # alias -> registered name
        self._facts: dict[str, dict] = {}     # name -> facts known before its import

    @classmethod
    def of(cls, kind: str, entries: Mapping[str, Any]) -> "Registry":
        """A registry holding `entries` (name -> value) in order."""
        registry = cls(kind)
        for name, value in entries.items():
            registry.register(name, value)
        return registry

    def register(self, name: str, value: Any = _DECORATE, *, aliases: Iterable[str] = (),
                 replace: bool = False):
        """Registers `value` under `name`; without a value, a decorator that registers the
        decorated object and returns it unchanged."""
        if value is _DECORATE:
            def decorator(obj):
                self.register(name, obj, aliases=aliases, replace=replace)
                return obj
            return decorator
        self._add(name, value, aliases, replace)
        return value

    def register_lazy(self, name: str, path: str, *, aliases: Iterable[str] = (),
                      **facts: Any) -> None:
        """Registers "module:attr" (the object at that path) or "module" (whose import
        registers `name`) under `name` without importing it. `facts`: attributes of the
        implementation that `fact()` answers without the import (checked when it registers)."""
        if not isinstance(path, str) or not path or path.startswith(":") or path.endswith(":"):
            raise ValueError(f"{self.kind} {name!r}: lazy path must be 'module:attr' or "
                             f"'module', got {path!r}")
        self._add(name, _Lazy(path), aliases, replace=False)
        self._facts[name] = dict(facts)

    def _add(self, name: str, value: Any, aliases: Iterable[str], replace: bool) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} name must be a non-empty string, got {name!r}")
        existing = self._entries.get(name)
        taken = name in self._entries or name in self._aliases
        # the module a lazy entry names registers the entry's implementation on import
        fills_lazy = (isinstance(existing, _Lazy) and not isinstance(value, _Lazy)
                      and existing.module in sys.modules)
        if taken and not replace and not fills_lazy:
            # re-registering the same object (a module imported twice) is harmless
            if existing is value:
                return
            raise ValueError(f"{self.kind} {name!r} is already registered")
        for key, fact in self._facts.get(name, {}).items() if fills_lazy else ():
            if getattr(value, key, fact) != fact:
                raise ValueError(f"{self.kind} {name!r}: {key}={getattr(value, key)!r}, but "
                                 f"qerl_jax.registry lists it with {key}={fact!r}")
        aliases = tuple(aliases)
        for alias in aliases:
            if alias == name or alias in self._entries or self._aliases.get(alias, name) != name:
                raise ValueError(f"{self.kind} alias {alias!r} is already taken")
        self._entries[name] = value
        for alias in aliases:
            self._aliases[alias] = name

    def unregister(self, name: str) -> None:
        """Removes `name` and its aliases (tests and plug-ins that replace an entry)."""
        self._entries.pop(name, None)
        self._facts.pop(name, None)
        for alias in [a for a, target in self._aliases.items() if target == name]:
            del self._aliases[alias]

    def names(self, *, with_aliases: bool = False) -> tuple[str, ...]:
        """The registered names in registration order (then the aliases, if asked)."""
        names = tuple(self._entries)
        return names + tuple(self._aliases) if with_aliases else names

    def aliases(self) -> dict[str, str]:
        """alias -> registered name."""
        return dict(self._aliases)

    def canonical(self, name: str) -> str:
        """The registered name of `name` or of the entry it is an alias of; KeyError (one line
        listing the known names) for an unknown one."""
        name = self._aliases.get(name, name) if isinstance(name, str) else name
        if name not in self._entries:
            raise KeyError(self.unknown_message(name))
        return name

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._entries or name in self._aliases)

    def __iter__(self):
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def unknown_message(self, name: object) -> str:
        """"unknown KIND 'name'; known: a, b, c" (aliases included)."""
        known = ", ".join(self.names(with_aliases=True))
        return f"unknown {self.kind} {name!r}; known: {known}"

    def get(self, name: str) -> Any:
        """The implementation registered under `name` (or an alias), imported if lazy."""
        name = self.canonical(name)
        value = self._entries[name]
        if isinstance(value, _Lazy):
            value = value.resolve(self, name)
            self._entries[name] = value
        return value

    def fact(self, name: str, key: str) -> Any:
        """Attribute `key` of the implementation of `name`, from the facts its lazy entry lists
        when it has not been imported (so the config schema needs no JAX)."""
        name = self.canonical(name)
        value = self._entries[name]
        if isinstance(value, _Lazy):
            facts = self._facts.get(name, {})
            if key in facts:
                return facts[key]
            value = self.get(name)
        return getattr(value, key)

    def items(self) -> list[tuple[str, Any]]:
        """(name, implementation) for every entry, importing the lazy ones."""
        return [(name, self.get(name)) for name in self.names()]


class _Lazy:
    __slots__ = ("module", "attr")

    def __init__(self, path: str):
        self.module, _, self.attr = path.partition(":")

    def resolve(self, registry: Registry, name: str) -> Any:
        importlib.import_module(self.module)
        value = registry._entries.get(name)   # noqa: SLF001 - filled by the module's import
        if not isinstance(value, _Lazy):
            return value
        if not self.attr:
            raise ImportError(f"{registry.kind} {name!r}: importing {self.module} did not "
                              "register it")
        try:
            return getattr(sys.modules[self.module], self.attr)
        except AttributeError:
            raise ImportError(f"{registry.kind} {name!r}: {self.module} has no "
                              f"{self.attr!r}") from None


def import_plugins(modules: Iterable[str], on_error: Callable[[str, BaseException], None]):
    """Imports each plug-in module (its import registers its names); `on_error(module, exc)`
    turns a failed import into the caller's error."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - reported by the caller with the module's name
            on_error(module, exc)


def _lazy(kind: str, entries: Mapping[str, str],
          aliases: Mapping[str, tuple[str, ...]] | None = None) -> Registry:
    registry = Registry(kind)
    for name, path in entries.items():
        registry.register_lazy(name, path, aliases=(aliases or {}).get(name, ()))
    return registry


# ----------------------------------------------------------------------------- the registries
# Implementations that need JAX, listed by name here so that the config schema needs none.

# quant/formats.py: Format objects (register_format)
FORMATS = Registry("weight format")
FORMATS.register_lazy("bf16", "qerl_jax.quant.formats", is_quantized=False)
for _name in ("nvfp4", "mxfp4", "nf4"):
    FORMATS.register_lazy(_name, f"qerl_jax.quant.{_name}", is_quantized=True)
# rl/losses.py: how the per-token losses are aggregated (register_loss_normalizer); the
# papers' and TRL's names are aliases
LOSS_NORMALIZERS = _lazy("loss type", {
    "sequence_mean": "qerl_jax.rl.losses", "micro_batch_token_mean": "qerl_jax.rl.losses",
    "constant_length_sum": "qerl_jax.rl.losses", "batch_token_mean": "qerl_jax.rl.losses"},
    aliases={"sequence_mean": ("grpo",), "micro_batch_token_mean": ("bnpo",),
             "constant_length_sum": ("dr_grpo",), "batch_token_mean": ("dapo",)})
# rl/objectives.py: the per-token policy loss (register_policy_objective)
POLICY_OBJECTIVES = _lazy("policy objective", {
    name: "qerl_jax.rl.objectives" for name in ("clipped_surrogate", "gspo", "gspo_token",
                                                 "cispo")})
# rl/rollout_correction.py: importance weights pi_old / pi_rollout on the policy loss
# (register_rollout_correction)
ROLLOUT_CORRECTIONS = _lazy("rollout correction", {
    name: "qerl_jax.rl.rollout_correction"
    for name in ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")})
# rl/advantages.py: rewards -> advantages (register_advantage_estimator)
ADVANTAGE_ESTIMATORS = _lazy("advantage estimator", {
    name: "qerl_jax.rl.advantages" for name in ("group_normalized", "mean_centered", "rloo")},
    aliases={"group_normalized": ("grpo",), "mean_centered": ("drgrpo",)})
# aqn.py: step -> noise std (register_aqn_schedule)
AQN_SCHEDULES = _lazy("AQN schedule", {"released_code": "qerl_jax.aqn",
                                       "paper": "qerl_jax.aqn"})
# models/config.py: architecture presets (register_preset)
MODEL_PRESETS = _lazy("model preset", {name: "qerl_jax.models.config" for name in (
    "qwen2p5_0p5b", "qwen2p5_1p5b", "qwen2p5_3b", "qwen2p5_7b", "qwen2p5_14b", "qwen2p5_32b",
    "qwen2p5_72b", "llama3p1_8b", "tiny_qwen2")})

# rewards/: f(completion, gold) -> float (register_reward; the package registers the built-ins)
REWARDS = _lazy("reward", {name: "qerl_jax.rewards" for name in (
    "format", "gsm8k_exact", "gsm8k_numeric", "math_verify", "arithmetic",
    "arithmetic_last_integer")})
# tasks.py: Task objects (register_task)
TASKS = _lazy("task", {name: "qerl_jax.tasks" for name in ("gsm8k", "math", "arithmetic")})
# data/prompts.py: question -> (user message, system message or None)
PROMPT_STYLES = _lazy("prompt style", {name: "qerl_jax.data.prompts" for name in (
    "paper", "system", "plain")})

# Closed choices of one implementation: name -> what the implementation reads.
# data/arithmetic.py: 'a+b=' or 'What is a + b?'
ARITHMETIC_PHRASINGS = Registry.of("arithmetic phrasing", {"expression": "expression",
                                                           "question": "question"})
SWITCH = Registry.of("switch", {"auto": None, "on": True, "off": False})   # None: per device
# sampling.py: the rollouts' KV cache (None: the compute dtype)
KV_CACHE_DTYPES = Registry.of("KV-cache dtype", {"auto": None, "int8": "int8",
                                                  "float8_e4m3fn": "float8_e4m3fn"})
# quant/kernel_options.py: the Mosaic decode launches' schedule
MOSAIC_SCHEDULES = Registry.of("Mosaic schedule", {"auto": "auto", "split_k": "split_k",
                                                   "warp_specialized": "warp_specialized"})
# quant/kernel_options.py: the decode matmul's left operand (None: per format)
WEIGHT_AS_LHS = Registry.of("left dot operand", {"auto": None, "weights": True,
                                                 "activations": False})
# pallas_kernels' FormatSpec.decoders: the in-kernel 4-bit decoders
KERNEL_DECODERS = Registry.of("4-bit decoder", {name: name for name in (
    "fp8", "ptx_scaled", "ptx_paired_scales", "lut", "lut16", "select")})
# infra/wandb_logging.py: wandb.init's mode (None: no W&B run)
WANDB_MODES = Registry.of("W&B mode", {"off": None, "online": "online", "offline": "offline"})
# infra/device_offload.py: where the frozen weights wait while a program compiles
OFFLOAD_METHODS = Registry.of("offload method", {"auto": "numpy", "numpy": "numpy",
                                                 "pinned_host": "pinned_host"})
# lora.py: the projections that can get an adapter
LORA_PROJECTIONS = Registry.of("LoRA projection", {name: name for name in (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")})
