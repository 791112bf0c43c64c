"""kvactors.actors."""
