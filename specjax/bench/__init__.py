"""Benchmarks: ``python -m specjax.bench {decode,train,spec,serve} --help``. Each prints a table."""
