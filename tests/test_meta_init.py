"""DeepSpeed's own AutoTP init run on the meta device as each rank (dsexp.engines.init_inference.placement:
`rank_init`, `init_fails`): it holds every tensor as the real runs held it, and `dsexp.plan` says where a run's init
would fail instead of predicting its memory."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from dsexp.compose.budget.model import predict_spec, script_config
from dsexp.engines.init_inference import placement as autotp
from dsexp.engines.init_inference.placement import autotp_rules
from dsexp.predict import architecture as arch

from helpers.plan import plan
from helpers.run import ROOT, spec_of

CENSUS = Path(__file__).parent / "data" / "arch_matrix_census.json"


def meta_model_and_strategy(*overrides: str, tp: int):
    spec = spec_of(*overrides, f"tp={tp}", gpus=tp)
    pred = predict_spec(spec)
    return arch.meta_model(arch.model_source(script_config(spec), None), pred.strategy.dtype), pred


def held_bytes(model) -> dict:
    return {n: t.numel() * t.element_size() for n, t in [*model.named_parameters(), *model.named_buffers()]}


def test_each_ranks_meta_init_holds_every_tensor_as_the_cpu_runs_held_it():
    """The CPU architecture matrix's AutoTP runs at tp=2 (the census of every run that got through init, 12
    architectures): DeepSpeed's init on the meta device, as rank 0 and as rank 1, leaves each tensor the bytes that
    rank of the run held, tensor by tensor."""
    census = json.loads(CENSUS.read_text())
    runs = {r["config"]["model"]["name"]: r for r in census if r["config"]["engine"]["name"] == "init_inference"}
    assert len(runs) >= 12
    for name, run in sorted(runs.items()):
        model, pred = meta_model_and_strategy(f"model={name}", "engine.injection_policy=infer", tp=2)
        rules = autotp_rules(model, pred.strategy, 2, [], {})
        for rank in run["ranks"]:
            measured = rank["phases"]["init"]["tensors"]
            held = held_bytes(autotp.rank_init(model, rules, pred.strategy, 2, rank["rank"]))
            assert {n: held.get(n) for n in measured} == measured, (name, rank["rank"])


def test_at_a_tp_that_does_not_divide_the_kv_heads_the_meta_init_agrees_with_the_rules_on_every_rank():
    """InternLM2 tiny at tp=3 (4 KV heads: 2, 1, 1), whose CPU run was ok: DeepSpeed's init on the meta device and
    the placement rules give each rank the same bytes for every tensor, and the ranks differ."""
    model, pred = meta_model_and_strategy("model=internlm2_tiny", tp=3)
    rules = autotp_rules(model, pred.strategy, 3, [], {})
    totals = []
    for rank in range(3):
        held = held_bytes(autotp.rank_init(model, rules, pred.strategy, 3, rank))
        want = {p.name: p.local[rank] for p in pred.placements if p.name in held}
        assert {n: held[n] for n in want} == want, rank
        totals.append(sum(want.values()))
    assert totals[0] > totals[1] > totals[2]


def generate_or_error(model, world=None):
    """The generate's allocations and frees, in order (dsexp.predict.meta_trace), or the error it raised."""
    import contextlib

    from dsexp.predict.meta_trace import generate_events

    with world or contextlib.nullcontext():
        try:
            return generate_events(model, 2, 16, 3)
        except Exception as e:
            return f"{type(e).__name__}: {str(e).splitlines()[0]}"


def test_the_replays_rank_model_allocates_in_generate_as_deepspeeds_own_rank_model_does():
    """The model the replay traces (placement.rank_model: dsexp's copy of AutoTP's splits) against DeepSpeed's own
    rank model (its init on the meta device, its generate traced in the same process group that moves no data):
    the same allocations and frees in the same order, for every architecture of the CPU matrix at tp=2 and for
    InternLM2 tiny's first and last rank at tp=3; where one fails in generate (bloom, falcon, OLMoE, Phi-3) the
    other fails with the same error. GPT-J's head has a bias, which DeepSpeed's LmHeadLinearAllreduce adds in
    place: the rank model did it out of place, one logits tensor more per step, until this test found it."""
    from dsexp.engines.placement import RULES

    census = json.loads(CENSUS.read_text())
    cases = [(r["config"]["model"]["name"], 2, 0) for r in census if r["config"]["engine"]["name"] == "init_inference"]
    failing = set()
    for name, tp, rank in sorted(cases) + [("internlm2_tiny", 3, 0), ("internlm2_tiny", 3, 2)]:
        model, pred = meta_model_and_strategy(f"model={name}", "engine.injection_policy=infer", tp=tp)
        ours, _ = RULES.rank_model(model, pred.strategy, pred.placements, rank, tp)
        rules = autotp_rules(model, pred.strategy, tp, [], {})
        theirs = autotp.rank_init(model, rules, pred.strategy, tp, rank)
        mine, ds = generate_or_error(ours), generate_or_error(theirs, autotp.fake_world(tp, rank))
        assert mine == ds, (
            name,
            tp,
            rank,
            mine if isinstance(mine, str) else len(mine),
            ds if isinstance(ds, str) else len(ds),
        )
        if isinstance(mine, str):
            failing.add(name)
    assert failing == {"tiny_bloom", "tiny_falcon", "tiny_olmoe", "tiny_phi3"}


def test_the_plan_says_gpt2_fails_in_deepspeeds_init_at_tp2_and_in_generate_at_tp1(capsys, tmp_path):
    """GPT-2's AutoTP run at tp=2 failed in init (results/cpu/arch_matrix.md: DeepSpeed splits the Conv1D c_attn
    by its input width along its output dim). The plan says so, with DeepSpeed's own message, and predicts no memory.
    At tp=1 with the same policy DeepSpeed splits nothing but wraps each Conv1D as a Linear, and a CPU run failed in
    generate ("mat1 and mat2 shapes cannot be multiplied (18x128 and 384x128)"): the plan predicts its memory and
    its replay, traced on the model DeepSpeed's init leaves, fails on the same 384 x 128 weight."""
    row = next(line for line in (ROOT / "results/cpu/arch_matrix.md").read_text().splitlines() if "tiny_gpt2" in line)
    recorded = re.search(r"RuntimeError: (split_with_sizes expects split_sizes to sum exactly to \d+)", row).group(1)
    status, entries, text, err = plan(
        capsys, tmp_path, "--replay", "-m", "model=tiny_gpt2", "tp=1,2", "engine.injection_policy=infer",
        "gpu=a100_40gb", "generate.new_tokens=2",
    )  # fmt: skip
    assert status == 0, err
    by_tp = {e["tp"]: e for e in entries}
    assert by_tp[2]["status"] == "fails_in_init" and "largest_batch" not in by_tp[2]
    assert recorded in by_tp[2]["reason"] and "on rank 0 of 2" in by_tp[2]["reason"]
    assert f"fails in init: {by_tp[2]['reason']}" in text
    (fit,) = by_tp[1]["largest_batch"].values()
    assert by_tp[1]["status"] == "predicted" and fit["largest_batch"] > 0
    why = fit["replayed"]["not_replayed"]
    assert why.startswith("its generate fails as rank 0 holds the model") and "[384, 128]" in why, why


def test_the_meta_init_leaves_this_process_as_it_found_it():
    """No process group stays up, DeepSpeed's communication backend and the excepthook are the ones before (torch
    installs a rank-prefixing hook with each process group), even where DeepSpeed's init raised; and no rank's
    variables are left in the environment that the budget search launches its jobs with."""
    import os

    import deepspeed.comm.comm as ds_comm
    import torch.distributed as tdist

    launch = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: os.environ.get(k) for k in launch}
    hook, backend = sys.excepthook, ds_comm.cdb
    autotp._INIT_VERDICTS.clear()  # DeepSpeed's init runs here, not a verdict kept from another test
    for name in ("tiny_gpt2", "tiny_llama"):
        model, pred = meta_model_and_strategy(f"model={name}", "engine.injection_policy=infer", tp=2)
        why = autotp.init_fails(model, pred.strategy, 2)
        assert (why is not None) == (name == "tiny_gpt2")
        assert not tdist.is_initialized() and sys.excepthook is hook and ds_comm.cdb is backend
        assert {k: os.environ.get(k) for k in launch} == env


def test_a_budget_search_launches_no_configuration_whose_init_fails_and_says_why(tmp_path, cache_dir):
    """A search over GPT-2 at tp=2 (its AutoTP init fails): nothing is launched, and the search and its report say
    why, with DeepSpeed's error, rather than loading the model to see it fail."""
    from helpers.run import run_dsexp

    args = ["-m", "model=tiny_gpt2", "tp=2", "engine.injection_policy=infer", "debug=fast",
            "generate.prompt_tokens=64", "budget.gpus=2", "budget.gpu_gib=1", "tracking=none",
            "hydra.sweep.dir=sw"]  # fmt: skip
    out = run_dsexp(args, tmp_path, cache_dir).stdout
    assert "not launched: as given: DeepSpeed's AutoTP init fails on rank 0 of 2" in out
    state = json.loads((tmp_path / "sw" / "budget.json").read_text())
    (gpt2,) = state["configs"]
    assert gpt2["points"] == [] and state["jobs"] == [] and "split_with_sizes" in gpt2["fails_in_init"]
    assert not [p for p in (tmp_path / "sw").iterdir() if p.name.isdigit()]  # no job folder
    summary = (tmp_path / "sw" / "summary.md").read_text()
    assert "- **No configuration can run**: the engine's init fails" in summary
    assert "Not launched (the engine's init fails, run on the meta device as each rank):" in summary
    assert "- `as given`: DeepSpeed's AutoTP init fails on rank 0 of 2" in summary
    assert "| configuration | predicted largest" not in summary  # no runs table: nothing ran


def test_the_init_of_one_layer_of_each_structure_gives_every_layers_verdict_and_restores_the_model():
    """DeepSpeed's init run on the first layer of each structure (an 80-layer model's on one) says what its run on
    every layer says, the error word for word where it fails (GPT-2's Conv1D), and leaves the model's layer lists as
    they were; a list of two structures keeps one of each."""
    import torch.nn as nn

    for name in ("tiny_gpt2", "tiny_llama", "tiny_mixtral"):
        model, pred = meta_model_and_strategy(f"model={name}", "engine.injection_policy=infer", tp=2)
        rules = autotp_rules(model, pred.strategy, 2, [], {})
        layers = {n: list(m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)}
        every = autotp._first_failing(model, rules, pred.strategy, 2)
        assert autotp._first_failing_rank(model, rules, pred.strategy, 2) == every
        assert (every is not None) == (name == "tiny_gpt2")
        assert {n: list(m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)} == layers
    model, pred = meta_model_and_strategy("model=tiny_llama", tp=2)
    rules = autotp_rules(model, pred.strategy, 2, [], {})
    (stack,) = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    with autotp.one_layer_of_each_kind(model, rules):
        assert len(stack_of(model)) == 1  # identical layers: the first stands for all
    other = stack[1].mlp.up_proj
    stack[1].mlp.up_proj = nn.Linear(other.in_features, other.out_features + 64, bias=False, device="meta")
    try:
        with autotp.one_layer_of_each_kind(model, rules):
            assert len(stack_of(model)) == 2
        with autotp.one_layer_of_each_kind(model, {}):  # no policy layer in the list: left whole
            assert len(stack_of(model)) == len(stack)
    finally:
        stack[1].mlp.up_proj = other


def stack_of(model):
    import torch.nn as nn

    return next(m for m in model.modules() if isinstance(m, nn.ModuleList))
