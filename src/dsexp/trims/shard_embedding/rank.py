"""trim.shard_embedding on a rank: the input embedding replaced by DeepSpeed's VocabParallelEmbedding, before or after
`init_inference` (dsexp.engines.init_inference)."""

from __future__ import annotations

from typing import Any, Dict

from dsexp.trims.rank import empty_cache, nbytes


def vocab_parallel_embedding():
    """DeepSpeed's VocabParallelEmbedding, or a clear error naming the installed version (0.14.4 has none)."""
    try:
        from deepspeed.module_inject.layers import VocabParallelEmbedding
    except ImportError:
        import deepspeed

        raise RuntimeError(
            f"trim.shard_embedding needs DeepSpeed's VocabParallelEmbedding (deepspeed.module_inject.layers), "
            f"which deepspeed {deepspeed.__version__} does not have (0.19.8 has it)"
        ) from None
    return VocabParallelEmbedding


def shard_embedding(model, group, grain: int, when: str) -> Dict[str, Any]:
    """Replace the input embedding by DeepSpeed's VocabParallelEmbedding on `group` (rows split as AutoTP splits:
    get_shard_size_list with the model's AutoTPMeta and the embedding's qualified name)."""
    import torch.nn as nn
    from deepspeed.module_inject.tp_shard import AutoTPMeta

    vpe = vocab_parallel_embedding()
    emb = model.get_input_embeddings()
    name = next(n for n, m in model.named_modules() if m is emb)
    if type(emb) is not nn.Embedding:
        raise RuntimeError(f"trim.shard_embedding: {name} is {type(emb).__name__}, not nn.Embedding")
    before = nbytes(emb.weight)
    device_type = emb.weight.device.type
    if device_type not in ("cpu", "meta"):  # after init: the full table leaves the device before the split
        emb.to("cpu")
        empty_cache(device_type)
    new = vpe(emb, group, name=name, tp_meta=AutoTPMeta.from_model_config(model.config, grain))
    model.set_input_embeddings(new)
    return {
        "module": name,
        "replaced_by": type(new).__name__,
        "when": when,
        "rows": [new.vocab_start_index, new.vocab_end_index],
        "bytes_before": before,
        "bytes_after": nbytes(new.weight),
    }
