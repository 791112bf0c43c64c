"""kvactors.kernels."""
