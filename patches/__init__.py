"""Patches of SGLang symbols, installed as `pooled_runner.patches`; one upstream symbol per module.

Nothing here is applied at import time: the launcher applies each patch explicitly.
"""
