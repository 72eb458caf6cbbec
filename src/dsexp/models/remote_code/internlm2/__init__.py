"""InternLM2 layout, written into checkpoint folders as `configuration_internlm2.py` / `modeling_internlm2.py`.

These two files must stay self-contained (torch + transformers only): transformers copies them out of
the checkpoint folder and imports them as a dynamic module.
"""
