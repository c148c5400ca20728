"""How a plan runs its layers besides its degrees: activation recompute (modes and
Megatron-Core's refinements) and what it captures in CUDA graphs.

What lives here: the enums, module lists and parsers of ``plan.recompute`` and
``plan.cuda_graphs`` (re-exported by :mod:`stage_dse.spec.plan`). What does not: any cost.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple

from stage_dse.errors import ConfigError
from stage_dse.spec._validate import coerce_enum, non_negative_int

__all__ = [
    "CUDA_GRAPH_MODULES",
    "RECOMPUTE_MODULES",
    "Recompute",
    "RecomputeChoice",
    "cuda_graphs_label",
    "parse_cuda_graphs",
    "parse_recompute",
]


class Recompute(StrEnum):
    """Activation recomputation (Korthikanti et al., MLSys 2023)."""

    NONE = "none"
    SELECTIVE = "selective"
    """Recompute the attention core (QK^T, softmax, dropout): drops the a*s^2 activations."""
    FULL = "full"
    """Keep only each layer's input; rerun the layer's forward during backward."""
    OP = "op"
    """PyTorch per-op selective checkpointing as torchtitan applies it (``selective_ac_option =
    "op"``, ``torchtitan/parallelisms/parallelize_llama.py``): keep the outputs of fused
    attention, of reduce-scatters and of every other matmul (the 1st, 3rd, ... of a layer's
    forward); rerun everything else (the other matmuls, norms, rotary, activations) in
    backward."""


CUDA_GRAPH_MODULES: tuple[str, ...] = (
    "attn",
    "mlp",
    "moe_router",
    "moe_preprocess",
    "full_iteration",
)
"""What a run captures in CUDA graphs (Megatron-Core ``--cuda-graph-impl`` and
``--cuda-graph-scope``): per layer its attention half (``attn``), a dense layer's MLP half
(``mlp``), a MoE layer's router (``moe_router``) and the dispatch's metadata before it
(``moe_preprocess``), or the whole forward-backward (``full_iteration``). What is not captured
is issued op by op from the host; a dropless MoE layer's dispatch, experts and combine have
data-dependent shapes and stay eager under per-layer graphs (Megatron-Core MoE README, "CUDA
Graph")."""


def cuda_graphs_label(modules: tuple[str, ...]) -> str:
    """``plan.cuda_graphs`` as rows and sweeps name it (``none``, ``attn+moe_router``)."""
    return "+".join(modules) or "none"


def parse_cuda_graphs(value: object) -> tuple[str, ...]:
    """``plan.cuda_graphs`` as modules in :data:`CUDA_GRAPH_MODULES` order: from ``"none"``,
    ``"attn+moe_router"``, ``"full_iteration"`` or a list of names."""
    valid = ", ".join(CUDA_GRAPH_MODULES)
    if isinstance(value, str):
        value = [] if value.strip() in ("", "none") else value.replace(",", "+").split("+")
    if not isinstance(value, (list, tuple)):
        raise ConfigError(
            f"plan.cuda_graphs must be none or modules joined by '+' ({valid}), got {value!r}"
        )
    names = {str(m).strip() for m in value}
    unknown = sorted(names - set(CUDA_GRAPH_MODULES))
    if unknown:
        raise ConfigError(
            f"plan.cuda_graphs: unknown module {unknown[0]!r} (one of: {valid}, or none)"
        )
    if "full_iteration" in names and len(names) > 1:
        raise ConfigError(
            "plan.cuda_graphs=full_iteration captures the whole step: name it alone, got "
            + "+".join(m for m in CUDA_GRAPH_MODULES if m in names)
        )
    return tuple(m for m in CUDA_GRAPH_MODULES if m in names)


RECOMPUTE_MODULES: tuple[str, ...] = (
    "core_attn",
    "layernorm",
    "mla_up_proj",
    "mlp",
    "moe",
    "moe_act",
    "shared_experts",
)
"""Megatron-Core's selective-recompute modules (``TransformerConfig.recompute_modules``, used
with ``recompute_granularity="selective"``; its default is ``["core_attn"]``, the attention core
:attr:`Recompute.SELECTIVE` reruns): ``core_attn`` the attention core; ``layernorm`` the input
and pre-MLP norms, whose outputs are dropped and rebuilt from their inputs; ``mla_up_proj`` the
latent-attention up-projections and rotary embedding, whose outputs (the attention's query, key
and value) are dropped; ``moe_act`` the routed experts' activation, whose output is dropped;
``mlp`` the dense MLP, ``moe`` the whole mixture-of-experts layer (router, dispatch, experts,
combine, shared experts) and ``shared_experts`` the shared experts, each checkpointed: only its
input is kept and its forward, collectives included, reruns in backward."""


class RecomputeChoice(NamedTuple):
    """A recompute mode with its Megatron-Core refinements: the modules selective recompute
    reruns, or how many layers of each model chunk full recompute covers (0: all)."""

    mode: Recompute
    modules: tuple[str, ...] = ()
    layers: int = 0

    @property
    def label(self) -> str:
        """The label of the choice in result rows and sweeps: the mode,
        ``selective:<module>+<module>`` for a module list, ``full:<layers>`` for block
        recompute of that many layers per model chunk."""
        if self.modules:
            return f"{self.mode.value}:{'+'.join(self.modules)}"
        if self.layers:
            return f"{self.mode.value}:{self.layers}"
        return self.mode.value


def parse_recompute(value: object, modules: object = (), layers: object = 0) -> RecomputeChoice:
    """A recompute choice from a mode (``"full"``) or a label that refines it
    (``"selective:mla_up_proj+moe_act"``, ``"full:5"``); modules come back in
    :data:`RECOMPUTE_MODULES` order, empty for the default attention core."""
    if isinstance(value, Recompute) and not modules and not layers:
        return RecomputeChoice(value)
    if isinstance(value, str) and ":" in value:
        value, named = value.split(":", 1)
        if modules or layers:
            raise ConfigError(
                f"plan.recompute={value}:{named} names its refinement; drop "
                "recompute_modules and recompute_layers"
            )
        names = [m for m in named.split("+") if m]
        if value == Recompute.FULL.value and not set(names) <= set(RECOMPUTE_MODULES):
            try:
                layers = int(named)
            except ValueError:
                raise ConfigError(
                    f"plan.recompute=full:{named}: full recompute takes a layer count per model "
                    "chunk (e.g. full:5)"
                ) from None
        else:
            modules = names
    mode = coerce_enum(Recompute, "plan", "recompute", value)
    if isinstance(modules, str):
        modules = [m for m in modules.replace(",", "+").split("+") if m.strip()]
    names = [str(m).strip() for m in (modules or ())]
    for name in names:
        if name not in RECOMPUTE_MODULES:
            raise ConfigError(
                f"plan.recompute_modules: unknown module {name!r} "
                f"(one of: {', '.join(RECOMPUTE_MODULES)})"
            )
    if names and mode is not Recompute.SELECTIVE:
        raise ConfigError(
            f"plan.recompute_modules={'+'.join(names)} needs recompute=selective, "
            f"got recompute={mode.value}"
        )
    non_negative_int("plan", "recompute_layers", layers)
    if layers and mode is not Recompute.FULL:
        raise ConfigError(
            f"plan.recompute_layers({layers}) needs recompute=full (Megatron-Core's block "
            f"method), got recompute={mode.value}"
        )
    ordered = tuple(m for m in RECOMPUTE_MODULES if m in names)
    return RecomputeChoice(mode, () if ordered == ("core_attn",) else ordered, int(layers))
