"""Options that begin as the launchers' own do (torchrun's --nnodes, --nproc-per-node, --node-rank, --max-restarts,
--master-addr; DeepSpeed's --num_nodes, --node_rank, --master_port): it writes what it parsed and its sys.argv.

torchrun --nproc_per_node 2 launcher_prefixes.py --n 3 --max 7 --node a --master b parsed
"""
import argparse
import json
import os
import sys

from deepspeed.runtime.utils import see_memory_usage

parser = argparse.ArgumentParser()
parser.add_argument("--n", type=int, required=True)
parser.add_argument("--max", type=int, required=True)
parser.add_argument("--node")
parser.add_argument("--master")
parser.add_argument("--local_rank", type=int)  # the DeepSpeed launcher's
parser.add_argument("out")
args = parser.parse_args()

see_memory_usage(f"parsed --n {args.n}", force=True)
seen = {"args": vars(args), "argv": sys.argv, "name": __name__, "file": __file__, "path0": sys.path[0]}
with open(f"{args.out}.rank{os.environ['RANK']}.json", "w") as f:
    json.dump(seen, f)
