"""What tests and tools share to run megaq on several local ranks (ranks.py). The top
layer: nothing in the library imports it (tests/test_import_layers.py)."""
