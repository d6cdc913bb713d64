"""A mixture of experts' products as one operator (`op.py`), which model/moe.py calls."""
