"""Runnable examples of DSA (Disk Sparse Adam): ``python -m examples.<name>``.

See examples/README.md for the list, the commands and measured numbers.
"""
