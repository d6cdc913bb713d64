"""How each linear product of the model runs: the table that picks a kernel for it (`table.py`)
and the one ordered walk that installs the picked kernels, then the LoRA slots (`walk.py`)."""
