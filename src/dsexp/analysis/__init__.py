"""The answer to a sweep: memory model (memory.py, from the model's config alone, placing tensors by the engines' and
trims' rules: dsexp.engines.<name>.placement, dsexp.trims.<key>.placement), diagnosis rules (diagnosis.py),
the matrix and recommendation (matrix.py), plots (plots.py) and the report files + MLflow copy (report.py).
Inputs are result dicts (sources.py: result.json files, or MLflow runs); nothing here runs a model."""
