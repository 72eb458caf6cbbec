"""Which linears of a decoder layer AutoTP must make row-parallel (all-reduce): `engine.injection_policy=infer`.

DeepSpeed's AutoTP needs, per decoder-layer class, the names of its row-parallel linears (every other Linear in the
layer is split column-wise). Its own parser (`AutoTP.tp_parser`) finds them by names (`o_proj`, `out_proj`,
`down_proj`, ...) and by the Linear registered just before a LayerNorm; a layout with other names and RMSNorm classes
(InternLM2: `attention.wo`, `feed_forward.w2`) defeats it ("Not able to determine model policy automatically").

`infer_policy` answers, in this order:
1. `known`: dsexp's table of layouts by layer class name (KNOWN);
2. `deepspeed`: DeepSpeed's parser, when it finds a policy (the engine then lets DeepSpeed apply its own);
3. `inferred`: the structural rule, from the modules alone (works on the meta device, needs no forward pass):
   each direct child of the layer that holds linears (the attention block, the MLP; the layer's own linears
   form one group) is a sub-block whose output is added to the residual stream, so exactly its last
   projection back to the hidden size is row-parallel. Among the group's linears writing `hidden_size`
   features, those that read another width are down-projections (MLP `down_proj`/`w2`, an attention output
   whose heads do not span the hidden size): all of them; if there are none (attention with
   heads x head_dim == hidden), the last one registered (`o_proj` after `q_proj`). Agrees with DeepSpeed's
   parser on every layout of the architecture matrix where the parser finds one (tests/test_policy.py).

Imported by the ranks and by the analysis (no Hydra, no job side): torch, transformers and DeepSpeed only.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

# Layer class name -> its row-parallel linears, as DeepSpeed names them ("<parent>.<attribute>").
KNOWN: Dict[str, Tuple[str, ...]] = {
    # InternLM2 / InternLM2.5 (remote code as published): attention.{wqkv, wo}, feed_forward.{w1, w3, w2},
    # RMSNorm classes named attention_norm / ffn_norm; DeepSpeed's parser finds none of them.
    "InternLM2DecoderLayer": ("attention.wo", "feed_forward.w2"),
}

SOURCES = ("known", "deepspeed", "inferred")


def decoder_layers(model) -> List[Any]:
    """One instance per decoder-layer class: the children of every nn.ModuleList, as AutoTP.get_module_list."""
    import torch.nn as nn

    found: Dict[str, Any] = {}

    def walk(module):
        for child in module.children():
            if isinstance(child, nn.ModuleList):
                for layer in child.children():
                    found.setdefault(type(layer).__name__, layer)
            else:
                walk(child)

    walk(model)
    return list(found.values())


def is_linear(module) -> bool:
    import torch.nn as nn

    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover
        Conv1D = ()
    return isinstance(module, nn.Linear) or (bool(Conv1D) and isinstance(module, Conv1D))


def features(module) -> Tuple[int, int]:
    """(in, out) features of a Linear or a transformers Conv1D (which stores its weight as [in, out])."""
    if hasattr(module, "in_features"):
        return int(module.in_features), int(module.out_features)
    shape = tuple(getattr(module.weight, "ds_shape", None) or module.weight.shape)
    return int(shape[0]), int(module.nf)


def ds_name(rel: str) -> str:
    """DeepSpeed's name for a linear at `rel` inside a layer: '<immediate parent>.<attribute>' ('.fc2' directly)."""
    parts = rel.split(".")
    return f"{parts[-2] if len(parts) > 1 else ''}.{parts[-1]}"


def hidden_size(model) -> Optional[int]:
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    h = getattr(cfg, "hidden_size", None) if cfg is not None else None
    if h:
        return int(h)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return int(emb.embedding_dim) if emb is not None else None


def layer_rule(layer, hidden: int) -> Tuple[List[str], List[str]]:
    """(row-parallel names, one reason per sub-block) for one decoder layer by the structural rule."""
    groups: Dict[str, List[Tuple[str, Any]]] = {}
    for name, child in layer.named_children():
        if is_linear(child):
            groups.setdefault("", []).append((name, child))
        else:
            linears = [(f"{name}.{n}", m) for n, m in child.named_modules() if n and is_linear(m)]
            if linears:
                groups[name] = linears
    rows, why = [], []
    for block, linears in groups.items():
        writes = [(n, m) for n, m in linears if features(m)[1] == hidden]
        if not writes:
            continue
        down = [(n, m) for n, m in writes if features(m)[0] != hidden]
        picked = down or writes[-1:]
        for n, m in picked:
            rows.append(ds_name(n))
            fin, fout = features(m)
            how = (
                f"reads {fin} features, writes the hidden size {fout}"
                if down
                else f"the last Linear of the block writing the hidden size {fout}"
            )
            why.append(f"{n} ({how}; in {'the layer itself' if not block else f'`{block}`'})")
    return sorted(set(rows)), why


def structural_rule(model) -> Tuple[Dict[str, List[str]], str]:
    """({layer class: row-parallel names}, why) from the modules alone."""
    hidden = hidden_size(model)
    if not hidden:
        return {}, "the model's config has no hidden_size and it has no input embedding"
    policy, reasons = {}, []
    for layer in decoder_layers(model):
        rows, why = layer_rule(layer, hidden)
        if rows:
            policy[type(layer).__name__] = rows
            reasons.append(f"{type(layer).__name__}: " + "; ".join(why))
    if not policy:
        return {}, f"no decoder layer has a Linear writing the hidden size ({hidden})"
    return policy, (
        "derived from the module structure: in each sub-block of the decoder layer, the projection back to the "
        f"hidden size ({hidden}) is row-parallel, every other Linear column-parallel. " + " | ".join(reasons)
    )


def deepspeed_policy(model) -> Tuple[Optional[Dict[str, List[str]]], str]:
    """DeepSpeed's own parser: ({layer class: names}, '') or (None, its refusal)."""
    from deepspeed.module_inject.auto_tp import AutoTP

    try:
        found = AutoTP.tp_parser(model)
    except AssertionError as e:
        return None, str(e) or "AssertionError"
    return {cls.__name__: sorted(gems) for cls, gems in found}, ""


def infer_policy(model, use_deepspeed: bool = True) -> Dict[str, Any]:
    """{"policy": {layer class: [names]} or None, "source": known|deepspeed|inferred|None, "why": ...,
    "rule": what the structural rule derives, "agrees": whether the rule gives the chosen policy}."""
    rule, rule_why = structural_rule(model)
    layers = [type(m).__name__ for m in decoder_layers(model)]
    known = {c: list(KNOWN[c]) for c in layers if c in KNOWN}
    out: Dict[str, Any] = {"rule": rule}
    if known:
        out.update(
            policy=known,
            source="known",
            why=f"{', '.join(known)} is in dsexp's table of known layouts (dsexp.models.policy.KNOWN)",
        )
    else:
        refusal = ""
        if use_deepspeed:
            found, refusal = deepspeed_policy(model)
            if found:
                out.update(
                    policy=found, source="deepspeed", why="DeepSpeed's AutoTP parser found it (AutoTP.tp_parser)"
                )
        if "policy" not in out:
            why = (f"DeepSpeed found no policy ({refusal}); " if refusal else "") + rule_why
            out.update(policy=rule or None, source="inferred" if rule else None, why=why)
    out["agrees"] = _same(out["rule"], out["policy"]) if out["policy"] else False
    return out


def _same(a: Dict[str, List[str]], b: Dict[str, List[str]]) -> bool:
    norm = lambda p: {k: sorted(n.lstrip(".") for n in v) for k, v in (p or {}).items()}  # noqa: E731
    return norm(a) == norm(b)


def override_text(policy: Dict[str, List[str]]) -> str:
    """The policy as a Hydra override a user can paste: engine.injection_policy={Layer:[a.b,c.d]}."""
    body = ",".join(f"{cls}:[{','.join(names)}]" for cls, names in sorted(policy.items()))
    return "engine.injection_policy={" + body + "}"
