"""The generate phase: a fixed prompt, a fixed number of greedy tokens, and the first step's logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

from dsexp.core.context import RankContext


def prompt_ids(ctx: RankContext, vocab_size: int) -> List[int]:
    """Token ids of the prompt: the folder's tokenizer if it has one, else the prompt's bytes mod vocab."""
    folder = Path(ctx.model_dir)
    if any((folder / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=ctx.spec.model.trust_remote_code)
        return tok(ctx.spec.generate.prompt)["input_ids"]
    return [b % vocab_size for b in ctx.spec.generate.prompt.encode()]


def run_generate(module, ctx: RankContext, extra: Dict[str, Any]) -> Dict[str, Any]:
    """Greedy decode exactly `new_tokens` tokens; return ids and the first step's logits (fp32, CPU)."""
    import torch

    cfg = module.config
    ids = prompt_ids(ctx, cfg.vocab_size)
    dev = ctx.device if ctx.on_gpu else "cpu"
    inp = torch.tensor([ids], device=dev)
    n = ctx.spec.generate.new_tokens
    with torch.no_grad():
        out = module.generate(
            inp,
            attention_mask=torch.ones_like(inp),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            **extra,
        )
    logits = out.logits[0][0]
    if hasattr(logits, "full_tensor"):  # DTensor from a TP plan
        logits = logits.full_tensor()
    return {"prompt_ids": ids, "tokens": out.sequences[0, len(ids) :].tolist(), "first_logits": logits.float().cpu()}
