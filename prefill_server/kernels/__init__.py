"""Attention kernels. Each kernel package has a plan/run API, a Triton implementation and a plain
PyTorch ``reference.py`` it is tested against. Importing this package never imports Triton."""
