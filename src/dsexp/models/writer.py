"""Random-weight checkpoints at a named architecture's exact shapes, written once and cached by key.

No hub is needed: the model is built on the meta device to learn its tensor names and shapes, then
each tensor is drawn from a seeded generator (scaled so activations stay O(1)) and written shard by
shard, so the writer never holds more than one shard in memory.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

from dsexp.core.fs import build_once
from dsexp.models import presets
from dsexp.models.presets import torch_dtype

DONE_MARK = ".dsexp-complete.json"


@dataclass
class WriteStats:
    path: Path
    bytes: int = 0
    seconds: float = 0.0
    cache_hit: bool = True
    weights_s: float = 0.0  # of seconds: drawing and writing the weights (not building the model skeleton)


def checkpoint_key(
    arch: Optional[str],
    dims: Dict[str, Any],
    dtype: str,
    fmt: str,
    seed: int,
    shard_mb: float,
    config_path: Optional[str] = None,
) -> str:
    """Identity of a written checkpoint: arch, dims, dtype, format, seed, shards, and the content of the config
    folder (config.json and its code) or of a preset's shipped code."""
    code = presets.code_digest(arch, config_path)
    blob = json.dumps(
        {
            "arch": arch,
            "dims": dims,
            "dtype": dtype,
            "format": fmt,
            "seed": seed,
            "shard_mb": shard_mb,
            "v": 2,  # 2: a byte-level tokenizer beside the weights
            **({"code": code} if code else {}),
            **({"config_folder": True} if config_path else {}),
        },
        sort_keys=True,
    )
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def checkpoint_dir(cache_dir: str, name: str, key: str) -> Path:
    return Path(cache_dir).expanduser() / "models" / f"{name}-{key}"


def cached_checkpoint(
    cache_dir: str,
    name: str,
    arch: str,
    dims: Dict[str, Any],
    dtype: str,
    fmt: str = "safetensors",
    seed: int = 0,
    shard_mb: float = 100,
    config_path: Optional[str] = None,
    trust_remote_code: bool = False,
) -> Optional[Path]:
    """The folder of this checkpoint when a complete copy is cached (a finished copy is final: no lock), else None."""
    final = checkpoint_dir(cache_dir, name, checkpoint_key(arch, dict(dims), dtype, fmt, seed, shard_mb, config_path))
    return final if (final / DONE_MARK).is_file() else None


def ensure_checkpoint(
    cache_dir: str,
    name: str,
    arch: str,
    dims: Dict[str, Any],
    dtype: str,
    fmt: str = "safetensors",
    seed: int = 0,
    shard_mb: float = 100,
    config_path: Optional[str] = None,
    trust_remote_code: bool = False,
) -> WriteStats:
    """Return the folder of this checkpoint, writing it first if no complete copy is cached."""
    key = checkpoint_key(arch, dict(dims), dtype, fmt, seed, shard_mb, config_path)
    final = checkpoint_dir(cache_dir, name, key)

    def build(tmp: Path) -> Dict[str, Any]:
        t0 = time.perf_counter()
        nbytes, weights_s = write_checkpoint(
            tmp, arch, dict(dims), dtype, fmt, seed, shard_mb, config_path, trust_remote_code
        )
        return {"bytes": nbytes, "seconds": time.perf_counter() - t0, "weights_s": weights_s, "key": key}

    done, hit = build_once(final, DONE_MARK, build)
    if hit:
        return WriteStats(final)
    return WriteStats(final, done["bytes"], done["seconds"], cache_hit=False, weights_s=done["weights_s"])


def meta_model(
    arch: Optional[str],
    dims: Dict[str, Any],
    dtype: str,
    config_path: Optional[str] = None,
    trust_remote_code: bool = False,
    real_buffers: bool = False,
):
    """The model of this architecture built on the meta device (no memory), with its HF config, its tensors in
    `dtype` as from_pretrained(dtype=...) makes them (buffers the modeling code builds in fp32 stay fp32).
    real_buffers: parameters on meta, buffers computed for real (their values, as a load=meta rank builds them)."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = presets.make_config(arch, dims, dtype, config_path, trust_remote_code)
    if not config_path and presets.remote_code(arch):
        # Calling a model class directly builds in torch's default dtype (fp32) whatever the config says;
        # _from_config (what AutoModel.from_config calls) applies the dtype, also for a remote-code class.
        build = _model_class(arch, cfg)._from_config
    else:
        remote = presets.remote_code(arch, config_path)
        build = functools.partial(AutoModelForCausalLM.from_config, trust_remote_code=remote)
    if real_buffers:
        from accelerate import init_empty_weights

        place = init_empty_weights(include_buffers=False)
    else:
        place = torch.device("meta")
    with place:
        model = build(cfg, dtype=torch_dtype(dtype))
    if not getattr(cfg, "architectures", None):
        cfg.architectures = [type(model).__name__]
    return cfg, model


def tensor_specs(
    arch: Optional[str],
    dims: Dict[str, Any],
    dtype: str,
    config_path: Optional[str] = None,
    trust_remote_code: bool = False,
) -> Tuple[Any, List[Tuple[str, tuple]]]:
    """The HF config and the (name, shape) of every tensor a checkpoint of this model holds."""
    cfg, model = meta_model(arch, dims, dtype, config_path, trust_remote_code)
    seen, specs = set(), []
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:  # tied weights are stored once
            continue
        seen.add(id(t))
        specs.append((name, tuple(t.shape)))
    return cfg, specs


def _model_class(arch: str, cfg):
    from dsexp.models.internlm2 import model_class

    return model_class()


def write_checkpoint(
    folder: Path,
    arch: Optional[str],
    dims: Dict[str, Any],
    dtype: str,
    fmt: str,
    seed: int,
    shard_mb: int,
    config_path: Optional[str] = None,
    trust_remote_code: bool = False,
) -> Tuple[int, float]:
    """Write config.json and the weight shards (+ index) into folder; return bytes of weights and the seconds
    spent drawing and writing them. A config folder's code files are copied in beside them."""
    folder.mkdir(parents=True)
    cfg, specs = tensor_specs(arch, dims, dtype, config_path, trust_remote_code)
    if config_path:
        for src in presets.code_files(config_path):
            shutil.copyfile(src, folder / src.name)
    elif presets.remote_code(arch):
        from dsexp.models.internlm2 import write_remote_code

        write_remote_code(folder)
    cfg.save_pretrained(folder)
    write_tokenizer(folder)
    shards = list(plan_shards(specs, torch_dtype(dtype).itemsize, shard_mb))
    ensure_space(folder, sum(math.prod(shape) for _, shape in specs) * torch_dtype(dtype).itemsize)
    n = len(shards)
    t0 = time.perf_counter()
    weight_map, total, pending = {}, 0, []
    # Draw shard i+1 while shard i is written: generation (GPU if present) and disk overlap.
    with ThreadPoolExecutor(max_workers=2) as pool:
        for i, shard in enumerate(shards, 1):
            fname = (
                f"model-{i:05d}-of-{n:05d}.safetensors"
                if fmt == "safetensors"
                else f"pytorch_model-{i:05d}-of-{n:05d}.bin"
            )
            tensors = {name: random_tensor(name, shape, dtype, seed) for name, shape in shard}
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map.update({name: fname for name in tensors})
            pending.append(pool.submit(_save, tensors, folder / fname, fmt))
            del tensors
            if len(pending) >= 2:  # at most two shards in memory
                pending.pop(0).result()
        for fut in pending:
            fut.result()
    index = "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
    (folder / index).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return total, time.perf_counter() - t0


class NoSpaceError(OSError):
    """The checkpoint would not fit the disk of the cache: said before a byte of it is written."""


GIB = 2**30
SPACE_MARGIN = GIB // 2  # the index, the tokenizer and what else writes there meanwhile


def ensure_space(folder: Path, nbytes: int) -> None:
    """Refuse to write nbytes of weights into folder (inside <cache>/models) when its disk has not that much free,
    naming the checkpoints cached beside it, largest first: on the H200's 64 GiB disk one cached 20B checkpoint left
    no room for a second, and the write failed 20 GiB in (No space left on device)."""
    free = shutil.disk_usage(folder).free
    if nbytes + SPACE_MARGIN <= free:
        return
    models = folder.parent
    cached = sorted(
        ((sum(f.stat().st_size for f in d.rglob("*") if f.is_file()), d) for d in models.iterdir() if d.is_dir()),
        reverse=True,
    )
    others = [f"{d} ({size / GIB:.2f} GiB)" for size, d in cached if d != folder and size > 0]
    raise NoSpaceError(
        f"the checkpoint needs {nbytes / GIB:.2f} GiB and {models} has {free / GIB:.2f} GiB free"
        + (f"; cached there: {', '.join(others[:5])}: delete those not needed" if others else "")
        + ", or set cache_dir to a larger disk"
    )


SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


def write_tokenizer(folder: Path) -> None:
    """A byte-level tokenizer (3 special tokens + 256 bytes: any model's vocabulary holds it), so a user's script
    that loads the folder's tokenizer and decodes runs as written. Ids beyond it decode to nothing."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *byte_chars])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "</s>",
        "model_max_length": 1 << 20,
        "model_input_names": ["input_ids", "attention_mask"],
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def plan_shards(specs, itemsize: int, shard_mb: int) -> Iterator[list]:
    limit = max(1, int(shard_mb * 2**20))
    cur, size = [], 0
    for name, shape in specs:
        nbytes = itemsize * math.prod(shape)
        if cur and size + nbytes > limit:
            yield cur
            cur, size = [], 0
        cur.append((name, shape))
        size += nbytes
    if cur:
        yield cur


def _save(tensors, path: Path, fmt: str) -> None:
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(tensors, str(path), metadata={"format": "pt"})
    else:
        import torch

        torch.save(tensors, path)


def _gen_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def random_tensor(name: str, shape: tuple, dtype: str, seed: int, device: Optional[str] = None):
    """Seeded by (seed, name): norms are ones, biases zeros, matrices N(0, 1/fan_in) (embeddings N(0, 1))."""
    import torch

    dt = torch_dtype(dtype)
    if len(shape) == 1:
        return (torch.zeros if name.endswith("bias") else torch.ones)(shape, dtype=dt)
    device = device or _gen_device()
    g = torch.Generator(device=device)
    g.manual_seed(int(hashlib.sha1(f"{seed}:{name}".encode()).hexdigest()[:15], 16))
    is_embedding = name.endswith(("embed_tokens.weight", "tok_embeddings.weight"))
    std = 1.0 if is_embedding else shape[-1] ** -0.5
    t = torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, std, generator=g)
    return t.to(dt).cpu().contiguous()


def main(argv=None) -> int:
    """`python -m dsexp.models.writer '<json kwargs of ensure_checkpoint>'`: write in a child process.

    The job process calls this as a subprocess so that drawing weights on a GPU never leaves a CUDA
    context (and cached blocks) in the long-lived Hydra process, where they would count against GPU 0.
    """
    kwargs = json.loads((sys.argv[1:] if argv is None else argv)[0])
    st = ensure_checkpoint(**kwargs)
    print(
        json.dumps(
            {
                "path": str(st.path),
                "bytes": st.bytes,
                "seconds": st.seconds,
                "weights_s": st.weights_s,
                "cache_hit": st.cache_hit,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
