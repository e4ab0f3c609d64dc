"""The SGLang layer: everything here may import SGLang (the core never does)."""
