"""Plans made once at start-up from the model's shapes and the device: what a step costs
(`step_cost`, `ceilings`), the step's token budget (`step_budget`), the split of the cache memory
(`cache_split`), the checkpoint eviction order (`eviction`) and the warm-up's shapes (`warmup`)."""
