"""The memory model, one stage: what each rank should hold, predicted before anything runs.

Below the families (engines, trims), the ranks and the analysis, above core and models: the architecture reader, the
tensor placement types and cuts every placement rule speaks, the caching allocator's replay, the weights per rank, and
the memory above the weights (KV cache, activations, logits) per rank and workload. Nothing here imports an engine or
a trim: a caller hands in the placement rule (dsexp.engines.placement.rule_for)."""
