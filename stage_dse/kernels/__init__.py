"""Kernel latencies measured on real GPUs (optional extra ``measured``): reading the tables of
``aiconfigurator-core`` and interpolating them over arrays of op shapes."""
