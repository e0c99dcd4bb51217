"""The recipe that builds `deepseek-tiny`: corpus -> tokenizer -> packed tokens -> training -> checkpoint.

Run it end to end with `python -m engine.tools.tiny all --out DIR` (see README.md beside this file).
"""
