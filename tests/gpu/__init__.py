"""The GPU lane (`pytest -m cuda`; docs/benchmarks.md, "GPU lane").

A package so that tests/gpu/conftest.py is imported as gpu.conftest: two conftest.py files
outside packages are both the module `conftest`, and the second would replace
tests/conftest.py for every `from conftest import ...` of the suite."""
