"""`python -m dsexp.campaign.model_dir model=... [model.dims.x=...]`: write a model preset's checkpoint where a job
would (the model cache) unless it is there, and print its folder: a campaign hands it to a user's script."""

import sys

from dsexp.compose.config import compose_app, to_schema
from dsexp.job.run import prepare_model

if __name__ == "__main__":
    print(prepare_model(to_schema(compose_app(sys.argv[1:])))["model_dir"])
