"""Print the checkpoint folder of a model preset, writing it first if it is not cached (as a job would).

    python scripts/gpu/model_dir.py model=internlm2_20b_shapes [model.dims.num_hidden_layers=24 ...]
Used by the GPU scripts to hand a user's script (the seed's main.py) the folder dsexp wrote.
"""

import sys

from dsexp.compose.config import compose_app, to_schema
from dsexp.job.run import prepare_model

if __name__ == "__main__":
    print(prepare_model(to_schema(compose_app(sys.argv[1:])))["model_dir"])
