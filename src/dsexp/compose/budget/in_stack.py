"""The search's guess replayed under the transformers its configuration's stack pins, run in a process with the
stack's overlay first on the path (dsexp.compose.budget.model.replayed_in_stack starts it): the trace is
transformers' own generate, so the frees the replay sees are that version's (docs/FINDINGS.md 6e: 5.17 and 5.24 one
batch apart at 4 x 19 GiB tp=4 trimmed).

`python -m dsexp.compose.budget.in_stack OUT` reads {spec, cap, largest} as JSON on stdin and writes
dsexp.compose.budget.model.replay_here's answer to OUT."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dsexp.compose.budget.model import predict_spec, replay_here
from dsexp.core.schema import JobConfig, from_dict


def main(out: str) -> None:
    request = json.loads(sys.stdin.read())
    spec = from_dict(JobConfig, request["spec"])
    found = replay_here(predict_spec(spec), spec, int(request["cap"]), int(request["largest"]))
    Path(out).write_text(json.dumps(found))


if __name__ == "__main__":
    main(sys.argv[1])
