"""How many state slots the prefix cache's checkpoints get (engine/kv_cache.py's `plan_cache` carves the
rest of the budget into running slots and pages).

Sized from the workload: `max_num_seqs` live sessions, each keeping `prefix_cache_checkpoints_per_session`
checkpoints (default 8: a turn takes up to four, at a second-hit branch point, the prompt's last full page,
the prompt end and the end of generation; the newest turn's and the turn's before). Eviction drops a
session's older ones first (planning/eviction.py). Within half of the memory the running slots leave,
because the pages of those same sessions' contexts need the other half; at least 4. Before this the
checkpoints got 4 per running slot within a quarter of the whole budget (179 slots of 43 MB, the 48B
shape's, in 29 GiB; now 326). On the CPU agentic replay of docs/BENCHMARKS.md with 8 sessions, 4 per
session reached 79% of the theoretical hit rate and 8 per session 88%.
"""

from __future__ import annotations

from hyserve.config import EngineConfig

MIN_CHECKPOINT_SLOTS = 4


def checkpoint_slots(cfg: EngineConfig, budget_bytes: int, slot_bytes: int) -> int:
    """Checkpoint slots for `cfg` in a cache budget of `budget_bytes` with state slots of `slot_bytes`."""
    if cfg.num_checkpoint_slots is not None:
        return cfg.num_checkpoint_slots
    if not cfg.enable_prefix_caching:
        return 0
    wanted = cfg.max_num_seqs * cfg.prefix_cache_checkpoints_per_session
    room = max(0, budget_bytes - cfg.max_num_seqs * slot_bytes) // 2 // max(1, slot_bytes)
    return max(MIN_CHECKPOINT_SLOTS, min(wanted, room))
