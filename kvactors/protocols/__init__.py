"""kvactors.protocols."""
