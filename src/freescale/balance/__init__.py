"""Sequence load balancing (DESIGN.md section 2.1): partitioners, cost model +
AutoTune, planner + plan log, coordinator (data movement), the trainer hook and the
simulator.

Roles are kept apart: ``cost_model`` turns lengths into costs, ``partitioners`` turn
costs into assignments, ``planner`` chooses, measures and logs, ``coordinator`` moves
the samples, ``hook`` runs them inside the trainer. See ``README.md`` in this folder
for the flow and the exact semantics.
"""

from freescale.balance.coordinator import (
    BalanceCoordinator,
    CoordinatorConfig,
    MoveStats,
    PendingBalance,
)
from freescale.balance.cost_model import AutoTune, AutoTuneConfig, CostModel
from freescale.balance.partitioners import (
    PARTITIONERS,
    Assignment,
    Partitioner,
    fbs,
    get_partitioner,
    identity,
    kk,
    lower_bound,
    register_partitioner,
    straggler_share,
    vbs,
)
from freescale.balance.planner import BalanceConfig, GlobalMetadata, Plan, PlanLog, Planner

__all__ = [
    "Assignment",
    "AutoTune",
    "AutoTuneConfig",
    "BalanceConfig",
    "BalanceCoordinator",
    "BalanceHook",
    "CoordinatorConfig",
    "CostModel",
    "GlobalMetadata",
    "MoveStats",
    "PARTITIONERS",
    "Partitioner",
    "PendingBalance",
    "Plan",
    "PlanLog",
    "Planner",
    "SimConfig",
    "fbs",
    "get_partitioner",
    "identity",
    "kk",
    "lower_bound",
    "register_partitioner",
    "simulate",
    "simulate_main",
    "add_balance_flags",
    "balance_config_from_args",
    "balance_hook_from_args",
    "straggler_share",
    "vbs",
]

_SIMULATOR = ("SimConfig", "simulate", "simulate_main")
_HOOK = ("BalanceHook", "add_balance_flags", "balance_config_from_args", "balance_hook_from_args")


def __getattr__(name: str) -> object:
    # lazy: `python -m freescale.balance.simulator` must not find it imported already
    if name in _SIMULATOR:
        from freescale.balance import simulator

        return getattr(simulator, name)
    # lazy: the trainer hook imports the trainer (model, embeddings); the pure parts
    # of this package must stay importable without them
    if name in _HOOK:
        from freescale.balance import hook

        return getattr(hook, name)
    raise AttributeError(f"module 'freescale.balance' has no attribute '{name}'")
