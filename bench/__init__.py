"""kvd's benchmarks: every figure printed beside its anchor, measured in the same run.

Run each as a module from the repository root, e.g. ``python -m bench.replay --help``;
``bench/README.md`` lists the commands and the last results.
"""
