"""kvactors.devices."""
